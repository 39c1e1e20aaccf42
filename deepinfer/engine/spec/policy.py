"""Draft length: how many of a proposal's tokens each request verifies this step.

Per request, running estimates a_j (a running mean, then an EWMA: `AcceptanceStats.observe`) of the
probability that draft token j is kept given that tokens 1..j-1 were, one per draft position (a single rate a for all positions would assume independent
tokens; measured on code edits, a draft whose first token is right is usually right for many tokens, so
a_1 is low and a_2.. high: one rate made k too short). With the proposer's own confidence c_j where it
has one, token j is kept with estimated probability sqrt(a_j * c_j) (a heuristic blend: both must be
high). With per-token probabilities p_1..p_k, the expected tokens a step emits for the request is
1 + sum_j prod_{i<=j} p_i (= (1 - a^(k+1)) / (1 - a) when every p_i = a).

Per step, from the measured price of verification (`step_price.StepPrice`: T(R), the seconds of a
decode-phase step of R rows, plus the step's host time H): each decode is one row and emits one token for
sure; a draft token adds a row and, in expectation, the probability that it and every draft before it are
kept. For a given number m of draft rows the best choice is the m draft tokens of highest gain (a
request's gains fall with position, so that is a prefix of every request's draft), found by merging the
requests' gain sequences; the policy takes the m that maximises the step's expected tokens per second,

    (B + sum of the m best gains) / (T(B + m) + H)        B = decoding requests,

m = 0 included (no drafts at all when none pays). Scanning every m rather than stopping at the first
draft that does not pay matters where T jumps: on CPU a step of up to 8 rows takes the whole-layer C
decode path, so at batch 1 a 9th row costs a jump that a long, likely draft can still repay.

`adaptive=False`: every request verifies its whole proposal (up to `num_speculative_tokens`).

Around this price-driven choice, `tries.py` decides which requests are looked up at all (back-off after
repeated misses) and gives untried requests with a strong proposer signal a few tries the price would not.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from deepinfer.engine.cost_model import CostModel
from deepinfer.engine.spec.step_price import StepPrice


@dataclass
class AcceptanceStats:
    """One request's running acceptance estimates (per draft position), totals, and its try state
    (`tries.py`: consecutive misses, back-off)."""

    rates: list[float]  # rates[j]: EWMA of P(draft j+1 kept | drafts 1..j kept)
    tried: list[int]  # tried[j]: verifications that reached position j + 1 (so observed it)
    num_steps: int = 0  # verification steps with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    prior: float = 0.6  # what an idle estimate drifts back to (`relax`)
    relax_weight: float = 0.0  # per idle step
    idle_steps: int = 0  # steps without drafts not yet applied to `rates` (applied lazily: `settle`)
    misses: int = 0  # consecutive verifications that kept no draft
    backoff_until: int = 0  # the speculator's step count before which the request proposes nothing
    backoff_steps: int = 0  # the length of its last back-off (doubles while the misses go on)
    # gain_ceiling's cached bounds (plain, confident): valid until the next observation
    _ceilings: dict[bool, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def new(cls, prior: float, k_max: int, relax_weight: float = 0.0) -> AcceptanceStats:
        return cls([prior] * k_max, [0] * k_max, prior=prior, relax_weight=relax_weight)

    def settle(self) -> None:
        """Apply the idle steps' drift towards the prior: n steps of r += w (prior - r) in closed form (a
        step that drafts nothing then costs a request one integer increment, not a loop over positions)."""
        if self.idle_steps:
            f = (1.0 - self.relax_weight) ** self.idle_steps
            self.rates = [self.prior + (r - self.prior) * f for r in self.rates]
            self.idle_steps = 0

    def first_rate(self) -> float:
        """rates[0] with the idle drift applied (without settling the whole list)."""
        if not self.idle_steps:
            return self.rates[0]
        return self.prior + (self.rates[0] - self.prior) * (1.0 - self.relax_weight) ** self.idle_steps

    def estimates(self) -> list[float]:
        """The rates, with each never-observed position after the first taking the rate of the position
        before it: a draft kept this far tends to stay right (copying), and the prior alone would keep
        the policy from ever trying the positions past the ones it has chosen so far."""
        self.settle()
        out = list(self.rates)
        if self.tried and self.tried[0]:  # the untried positions are a suffix (reaching j means j - 1 kept)
            for j in range(1, len(out)):
                if not self.tried[j]:
                    out[j] = out[j - 1]
        return out

    def gain_ceiling(self, confident: bool = False) -> np.ndarray:
        """An upper bound, valid until the next `observe`, of the expected tokens each draft position adds
        (`DraftLengthPolicy.choose`'s gains: prefix products of the keep probabilities) for any proposal:
        per position max(estimate, prior), since idle steps only move an estimate towards the prior (with
        a proposer's confidence c <= 1, sqrt(r c) <= sqrt(r)). `DraftLengthPolicy.drafts_can_pay` reads
        it every step, so it is computed once per observation, not per step."""
        cached = self._ceilings.get(confident)
        if cached is None:
            ceiling = np.maximum(np.asarray(self.estimates(), dtype=float), self.prior)
            cached = self._ceilings[confident] = np.cumprod(np.sqrt(ceiling) if confident else ceiling)
        return cached

    def observe(self, drafted: int, accepted: int, alpha: float) -> None:
        if drafted <= 0:
            return
        self._ceilings.clear()
        self.settle()
        self.num_steps += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        # positions 1..accepted were kept; position accepted + 1 (if drafted) was tried and rejected;
        # later positions were never tried and tell nothing
        # a running mean (weight 1 / (tries + 3): the prior counts as two tries) until the weight falls to
        # alpha / 4, an EWMA after that. A fast EWMA (alpha itself) read the failures of code edits wrongly:
        # they come at the edited identifiers and a copy resumes right after them, so the step after a
        # failure is the one most likely to be kept, and a fast EWMA priced it the lowest
        for j in range(min(drafted, accepted + 1, len(self.rates))):
            w = max(1.0 / (self.tried[j] + 3), alpha / 4)
            self.rates[j] += w * ((1.0 if j < accepted else 0.0) - self.rates[j])
            self.tried[j] += 1

    def relax(self) -> None:
        """A step without drafts: drift back towards the prior (applied lazily, `settle`), so a request
        that was unlucky early is tried again later instead of never."""
        self.idle_steps += 1


@dataclass
class Candidate:
    """A decoding request that may verify drafts this step."""

    context: int  # tokens in its KV cache before this step (the decode's position)
    accept_probs: list[float]  # estimated keep probability of each proposed token, in order


class DraftLengthPolicy:
    def __init__(self, cost_model: CostModel, adaptive: bool = True) -> None:
        self.adaptive = adaptive
        self.price = StepPrice(cost_model)

    @staticmethod
    def accept_probs(rates: list[float], confidence: tuple[float, ...] | None, n: int) -> list[float]:
        rates = rates[:n]
        if confidence is None:
            return list(rates)
        return [math.sqrt(max(0.0, r * c)) for r, c in zip(rates, confidence, strict=False)]

    def any_draft_can_pay(self, first_probs: list[float], k_max: int) -> bool:
        """`drafts_can_pay` from a looser bound: each decoding request's first-draft keep probability (its
        k drafts gain at most k times it, a falling prefix product)."""
        return self.drafts_can_pay(len(first_probs), [np.full(k_max, p) for p in first_probs if p > 0])

    def drafts_can_pay(self, num_decodes: int, gain_bounds: list[np.ndarray]) -> bool:
        """Whether any drafts could raise the step's expected tokens per second, given per decoding request
        an upper bound of the gain of each draft position it may verify (non-increasing: e.g.
        `AcceptanceStats.gain_ceiling` cut to the request's draft limit): m draft rows then gain at most
        the sum of the m largest bounds, which is what `choose` maximises over. False: the speculator
        skips proposing this step (k = 0 costs nothing). With exact per-position bounds rather than
        k_max copies of the first one, a batch whose requests keep few drafts (chat, or any batch at the
        price's jump) is skipped instead of looked up every step."""
        if not self.adaptive:
            return True
        if not gain_bounds:
            return False
        b = num_decodes
        gains = np.sort(np.concatenate(gain_bounds))[::-1]
        t = self.price.table(b + len(gains))[b:] + self.price.host_seconds
        rate = (b + np.concatenate([[0.0], np.cumsum(gains)])) / np.maximum(t, 1e-9)
        return bool(np.max(rate[1:]) > rate[0])

    def choose(self, cands: list[Candidate], num_decodes: int) -> list[int]:
        """Draft tokens to verify per candidate; `num_decodes`: the step's decoding requests (one row each,
        the candidates included)."""
        if not self.adaptive:
            return [len(c.accept_probs) for c in cands]
        ks = [0] * len(cands)
        # merge the candidates' gain sequences, highest first (each is non-increasing: a prefix product)
        heap = [(-c.accept_probs[0], i, 0) for i, c in enumerate(cands) if c.accept_probs and c.accept_probs[0] > 0]
        if not heap:
            return ks
        heapq.heapify(heap)
        order: list[int] = []
        gains: list[float] = []
        while heap:
            g, i, j = heapq.heappop(heap)
            order.append(i)
            gains.append(-g)
            probs = cands[i].accept_probs
            if j + 1 < len(probs) and probs[j + 1] > 0:
                heapq.heappush(heap, (g * probs[j + 1], i, j + 1))
        expected = num_decodes + np.concatenate([[0.0], np.cumsum(gains)])
        seconds = self.price.table(num_decodes + len(gains))[num_decodes:] + self.price.host_seconds
        rate = expected / np.maximum(seconds, 1e-9)
        best = int(np.argmax(rate))  # the first maximum: the fewest drafts among equals
        for i in order[:best]:
            ks[i] += 1
        return ks


def expected_tokens(probs: list[float] | np.ndarray) -> float:
    """Expected tokens one verification emits: 1 + sum_j prod_{i<=j} p_i."""
    return 1.0 + float(np.cumprod(np.asarray(probs, dtype=float)).sum()) if len(probs) else 1.0
