"""Predicts how long one engine step takes from the work in it; fitted online from measured steps.

A step's time is modelled as a linear function of five terms (`TERMS`), each summed over the
scheduled requests of the step; a chunk of c new tokens after p tokens already in the KV cache adds

    token       c                       tokens through the linear layers (QKV/O, MLP, norms)
    seq         1                       per-request work: metadata, gathers, one row of logits + sampling
    attn_pair   c*p + c*(c+1)/2         (query, key) pairs of causal prefill attention (c > 1)
    decode_ctx  p + 1                   KV tokens a decode (c == 1) reads; decode attention is bandwidth-bound

plus `overhead`, a fixed cost per step (launching the forward, Python around it). Coefficients are in
seconds per unit. They are fitted by nonnegative least squares on relative error (a 10 ms decode step
counts as much as a 1 s prefill step) over a sliding window of observed steps, pulled gently towards a
prior: the start-up profile's fit (see `cost_profile.py`) or, without one, rough CPU numbers for a
~135M-parameter model. The pull matters only for terms the window does not pin down (e.g. attention
pairs during a decode-only stretch keep their profiled value).

    profile ─▶ calibrate() ─▶ prior ──┐
    EngineCore.step ─▶ observe(work, seconds) ─▶ window ─▶ refit every `refit_every` steps
    Scheduler / router ─▶ predict(work), largest_chunk(...), prefill_seconds(...)
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from deepinfer.engine.scheduler import SchedulerOutput

TERMS = ("overhead", "token", "seq", "attn_pair", "decode_ctx")
_OVERHEAD, _TOKEN, _SEQ, _PAIR, _CTX = range(len(TERMS))
# Measured roughly on the default model (SmolLM2-135M, float32 + GGUF kernels) on 2 busy x86 cores; used
# only until a profile or enough observed steps replace them.
DEFAULT_COEFFICIENTS = (0.03, 4.5e-4, 5e-4, 2.5e-7, 5e-6)
OUTLIER = 3.0  # see CostModel._fit
PROFILE_PREFILL_TOKENS = 32  # profile steps with this many new tokens or more measure a prefill rate
EXTRAPOLATION_CAP = 3.0  # see CostModel.bounded_prefill_seconds
_PLAIN_CHUNKS = 16  # see step_terms


def empty_step() -> np.ndarray:
    """The terms of a step with nothing scheduled yet: its fixed overhead alone."""
    f = np.zeros(len(TERMS))
    f[_OVERHEAD] = 1.0
    return f


def add_chunk(features: np.ndarray, new_tokens: int, context: int) -> None:
    """Add, in place, the terms one scheduled request brings to a step."""
    features[_TOKEN] += new_tokens
    features[_SEQ] += 1
    if new_tokens == 1:
        features[_CTX] += context + 1
    else:
        features[_PAIR] += new_tokens * context + new_tokens * (new_tokens + 1) / 2


def chunk_features(new_tokens: int, context: int) -> np.ndarray:
    """The terms one scheduled request adds to a step (no step overhead)."""
    f = np.zeros(len(TERMS))
    add_chunk(f, new_tokens, context)
    return f


def step_terms(chunks: Sequence[tuple[int, int]]) -> tuple[float, ...]:
    """The terms of a whole step as plain floats: the overhead (once, if anything runs) plus each chunk's
    terms. It runs for every step (the scheduler's prediction, the observation), with up to max_num_seqs
    chunks: plain Python for a few chunks (a numpy pass costs ~10 us even for one, several times that
    between model steps, whose weight reads leave the host's caches cold), vectorized above. Both give the
    same values (integer-valued sums)."""
    if not chunks:
        return (0.0,) * len(TERMS)
    if len(chunks) <= _PLAIN_CHUNKS:
        token = pair = ctx = 0
        for c, p in chunks:
            token += c
            if c == 1:
                ctx += p + 1
            else:
                pair += c * p + c * (c + 1) // 2
        return 1.0, float(token), float(len(chunks)), float(pair), float(ctx)
    c, p = np.asarray(chunks, dtype=float).T
    decode = c == 1
    return (1.0, float(c.sum()), float(len(c)), float((c * p + c * (c + 1) / 2)[~decode].sum()),
            float((p[decode] + 1).sum()))


def step_features(chunks: Sequence[tuple[int, int]]) -> np.ndarray:
    """`step_terms` as an array."""
    return np.array(step_terms(chunks))


@dataclass(frozen=True)
class StepWork:
    """What one step computes: (new_tokens, context_before) per scheduled request."""

    chunks: tuple[tuple[int, int], ...]

    @classmethod
    def from_output(cls, out: SchedulerOutput) -> StepWork:
        return cls(tuple((s.num_new_tokens, s.start) for s in out.scheduled))

    @property
    def num_tokens(self) -> int:
        return sum(n for n, _ in self.chunks)

    def features(self) -> np.ndarray:
        return step_features(self.chunks)


def nnls(a: np.ndarray, b: np.ndarray, tol: float = 1e-10) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0, for a tall `a` with few full-rank columns (see `nnls_normal`)."""
    return nnls_normal(a.T @ a, a.T @ b, tol)


def nnls_normal(gram: np.ndarray, rhs: np.ndarray, tol: float = 1e-10, start: Sequence[bool] | None = None
                ) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0, given only gram = a^T a and rhs = a^T b: Lawson-Hanson's active set
    on the normal equations, in plain Python (n is the cost model's 5 terms; a numpy call costs more than a
    5 x 5 elimination). `start`: the terms to try as the active set first (the previous fit's positive
    ones): if the solution on them is positive it is the starting point, and a refit whose set did not change
    takes one solve. The cost model keeps its columns scaled to unit norm and its Gram matrix positive
    definite (the prior's rows), so squaring the condition number costs nothing it needs. A refit ran every 8
    steps at ~1.4 ms in the engine (a least-squares solve over the whole window per active-set change), ~2% of
    a single stream's token; now ~0.5 ms there (0.17 ms hot, mostly the Gram matrix's numpy calls)."""
    g = [[float(v) for v in row] for row in gram]
    c = [float(v) for v in rhs]
    n = len(c)
    x = [0.0] * n
    passive = [False] * n
    if start is not None and any(start):
        keep = [i for i in range(n) if start[i]]
        z = _solve_sub(g, c, keep)
        if all(v > tol for v in z):
            for i, v in zip(keep, z, strict=True):
                x[i], passive[i] = v, True
    grad = _gradient(g, c, x)
    for _ in range(3 * n):
        free = [i for i in range(n) if not passive[i]]
        if not free:
            break
        best = max(free, key=grad.__getitem__)  # the first of equal ones, as argmax
        if grad[best] <= tol:
            break
        passive[best] = True
        while True:
            keep = [i for i in range(n) if passive[i]]
            z = [0.0] * n
            for i, v in zip(keep, _solve_sub(g, c, keep), strict=True):
                z[i] = v
            if all(z[i] > tol for i in keep):
                break
            # step from x towards z until the first passive variable hits zero, then drop it
            alpha = min(x[i] / max(x[i] - z[i], 1e-300) for i in keep if z[i] <= tol)
            x = [xi + alpha * (zi - xi) for xi, zi in zip(x, z, strict=True)]
            passive = [p and xi > tol for p, xi in zip(passive, x, strict=True)]
            if not any(passive):
                z = [0.0] * n
                break
        x = z
        grad = _gradient(g, c, x)
    return np.array(x)


def _gradient(g: list[list[float]], c: list[float], x: list[float]) -> list[float]:
    """rhs - gram x"""
    return [ci - sum(gij * xj for gij, xj in zip(row, x, strict=True)) for ci, row in zip(c, g, strict=True)]


def _solve_sub(g: list[list[float]], c: list[float], keep: list[int]) -> list[float]:
    """The unconstrained least-squares solution on the columns `keep`: gram[keep, keep] z = rhs[keep] by
    Gaussian elimination with partial pivoting; a singular subsystem (collinear columns, no prior) gets
    numpy's minimum-norm solution instead."""
    m = len(keep)
    a = [[g[i][j] for j in keep] + [c[i]] for i in keep]
    tiny = 1e-12 * max(abs(g[i][i]) for i in keep)
    for col in range(m):
        piv = max(range(col, m), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) <= tiny:
            sub = np.array([[g[i][j] for j in keep] for i in keep])
            return np.linalg.lstsq(sub, np.array([c[i] for i in keep]), rcond=None)[0].tolist()
        a[col], a[piv] = a[piv], a[col]
        pivot_row = a[col]
        for r in range(col + 1, m):
            f = a[r][col] / pivot_row[col]
            if f:
                row = a[r]
                for k in range(col, m + 1):
                    row[k] -= f * pivot_row[k]
    z = [0.0] * m
    for r in range(m - 1, -1, -1):
        z[r] = (a[r][m] - sum(a[r][k] * z[k] for k in range(r + 1, m))) / a[r][r]
    return z


class CostModel:
    """Step-time predictor: `predict(work) -> seconds`, `observe(work, seconds)`."""

    def __init__(self, coefficients: Iterable[float] | None = None, window: int = 256, refit_every: int = 8,
                 prior_weight: float = 1e-6) -> None:
        self.prior = np.array(tuple(coefficients) if coefficients is not None else DEFAULT_COEFFICIENTS,
                              dtype=float)
        if self.prior.shape != (len(TERMS),) or (self.prior < 0).any():
            raise ValueError(f"need {len(TERMS)} nonnegative coefficients ({', '.join(TERMS)})")
        if window < 1:
            raise ValueError(f"the fit window needs at least one step, got {window}")
        self.coef = self.prior.copy()  # (the setter keeps a plain copy for `observe`)
        self.refit_every = refit_every
        self.prior_weight = prior_weight
        # the fit window, a ring: rows [0, _count) hold samples, _next is where the next one goes
        self._xs = np.zeros((window, len(TERMS)))
        self._ys = np.zeros(window)
        self._count = self._next = 0
        self._since_fit = 0
        # prediction quality of observed steps, each predicted before it joined the fit
        self.num_observations = 0
        self.last_predicted = self.last_actual = self.last_error = 0.0
        self.ema_abs_error = self.ema_step_seconds = 0.0
        self._abs_errors: deque[float] = deque(maxlen=window)
        self.profiled_seconds_per_token = 0.0  # the start-up profile's median rate on fresh prefill chunks

    @property
    def coef(self) -> np.ndarray:
        """The coefficients in `TERMS` order (seconds per unit)."""
        return self._coef

    @coef.setter
    def coef(self, value: Iterable[float]) -> None:
        self._coef = np.array(value, dtype=float)
        self._coef_list = self._coef.tolist()

    @property
    def coefficients(self) -> dict[str, float]:
        return {t: float(c) for t, c in zip(TERMS, self.coef, strict=True)}

    @property
    def num_samples(self) -> int:
        """Measured steps in the fit window (profile steps until observed ones push them out)."""
        return self._count

    @property
    def profiled(self) -> bool:
        """Whether a start-up profile calibrated it (`calibrate`): its prices are this machine's, not the
        rough default ones."""
        return self.profiled_seconds_per_token > 0

    # ------------------------------------------------------------------ predict

    def predict(self, work: StepWork) -> float:
        return self.predict_features(work.features())

    def predict_features(self, features: np.ndarray) -> float:
        return float(self.coef @ features)

    def largest_chunk(self, used: np.ndarray, start: int, budget_s: float, limit: int) -> int:
        """Most tokens (<= limit) one request, with `start` tokens of context, can add to a step whose
        terms so far are `used` (overhead included, see `empty_step`) without the predicted step time
        exceeding `budget_s`. The chunk's cost is quadratic in its size (attention pairs), so the bound
        is the positive root of that quadratic."""
        left = budget_s - self.predict_features(used)
        if left <= 0 or limit <= 0:
            return 0
        a, s, k = self.coef[_TOKEN], self.coef[_SEQ], self.coef[_PAIR]
        lin = a + k * (start + 0.5)  # cost(n) = s + lin*n + k/2*n^2
        room = left - s
        if k > 0:
            n = int((-lin + math.sqrt(lin * lin + 2 * k * max(room, 0.0))) / k)
        elif lin > 0:
            n = int(max(room, 0.0) / lin)
        else:
            n = limit
        n = min(n, limit)
        while n > 0 and self.predict_features(chunk_features(n, start)) > left:  # rounding / n == 1 terms
            n -= 1
        return n

    def prefill_seconds(self, num_prompt_tokens: int, num_cached_tokens: int = 0,
                        max_chunk_tokens: int | None = None) -> float:
        """Predicted time to prefill a prompt alone, its first `num_cached_tokens` served from cache (they
        cost no compute but are attended to), in steps of at most `max_chunk_tokens` (default: one step)."""
        start = max(0, min(num_cached_tokens, num_prompt_tokens - 1))  # the last token always runs
        chunk = max_chunk_tokens or num_prompt_tokens
        total = 0.0
        while start < num_prompt_tokens:
            n = min(chunk, num_prompt_tokens - start)
            total += self.predict_features(empty_step() + chunk_features(n, start))
            start += n
        return total

    # ------------------------------------------------------------------ fit

    def calibrate(self, samples: Iterable[tuple[StepWork, float]]) -> None:
        """Fit from start-up profile samples; the result becomes the prior later fits lean on."""
        rates = []
        for work, seconds in samples:
            self._add(work.features(), seconds)
            if len(work.chunks) == 1 and work.chunks[0][1] == 0 and work.num_tokens >= PROFILE_PREFILL_TOKENS:
                rates.append(seconds / work.num_tokens)  # a fresh prefill chunk alone
        if rates:
            self.profiled_seconds_per_token = statistics.median(rates)
        if self._count:
            self._fit()
            self.prior = self.coef.copy()

    def bounded_prefill_seconds(self, num_tokens: int) -> float:
        """The predicted time of one fresh `num_tokens` chunk, at most EXTRAPOLATION_CAP times the median
        per-token rate the profile measured on fresh prefill chunks: the profile stops early on a busy
        machine, and a few stretched samples can then give the attention term a slope that makes a chunk
        far beyond the profiled sizes look minutes long (attention over 2048 fresh tokens costs well under
        twice the linear layers for any model this serves, so on a quiet machine the cap does not bind)."""
        predicted = self.predict(StepWork(((num_tokens, 0),)))
        if self.profiled_seconds_per_token > 0:
            predicted = min(predicted, EXTRAPOLATION_CAP * self.profiled_seconds_per_token * num_tokens)
        return predicted

    def observe(self, work: StepWork, seconds: float) -> None:
        """Record a measured step: track the prediction error, add it to the window, refit now and then.
        Plain Python floats up to the window: it runs between every two model steps."""
        terms = step_terms(work.chunks)
        if not terms[_SEQ] or seconds <= 0:
            return
        predicted = sum(c * t for c, t in zip(self._coef_list, terms, strict=True))
        self.last_predicted, self.last_actual = predicted, seconds
        self.last_error = (predicted - seconds) / seconds
        alpha = 0.05 if self.num_observations else 1.0
        self.ema_abs_error += alpha * (abs(self.last_error) - self.ema_abs_error)
        self.ema_step_seconds += alpha * (seconds - self.ema_step_seconds)
        self._abs_errors.append(abs(self.last_error))
        self.num_observations += 1
        self._add(terms, seconds)
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self._fit()

    def _add(self, features: np.ndarray | Sequence[float], seconds: float) -> None:
        self._xs[self._next] = features
        self._ys[self._next] = seconds
        self._next = (self._next + 1) % len(self._ys)
        self._count = min(self._count + 1, len(self._ys))

    def _fit(self) -> None:
        self._since_fit = 0
        x, y = self._xs[:self._count], self._ys[:self._count]
        coef = self._solve(x, y)
        # A step that some other process stalled (a shared CPU, a page fault storm) can take many times
        # its work's worth; with few samples (the profile) one such step skews every term, so refit once
        # without the steps measured at >= OUTLIER times the first fit's prediction, if most remain.
        keep = y < OUTLIER * (x @ coef)
        if not keep.all() and keep.sum() >= max(len(TERMS), 0.75 * len(y)):
            coef = self._solve(x[keep], y[keep])
        self.coef = coef

    def _solve(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        # relative error: divide each row by its measured time, so the target is 1 (and a stalled step's
        # residual is at most 1, however long it took)
        rows = x / np.maximum(y, 1e-6)[:, None]
        # weak pull towards the prior, in units of relative change of each coefficient: one extra row per
        # term, (w / ref) at its column with target w * prior / ref, added here to the normal equations
        ref = np.where(self.prior > 0, self.prior, DEFAULT_COEFFICIENTS)
        w = math.sqrt(self.prior_weight)
        ridge = w / ref
        gram = rows.T @ rows + np.diag(ridge * ridge)
        rhs = rows.sum(axis=0) + ridge * (w * self.prior / ref)
        scale = np.sqrt(np.diag(gram))  # unit columns: the terms differ by ~10 orders of magnitude
        scale[scale == 0] = 1.0
        return nnls_normal(gram / np.outer(scale, scale), rhs / scale, start=self.coef > 0) / scale

    # ------------------------------------------------------------------ metrics

    def stats(self, budget_s: float) -> dict[str, float]:
        """Coefficients and prediction quality for `LLMEngine.stats()` (and so /metrics)."""
        errors = sorted(self._abs_errors)
        return {
            "cost_model_observations": self.num_observations,
            "step_time_predicted_seconds": self.last_predicted,
            "step_time_seconds": self.last_actual,
            "step_time_prediction_error": self.last_error,
            "step_time_prediction_abs_error_ema": self.ema_abs_error,
            "step_time_prediction_abs_error_median": errors[len(errors) // 2] if errors else 0.0,
            "step_time_budget_seconds": budget_s,
            "step_time_budget_utilization": self.ema_step_seconds / budget_s if budget_s > 0 else 0.0,
            **{f"cost_coef_{t}": c for t, c in self.coefficients.items()},
        }

