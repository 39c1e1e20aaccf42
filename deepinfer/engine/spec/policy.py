"""Draft length: how many of a proposal's tokens each request verifies this step.

Per request, running (EWMA) estimates a_j of the probability that draft token j is kept given that
tokens 1..j-1 were, one per draft position (a single rate a for all positions would assume independent
tokens; measured on code edits, a draft whose first token is right is usually right for many tokens, so
a_1 is low and a_2.. high: one rate made k too short). With the proposer's own confidence c_j where it
has one, token j is kept with estimated probability sqrt(a_j * c_j) (a heuristic blend: both must be
high). With per-token probabilities p_1..p_k, the expected tokens a step emits for the request is
1 + sum_j prod_{i<=j} p_i (= (1 - a^(k+1)) / (1 - a) when every p_i = a).

Per step, from the cost model (`cost_model.py`): the price of verifying one more token of request r at
its context length, at the step's current size, is the predicted step time with it minus without it
(at least the per-token coefficient). Starting from k = 0 everywhere (one decode token each), the policy
adds draft tokens one at a time, best expected gain per second first, while the step's expected tokens
per second still rises: a token whose expected gain is p and price dt is added iff
(T + p) / (S + dt) > T / S, i.e. p / dt > T / S. On an idle accelerator (batch 1) a token costs little
next to the step's fixed overhead and k goes to the longest useful draft; when the batch is
compute-bound each token costs its full share and k falls, down to 0.

The price comes from `DecodePrice` when it can: a fit of measured decode-phase steps (every request in
them decoding or verifying) as seconds = a + c * requests + b * tokens, so b is what one more verified
token really costs. The engine's cost model is fitted on prefill chunks too, where a token costs its full
compute; at small batch a few more rows of a decode step cost far less (the weights are read once per
step), and on a busy 2-core machine the cost model's fit put all of a step's time on its tokens (0 fixed
overhead, measured), which made every draft look as dear as a whole decode. Until the measured steps vary
enough in tokens per request to separate b from c, the policy explores: it verifies whole proposals
(that variation is what the fit needs) for the first `EXPLORE_STEPS` decode steps, and the cost model
prices after that if the fit still cannot separate them.

`adaptive=False`: every request verifies its whole proposal (up to `num_speculative_tokens`).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from deepinfer.engine.cost_model import CostModel, chunk_features, empty_step, nnls


class DecodePrice:
    """seconds = a + c * requests + b * tokens over recent decode-phase steps (nonnegative least squares)."""

    MIN_SPREAD = 0.25  # std of (tokens - requests) / requests the window needs before b is trusted
    EXPLORE_STEPS = 64
    # after that, every this many steps verify whole proposals anyway: once the policy settles on k = 0
    # the window would lose the spread the fit needs and its price would never be revised
    EXPLORE_EVERY = 16

    def __init__(self, window: int = 128, refit_every: int = 8) -> None:
        self._rows: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._since = 0
        self.refit_every = refit_every
        self.coef: np.ndarray | None = None  # (a, c, b) once the window separates them
        self.num_observed = 0

    @property
    def exploring(self) -> bool:
        return self.coef is None and self.num_observed < self.EXPLORE_STEPS

    def observe(self, num_requests: int, num_tokens: int, seconds: float) -> None:
        if num_requests <= 0 or seconds <= 0:
            return
        self._rows.append((float(num_requests), float(num_tokens), seconds))
        self.num_observed += 1
        self._since += 1
        if self._since >= self.refit_every:
            self._fit()

    def _fit(self) -> None:
        self._since = 0
        rows = np.array(self._rows)
        req, tok, sec = rows.T
        if len(rows) < 16 or np.std((tok - req) / req) < self.MIN_SPREAD:
            return
        x = np.stack([np.ones_like(req), req, tok], axis=1) / sec[:, None]  # relative error, as the cost model
        scale = np.linalg.norm(x, axis=0)
        scale[scale == 0] = 1.0
        coef = nnls(x / scale, np.ones(len(sec))) / scale
        self.coef = coef if coef[2] > 0 else None

    def step(self, num_requests: int, num_tokens: int) -> tuple[float, float] | None:
        """(predicted seconds of a step, seconds per extra token), or None before a usable fit."""
        if self.coef is None:
            return None
        a, c, b = self.coef
        return float(a + c * num_requests + b * num_tokens), float(b)


@dataclass
class AcceptanceStats:
    """One request's running acceptance estimates (per draft position) and totals."""

    rates: list[float]  # rates[j]: EWMA of P(draft j+1 kept | drafts 1..j kept)
    num_steps: int = 0  # verification steps with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @classmethod
    def new(cls, prior: float, k_max: int) -> AcceptanceStats:
        return cls([prior] * k_max)

    def observe(self, drafted: int, accepted: int, alpha: float) -> None:
        if drafted <= 0:
            return
        self.num_steps += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        # positions 1..accepted were kept; position accepted + 1 (if drafted) was tried and rejected;
        # later positions were never tried and tell nothing
        for j in range(min(drafted, accepted + 1, len(self.rates))):
            self.rates[j] += alpha * ((1.0 if j < accepted else 0.0) - self.rates[j])

    def relax(self, prior: float, weight: float) -> None:
        """A step without drafts: drift back towards the prior, so a request that was unlucky early is
        tried again later instead of never."""
        for j in range(len(self.rates)):
            self.rates[j] += weight * (prior - self.rates[j])


