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


def step_features(chunks: Sequence[tuple[int, int]]) -> np.ndarray:
    """The terms of a whole step: the overhead (once, if anything runs) plus each chunk's terms.
    Vectorized: it runs for every step, with up to max_num_seqs chunks."""
    f = np.zeros(len(TERMS))
    if not chunks:
        return f
    c, p = np.asarray(chunks, dtype=float).T
    decode = c == 1
    f[_OVERHEAD] = 1.0
    f[_TOKEN] = c.sum()
    f[_SEQ] = len(c)
    f[_PAIR] = (c * p + c * (c + 1) / 2)[~decode].sum()
    f[_CTX] = (p[decode] + 1).sum()
    return f


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
    """min ||a x - b|| subject to x >= 0 (Lawson-Hanson active set); small dense problems only."""
    n = a.shape[1]
    passive = np.zeros(n, dtype=bool)
    x = np.zeros(n)
    grad = a.T @ (b - a @ x)
    for _ in range(3 * n):
        if passive.all() or grad[~passive].max() <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, grad))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                break
            # step from x towards z until the first passive variable hits zero, then drop it
            shrink = passive & (z <= tol)
            alpha = np.min(x[shrink] / np.maximum(x[shrink] - z[shrink], 1e-300))
            x = x + alpha * (z - x)
            passive &= x > tol
            if not passive.any():
                z = np.zeros(n)
                break
        x = z
        grad = a.T @ (b - a @ x)
    return x


class CostModel:
    """Step-time predictor: `predict(work) -> seconds`, `observe(work, seconds)`."""

    def __init__(self, coefficients: Iterable[float] | None = None, window: int = 256, refit_every: int = 8,
                 prior_weight: float = 1e-6) -> None:
        self.prior = np.array(tuple(coefficients) if coefficients is not None else DEFAULT_COEFFICIENTS,
                              dtype=float)
        if self.prior.shape != (len(TERMS),) or (self.prior < 0).any():
            raise ValueError(f"need {len(TERMS)} nonnegative coefficients ({', '.join(TERMS)})")
        self.coef = self.prior.copy()
        self.refit_every = refit_every
        self.prior_weight = prior_weight
        self._x: deque[np.ndarray] = deque(maxlen=window)
        self._y: deque[float] = deque(maxlen=window)
        self._since_fit = 0
        # prediction quality of observed steps, each predicted before it joined the fit
        self.num_observations = 0
        self.last_predicted = self.last_actual = self.last_error = 0.0
        self.ema_abs_error = self.ema_step_seconds = 0.0
        self._abs_errors: deque[float] = deque(maxlen=window)
        self.profiled_seconds_per_token = 0.0  # the start-up profile's median rate on fresh prefill chunks

    @property
    def coefficients(self) -> dict[str, float]:
        return {t: float(c) for t, c in zip(TERMS, self.coef, strict=True)}

    @property
    def num_samples(self) -> int:
        """Measured steps in the fit window (profile steps until observed ones push them out)."""
        return len(self._y)

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
        if self._y:
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
        """Record a measured step: track the prediction error, add it to the window, refit now and then."""
        features = work.features()
        if not features[_SEQ] or seconds <= 0:
            return
        predicted = self.predict_features(features)
        self.last_predicted, self.last_actual = predicted, seconds
        self.last_error = (predicted - seconds) / seconds
        alpha = 0.05 if self.num_observations else 1.0
        self.ema_abs_error += alpha * (abs(self.last_error) - self.ema_abs_error)
        self.ema_step_seconds += alpha * (seconds - self.ema_step_seconds)
        self._abs_errors.append(abs(self.last_error))
        self.num_observations += 1
        self._add(features, seconds)
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self._fit()

    def _add(self, features: np.ndarray, seconds: float) -> None:
        self._x.append(features)
        self._y.append(seconds)

    def _fit(self) -> None:
        self._since_fit = 0
        x, y = np.array(self._x), np.array(self._y)
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
        # weak pull towards the prior, in units of relative change of each coefficient
        ref = np.where(self.prior > 0, self.prior, DEFAULT_COEFFICIENTS)
        w = math.sqrt(self.prior_weight)
        a = np.vstack([rows, np.diag(w / ref)])
        b = np.concatenate([np.ones(len(y)), w * self.prior / ref])
        scale = np.linalg.norm(a, axis=0)  # unit columns: the terms differ by ~10 orders of magnitude
        scale[scale == 0] = 1.0
        return nnls(a / scale, b) / scale

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