@dataclass
class Candidate:
    """A decoding request that may verify drafts this step."""

    context: int  # tokens in its KV cache before this step (the decode's position)
    accept_probs: list[float]  # estimated keep probability of each proposed token, in order


class DraftLengthPolicy:
    def __init__(self, cost_model: CostModel, adaptive: bool = True) -> None:
        self.cost_model = cost_model
        self.adaptive = adaptive
        self.measured = DecodePrice()
        self._steps = 0

    @staticmethod
    def accept_probs(rates: list[float], confidence: tuple[float, ...] | None, n: int) -> list[float]:
        rates = rates[:n]
        if confidence is None:
            return list(rates)
        return [math.sqrt(max(0.0, r * c)) for r, c in zip(rates, confidence, strict=False)]

    def choose(self, cands: list[Candidate], base: list[tuple[int, int]]) -> list[int]:
        """Draft tokens to verify per candidate. `base`: (new tokens, context) of the work already in the
        step (every decode, candidates included with one token each)."""
        self._steps += 1
        if not self.adaptive or self.measured.exploring or self._steps % DecodePrice.EXPLORE_EVERY == 0:
            return [len(c.accept_probs) for c in cands]
        coef = self.cost_model.coef
        tokens = float(len(base))
        measured = self.measured.step(len(base), sum(n for n, _ in base))
        if measured is not None:
            seconds, per_token = measured
            seconds = max(seconds, 1e-9)

            def price(c: Candidate, k: int) -> float:
                return max(per_token, 1e-9)
        else:
            step = empty_step()
            for n, p in base:
                step += chunk_features(n, p)
            seconds = max(float(coef @ step), 1e-9)
            floor = max(float(coef[1]), 1e-9)  # one token through the linear layers

            def price(c: Candidate, k: int) -> float:  # verifying draft k+1 (the chunk grows from k+1 to k+2)
                diff = coef @ (chunk_features(k + 2, c.context) - chunk_features(k + 1, c.context))
                return max(float(diff), floor)

        ks = [0] * len(cands)
        gains = [1.0] * len(cands)  # probability that all drafts chosen so far are kept
        heap: list[tuple[float, int]] = []

        def push(i: int) -> None:
            c, k = cands[i], ks[i]
            if k < len(c.accept_probs):
                gain = gains[i] * c.accept_probs[k]
                heapq.heappush(heap, (-gain / price(c, k), i))

        for i in range(len(cands)):
            push(i)
        while heap:
            _, i = heapq.heappop(heap)
            c, k = cands[i], ks[i]
            gain, dt = gains[i] * c.accept_probs[k], price(c, k)
            if gain * seconds <= tokens * dt:  # best remaining token lowers tokens per second: stop
                break
            tokens += gain
            seconds += dt
            gains[i] = gain
            ks[i] = k + 1
            push(i)
        return ks


def expected_tokens(probs: list[float] | np.ndarray) -> float:
    """Expected tokens one verification emits: 1 + sum_j prod_{i<=j} p_i."""
    return 1.0 + float(np.cumprod(np.asarray(probs, dtype=float)).sum()) if len(probs) else 1.0
