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

    (B + sum of the m best gains / (1 + MARGIN)) / (T(B + m) + H_m)      B = decoding requests,

m = 0 included (no drafts at all when none pays); H_0 is the host time of steps without drafts, H_m (m > 0)
that of steps with (`StepPrice.draft_host_seconds`). The gains count at 1 / (1 + MARGIN) of their estimate, so
drafts are chosen only where they clear their break-even by MARGIN: near it the choice is the estimates'
error, not a gain (the 2-core AVX2 machine at batch 8, where a draft row costs ~0.75 of what a kept token
saves: chat requests that started from the pooled estimates of an earlier JSON workload drafted there at 0.50
acceptance, 0.90x of no speculation). Every proposal's gains are also weighed by how much of what the chosen
drafts were expected to keep verification kept (`KeepCalibration`, at most 1): the drafts chosen are those
whose estimates were high, and a request's estimates start from rates pooled over other requests, so the
estimates behind chosen drafts err upwards where a workload's keep rates differ from the pool's (JSON at batch
32 after code edits: 0.95-0.97x of no speculation, 1.08x with it). Scanning every m rather than stopping at
the first draft that does not pay matters where T jumps: on CPU a step of up to 8 rows takes the whole-layer C
decode path, so at batch 1 a 9th row costs a jump that a long, likely draft can still repay.

`adaptive=False`: every request verifies its whole proposal (up to `num_speculative_tokens`).

What a request knows before its first verification, and what its proposal's match says: the engine keeps
pooled estimates (`PooledAcceptance`), per draft position, over every request's verifications, overall and
per match length (how many trailing tokens an n-gram proposal's copied place matched). A new request's
estimates start from the pooled ones (a request of a workload the engine has been serving is not a
stranger: with the fixed prior 0.6, code edits at batch 1 spent their first steps at k = 1-2 where k = 3
paid); and a proposal's per-position probabilities are its request's estimates times its match length's
pooled rate over the overall pooled rate (code edits: a 5-token match kept its first draft 89% of the time, a
2- or 3-token match ~60%; one rate per request averaged them). Each pooled rate starts at the prior
(`initial_acceptance` for the first draft position, `initial_continuation` for the later ones: a copy that has
started tends to go on) and counts it as two verifications, as a request's do, so a match length seen rarely
stays near the prior.

In a closed batch (`LLM.generate`: nothing joins until all of it is done) the step's objective counts each
request's kept tokens at its weight, its projected time to finish over the batch's mean (`FinishBalance`):
the batch's wall time is its last request's finish, and tokens per second alike for every request let the
requests with the best proposals finish first and the rest decode in smaller, dearer steps.

Around this price-driven choice, `tries.py` decides which requests are looked up at all (back-off after
repeated misses) and gives untried requests with a strong proposer signal a few tries the price would not.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from deepinfer.engine.cost_model import CostModel
from deepinfer.engine.spec.step_price import StepPrice

if TYPE_CHECKING:
    from deepinfer.engine.request import Request


@dataclass
class HeldProposal:
    """A proposal a request did not draft, checked in hindsight against the tokens it decodes next."""

    tokens: tuple[int, ...]
    start: int  # the request's token count when proposed: where the tokens would have gone
    match: int  # the n-gram match length behind it
    learnt: int = 0  # leading positions the decoded tokens have settled so far


@dataclass
class AcceptanceStats:
    """One request's running acceptance estimates (per draft position), totals, and its try state
    (`tries.py`: consecutive misses, back-off)."""

    rates: list[float]  # rates[j]: EWMA of P(draft j+1 kept | drafts 1..j kept)
    tried: list[int]  # tried[j]: verifications that reached position j + 1 (so observed it)
    num_steps: int = 0  # verification steps with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # per position, what an idle estimate drifts back to (`relax`): the estimates it started from
    prior: list[float] = field(default_factory=list)
    relax_weight: float = 0.0  # per idle step
    idle_steps: int = 0  # steps without drafts not yet applied to `rates` (applied lazily: `settle`)
    idle_unmatched: int = 0  # those of them whose lookup found no proposal (`relax`)
    misses: int = 0  # consecutive verifications that kept no draft
    backoff_until: int = 0  # the speculator's step count before which the request proposes nothing
    backoff_steps: int = 0  # the length of its last back-off (doubles while the misses go on)
    last_match: int = 0  # the match length of the proposal it last verified (`PooledAcceptance.observe`)
    # per n-gram match length: [first drafts kept, verifications] behind it (`first_keep_rate`)
    first_by_match: dict[int, list[int]] = field(default_factory=dict)
    # exploration's refund (`tries.ExploreLedger`) for its drafts in flight: seconds per kept token past the
    # first `explored_from` (the ones the price chose); 0: the drafts were not explored
    explore_refund: float = 0.0
    # the expected kept tokens its keep probabilities gave the drafts in flight, before the calibration
    # (`KeepCalibration`; 0: none recorded, e.g. drafts chosen inside a C call)
    predicted_kept: float = 0.0
    explored_from: int = 0
    # a proposal it did not draft, held to check against the tokens it decodes next (`Speculator`'s hindsight)
    hindsight: HeldProposal | None = None
    # whether a speculating C call has explored for it (`Speculator.call_scheduled`: once in its life)
    call_explored: bool = False

    @classmethod
    def new(cls, prior: float, k_max: int, relax_weight: float = 0.0,
            rates: list[float] | None = None) -> AcceptanceStats:
        """`rates`: the starting estimates (default: `prior` at every position; the speculator passes
        `PooledAcceptance.rates`), each counted as two verifications' worth, and what idle steps drift back to."""
        start = list(rates[:k_max]) if rates is not None else [prior] * k_max
        return cls(start, [0] * k_max, prior=list(start), relax_weight=relax_weight)

    def settle(self) -> None:
        """Apply the idle steps' drift towards the prior (`relax`): per position, n steps of r += w (p - r) in
        closed form, n the idle steps for an estimate below its prior p, the unmatched ones for an estimate
        above it (a step that drafts nothing then costs a request an integer increment, not a loop over
        positions; neither kind of step moves an estimate across its prior, so their order does not
        matter)."""
        if self.idle_steps:
            up = (1.0 - self.relax_weight) ** self.idle_steps
            down = (1.0 - self.relax_weight) ** self.idle_unmatched
            self.rates = [p + (r - p) * (up if r < p else down) for r, p in zip(self.rates, self.prior, strict=True)]
            self.idle_steps = self.idle_unmatched = 0

    def first_rate(self) -> float:
        """rates[0] with the idle drift applied (without settling the whole list)."""
        r, p = self.rates[0], self.prior[0]
        if not self.idle_steps:
            return r
        n = self.idle_steps if r < p else self.idle_unmatched
        return p + (r - p) * (1.0 - self.relax_weight) ** n

    def estimates(self) -> list[float]:
        """The rates, with each never-observed position after the first taking the rate of the position
        before it: a draft kept this far tends to stay right (copying), and the prior alone would keep
        the policy from ever trying the positions past the ones it has chosen so far."""
        self.settle()
        out = list(self.rates)
        if self.tried and self.tried[0]:
            carry_forward_untried(out, self.tried)
        return out

    def gain_ceiling(self, confident: bool = False, boost: np.ndarray | None = None) -> np.ndarray:
        """An upper bound, valid until the next `observe`, of the expected tokens each draft position adds
        (`DraftLengthPolicy.choose`'s gains: prefix products of the keep probabilities) for any proposal:
        per position max(estimate, the largest prior up to it), since idle steps only move an estimate towards
        its prior and an untried position's estimate is an earlier one's (with
        a proposer's confidence c <= 1, sqrt(r c) <= sqrt(r)), times `boost` (per position, >= 1: the
        largest match-length factor a proposal may carry, `PooledAcceptance.boost`), capped as
        `PooledAcceptance.match_probs` caps. `ceiling_gains` computes it for a batch."""
        return ceiling_gains(np.asarray([self.estimates()], dtype=float), [self.prior], [len(self.rates)],
                             confident, boost)

    def observe(self, drafted: int, accepted: int, alpha: float) -> None:
        """A verification of `drafted` tokens behind the request's `last_match`, `accepted` of them kept."""
        if drafted <= 0:
            return
        self.num_steps += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.learn(self.last_match, drafted, accepted, alpha)

    def learn(self, match: int, drafted: int, accepted: int, alpha: float, start: int = 0) -> None:
        """The estimates' news from a draft of `drafted` tokens behind a `match`-token match of which the
        first `accepted` were (or, checked in hindsight, would have been) kept, past the first `start`
        positions (learnt before); no totals counted."""
        if drafted <= start:
            return
        self.settle()
        if match > 0 and start == 0:
            record = self.first_by_match.setdefault(match, [0, 0])
            record[0] += accepted > 0
            record[1] += 1
        # positions 1..accepted were kept; position accepted + 1 (if drafted) was tried and rejected;
        # later positions were never tried and tell nothing
        # a fast EWMA (alpha itself) read the failures of code edits wrongly: they come at the edited
        # identifiers and a copy resumes right after them, so the step after a failure is the one most
        # likely to be kept, and a fast EWMA priced it the lowest
        update_rates(self.rates, self.tried, drafted, accepted, alpha / 4, start)

    def first_keep_rate(self, match: int, estimate: float, weight: float = 2.0) -> float:
        """The probability that a first draft behind a match of `match` tokens is kept: this request's own
        record behind that match length, shrunk towards `estimate` (counted as `weight` verifications). The
        per-position estimates mix every match length: behind two-token matches JSON requests kept ~10% of
        first drafts where code edits kept ~60%, and a request started from the code edits' pooled rates
        went on drafting behind them."""
        record = self.first_by_match.get(match)
        if not record:
            return estimate
        return (record[0] + weight * estimate) / (record[1] + weight)

    def relax(self, unmatched: bool = False) -> None:
        """A step without drafts: estimates below the prior (per position, the estimates the request started
        from: the pooled rates when it arrived) drift back up towards it (applied lazily, `settle`), so a
        request that was unlucky early is tried again later instead of never. Estimates above it drift down
        only in steps whose lookup found no proposal for the request (`unmatched`): a request whose text
        rarely repeats is one whose few matches are coincidences (chat), while a step priced out, or quiet,
        is no evidence against its estimates. Drifting them down in every idle step
        made batches past the C path's rows spiral into never drafting: code edits at batch 8 whose
        estimates were 0.84-0.86 (from batch 1) were priced out at the first steps (the 9th row's jump needs
        most of the batch to draft), fell to 0.63 over six quiet calls, and never drafted again in the run,
        where a fixed k = 5 gained 1.15x (0.82-0.96 kept per position). The prior was a fixed 0.6 before; the
        pooled rates are what the engine knows of requests like this one."""
        self.idle_steps += 1
        self.idle_unmatched += unmatched


# the highest keep probability a match-length factor may raise an estimate to (gains must keep falling)
MAX_KEEP_PROB = 0.99


def carry_forward_untried(values: list[float] | np.ndarray, tried: list[int]) -> None:
    """Give each never-observed position after the first the value of the position before it, in place.
    The untried positions are a suffix: reaching position j means position j - 1 was kept."""
    for j in range(1, len(values)):
        if not tried[j]:
            values[j] = values[j - 1]


# A batch's rows at once. `Speculator.propose` runs between model steps for every decoding request: at batch
# 32 its per-request Python (each request's estimates, bounds and keep probabilities built as lists, the
# candidates' gains merged through a heap) took ~1.2 ms a step on the AVX-512 machine, against a ~17 ms
# step (code_edit). The functions below compute the same values with a few array operations per batch.

# below this many requests `estimate_rows` goes request by request: each array operation costs ~10-20 us with
# the caches cold between model steps (batch 1: ~0.2 ms a step in arrays against ~0.02 in plain Python)
ROW_BY_ROW = 8


def estimate_rows(states: list[AcceptanceStats]) -> np.ndarray:
    """`AcceptanceStats.estimates` of each state, as the rows of one array (the states are settled, as
    `estimates` settles them; every state has the same number of positions)."""
    if len(states) <= ROW_BY_ROW:
        return np.array([s.estimates() for s in states], dtype=float)
    rates = np.array([s.rates for s in states], dtype=float)
    idle = np.array([s.idle_steps for s in states])
    settling = np.nonzero(idle)[0]
    if len(settling):
        prior = np.array([states[i].prior for i in settling], dtype=float)
        up = np.array([(1.0 - states[i].relax_weight) ** states[i].idle_steps for i in settling])[:, None]
        down = np.array([(1.0 - states[i].relax_weight) ** states[i].idle_unmatched for i in settling])[:, None]
        rows = rates[settling]
        rates[settling] = prior + (rows - prior) * np.where(rows < prior, up, down)
        for i in settling.tolist():
            states[i].rates = rates[i].tolist()
            states[i].idle_steps = states[i].idle_unmatched = 0
    tried = np.array([s.tried for s in states]) > 0
    # `carry_forward_untried`: each untried position after the first takes the last tried one's value, in
    # the requests that have tried their first position at all
    positions = np.arange(rates.shape[1])
    source = np.maximum.accumulate(np.where(tried, positions, 0), axis=1)
    source[~tried[:, 0]] = positions
    return rates[np.arange(len(states))[:, None], source]


def ceiling_gains(estimates: np.ndarray, priors: list[list[float]], limits: list[int], confident: bool = False,
                  boost: np.ndarray | None = None) -> np.ndarray:
    """Every request's `AcceptanceStats.gain_ceiling(confident, boost)`, from its estimates (the rows of
    `estimates`, `estimate_rows`) and prior, cut to its limit, concatenated: the bound
    `DraftLengthPolicy.drafts_can_pay` reads. Up to ROW_BY_ROW requests in plain Python (the same
    operations in the same order: the same values)."""
    if len(estimates) <= ROW_BY_ROW:
        cap = math.sqrt(MAX_KEEP_PROB) if confident else MAX_KEEP_PROB
        factors = boost.tolist() if boost is not None else None
        out = []
        for row, prior, lim in zip(estimates.tolist(), priors, limits, strict=True):
            gain, floor = 1.0, 0.0
            for j in range(lim):
                floor = max(floor, prior[j])
                r = max(row[j], floor)
                r = math.sqrt(r) if confident else r
                if factors is not None:
                    r = min(r * factors[j], max(r, cap))
                gain *= r
                out.append(gain)
        return np.array(out)
    rates = np.maximum(estimates, np.maximum.accumulate(np.asarray(priors, dtype=float), axis=1))
    if confident:
        rates = np.sqrt(rates)
    if boost is not None:
        cap = np.maximum(rates, math.sqrt(MAX_KEEP_PROB) if confident else MAX_KEEP_PROB)
        rates = np.minimum(rates * boost[:rates.shape[1]], cap)
    cut = np.arange(rates.shape[1]) < np.asarray(limits)[:, None]
    return np.cumprod(rates, axis=1)[cut]


def update_rates(rates: list[float], tried: list[int], drafted: int, accepted: int, floor: float,
                 start: int = 0) -> None:
    """One verification's news for per-position keep rates: positions 1..accepted were kept, position
    accepted + 1 (if drafted) was tried and rejected, later ones were never tried and tell nothing; only
    positions after the first `start` (learnt already: a proposal checked in hindsight a token at a time). A
    running mean (weight 1 / (tries + 3): the starting value counts as two tries) until the weight falls
    to `floor`, an EWMA after that."""
    for j in range(start, min(drafted, accepted + 1, len(rates))):
        w = max(1.0 / (tried[j] + 3), floor)
        rates[j] += w * ((1.0 if j < accepted else 0.0) - rates[j])
        tried[j] += 1


class KeepCalibration:
    """Kept draft tokens over the tokens the policy expected to keep, over the drafts it chose (an EWMA of
    both sums: about the last 30 verifications), and the factor (<= 1) the speculator puts on every
    proposal's gains by it: the estimates that choose drafts are their own evidence's best guess, but the
    drafts chosen are those whose estimates were high at that moment, and a request's estimates start from
    rates pooled over other requests. Where both err upwards, drafts near their break-even are chosen at a
    loss: on the 2-core Zen 4, chat after code edits expected 48-58 kept tokens at batch 8 and kept 13-44;
    code edits expected what they kept (within 5%) after their first run. The factor never rises above 1:
    estimates that err downwards (a new engine's prior on code edits) are corrected by the observations
    themselves, and the speculator's bound (`drafts_can_pay`) stays an upper bound."""

    DECAY = 0.97
    PRIOR = 4.0  # expected kept tokens' worth of trust in the estimates (a new engine's factor is 1)

    def __init__(self) -> None:
        self.kept = 0.0
        self.expected = 0.0

    def observe(self, expected: float, kept: int) -> None:
        self.kept = self.DECAY * self.kept + kept
        self.expected = self.DECAY * self.expected + expected

    @property
    def factor(self) -> float:
        return min(1.0, (self.kept + self.PRIOR) / (self.expected + self.PRIOR))


class FinishBalance:
    """What a kept token of each decoding request is worth in a closed batch: one that nothing will join
    until all of it is done (`LLM.generate` once its prompts are all admitted), whose wall time is its
    last request's finish, not its tokens per second.

    The policy maximises a step's expected tokens per second, each kept token alike: right while requests
    wait for a slot, which any freed row serves. A closed batch has nobody to hand the rows to, and at
    equal gains the policy drafts for the requests whose proposals keep best: they finish early and leave
    the others decoding in smaller, dearer steps (code edits at batch 8 on the 2-core Zen 4: two requests
    done at ~0.5 s, the last at ~1.2 s, against 0.7 and 1.1 s at a fixed k = 5; per token level with it,
    0.92-0.96 of its throughput). Here a request's tokens are worth its projected time to finish over the
    batch's mean: its tokens left (max_tokens less its output) over its output tokens per second since
    the batch began for it (at least `MIN_TOKENS` of them; before that, the others' mean rate). The
    weights mean 1 over the step's decodes, so the step's sum is what the policy's objective counts.

    A request that ends at a stop token finishes before its max_tokens, and projecting by max_tokens
    would then steer rows by lengths nobody knows (JSON answers at batch 32, weighed by max_tokens alone:
    0.93-0.99 of the unweighted engine's throughput over five starts). So the weights lean from 1 towards
    the projection by the share of the batch's finished requests that ran to their max_tokens,
    (length + 1) / (finished + 1): full before any has finished, near 1 once most stop early."""

    MIN_TOKENS = 4  # output tokens since the batch began before a request's own rate is read

    def __init__(self) -> None:
        self.closed = False
        self.by_length = 0  # requests of the batch that ran to their max_tokens
        self.finished = 0  # requests of the batch that finished (at a stop or at max_tokens)
        self._start: dict[str, tuple[float, int]] = {}  # request id -> (clock, output tokens) when first seen

    def begin(self) -> None:
        """A closed batch begins: nothing learnt from an earlier one carries over."""
        self.closed = True
        self.by_length = self.finished = 0
        self._start.clear()

    def end(self) -> None:
        self.closed = False
        self._start.clear()

    def on_finished(self, request_id: str, ran_to_length: bool) -> None:
        if self.closed:
            self.finished += 1
            self.by_length += ran_to_length
            self._start.pop(request_id, None)

    def weights(self, requests: list[Request], now: float) -> list[float] | None:
        """Per request (`Request`s decoding this step), its weight; None where all weigh 1: not a closed
        batch, fewer than two requests, or one without a max_tokens (its finish is anyone's guess)."""
        if not self.closed or len(requests) < 2 or any(r.max_tokens is None for r in requests):
            return None
        rates: list[float | None] = []
        for r in requests:
            start = self._start.setdefault(r.request_id, (now, r.num_output_tokens))
            made = r.num_output_tokens - start[1]
            rates.append(made / (now - start[0]) if made >= self.MIN_TOKENS and now > start[0] else None)
        known = [x for x in rates if x is not None]  # each > 0: MIN_TOKENS made over a positive time
        if not known:
            return None
        mean_rate = sum(known) / len(known)
        times = [max(0, r.max_tokens - r.num_output_tokens) / (mean_rate if x is None else x)
                 for r, x in zip(requests, rates, strict=True)]
        mean_time = sum(times) / len(times)
        if mean_time <= 0:
            return None
        trust = (self.by_length + 1) / (self.finished + 1)
        return [1.0 + trust * (t / mean_time - 1.0) for t in times]


class PooledAcceptance:
    """Per-position keep rates pooled over all of an engine's requests (one proposer), overall and per
    proposal match length (`Draft.match`; 0: the proposer reports none): the starting estimates of a new
    request (`rates`) and the factor a proposal's match length puts on its request's estimates
    (`factors`). See the module docstring."""

    # EWMA weight once the running mean has settled: about the last 50 verifications per position, so the
    # pool follows a change of workload within a few requests
    FLOOR = 0.02

    def __init__(self, prior: float, k_max: int, continuation: float | None = None) -> None:
        """Every rate starts at `prior` for the first draft position and `continuation` (default: `prior`) for
        the later ones, each worth two verifications (`update_rates`)."""
        self.prior, self.k_max = prior, k_max
        self._start = [prior] + [prior if continuation is None else continuation] * (k_max - 1)
        self._all = (list(self._start), [0] * k_max)
        self._by_match: dict[int, tuple[list[float], list[int]]] = {}
        # cached per match length until the next observation, as lists (`match_probs`, `boost`: a step of a
        # few requests reads them in plain Python) and as arrays (`factors`)
        self._factor_lists: dict[int, list[float]] = {}
        self._factors: dict[int, np.ndarray] = {}
        self._boost: np.ndarray | None = None
        self._boost_valid = False

    @property
    def rates(self) -> list[float]:
        return list(self._all[0])

    @property
    def verifications(self) -> int:
        """How many verifications (and hindsight checks) the pooled rates have learnt from."""
        return self._all[1][0]

    def observe(self, match: int, drafted: int, accepted: int, start: int = 0) -> None:
        """A verification (`update_rates`' arguments) of a proposal behind a `match`-token match."""
        if drafted <= start:
            return
        update_rates(*self._all, drafted, accepted, self.FLOOR, start)
        if match > 0:
            bucket = self._by_match.setdefault(match, (list(self._start), [0] * self.k_max))
            update_rates(*bucket, drafted, accepted, self.FLOOR, start)
        self._factor_lists.clear()
        self._factors.clear()
        self._boost_valid = False

    def factors(self, match: int) -> np.ndarray | None:
        """Per position: the match length's pooled keep rate over the overall one (None: no such match
        length verified yet, or the proposer reports none; the estimates stand as they are)."""
        out = self._factors.get(match)
        if out is None:
            f = self._factor_list(match)
            if f is None:
                return None
            out = self._factors[match] = np.array(f)
        return out

    def _factor_list(self, match: int) -> list[float] | None:
        """`factors` as a list, computed in plain Python: every observation changes every match length's
        factors, and the speculator reads them (`boost`) every step, between model steps that have evicted
        numpy's code from the caches (the array version: ~90 us a step at batch 1 on the AVX-512 machine,
        half of `Speculator.propose`)."""
        if match <= 0 or match not in self._by_match:
            return None
        out = self._factor_lists.get(match)
        if out is None:
            rates, tried = self._by_match[match]
            out = [r / max(a, 1e-3) for r, a in zip(rates, self._all[0], strict=True)]
            # a position this match length never reached says nothing of it (its rate is the prior)
            carry_forward_untried(out, tried)
            self._factor_lists[match] = out
        return out

    def boost(self) -> np.ndarray | None:
        """Per position, the largest factor any match length carries, at least 1 (None: none above 1): what
        `AcceptanceStats.gain_ceiling` multiplies by to stay an upper bound of any proposal's gains."""
        if not self._boost_valid:
            self._boost_valid = True
            self._boost = None
            if self._by_match:
                best = [max(col) for col in zip(*(self._factor_list(m) for m in self._by_match), strict=True)]
                if any(b > 1.0 for b in best):
                    self._boost = np.array([max(b, 1.0) for b in best])
        return self._boost

    def match_prob_rows(self, estimates: np.ndarray, matches: list[int]) -> np.ndarray:
        """`match_probs` of each row of `estimates` (`estimate_rows`) with its proposal's match length."""
        factors = [self.factors(m) for m in matches]
        if all(f is None for f in factors):
            return estimates
        ones = np.ones(estimates.shape[1])
        f = np.stack([ones if x is None else x for x in factors])
        # a row without factors stays as it is: min(e * 1, max(e, MAX_KEEP_PROB)) is e
        return np.minimum(estimates * f, np.maximum(estimates, MAX_KEEP_PROB))

    def match_probs(self, estimates: list[float], match: int) -> list[float]:
        """A proposal's per-position keep probabilities: its request's estimates times its match length's
        factors; a factor raises an estimate to at most `MAX_KEEP_PROB` (an estimate already above it
        stays)."""
        f = self._factor_list(match)
        if f is None:
            return estimates
        return [min(e * x, max(e, MAX_KEEP_PROB)) for e, x in zip(estimates, f, strict=False)]


@dataclass
class Candidate:
    """A decoding request that may verify drafts this step."""

    context: int  # tokens in its KV cache before this step (the decode's position)
    accept_probs: list[float]  # estimated keep probability of each proposed token, in order


class DraftLengthPolicy:
    SMALL = 64  # `_best_count`: gains past this many go through numpy
    MARGIN = 0.1  # how far drafts' expected gain must clear their break-even to be chosen (module docstring)

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

    def drafts_can_pay(self, num_decodes: int, gain_bounds: list[np.ndarray] | np.ndarray) -> bool:
        """Whether any drafts could raise the step's expected tokens per second, given per decoding request
        an upper bound of the gain of each draft position it may verify (non-increasing: e.g.
        `AcceptanceStats.gain_ceiling` cut to the request's draft limit; or all of them concatenated,
        `ceiling_gains`): m draft rows then gain at most
        the sum of the m largest bounds, which is what `choose` maximises over. False: the speculator
        skips proposing this step (k = 0 costs nothing). With exact per-position bounds rather than
        k_max copies of the first one, a batch whose requests keep few drafts (chat, or any batch at the
        price's jump) is skipped instead of looked up every step."""
        if not self.adaptive:
            return True
        flat = gain_bounds if isinstance(gain_bounds, np.ndarray) else (
            np.concatenate(gain_bounds) if gain_bounds else np.empty(0))
        if not len(flat):
            return False
        if len(flat) <= self.SMALL:
            return self._best_count(num_decodes, sorted(flat.tolist(), reverse=True), first_gain=True) > 0
        return self._best_count(num_decodes, -np.sort(-flat), first_gain=True) > 0

    def _best_count(self, b: int, gains: list[float] | np.ndarray, first_gain: bool = False,
                    seconds: list[float] | None = None, scale: float = 1.0) -> int:
        """The number m of draft rows (0..len(gains)) that maximises the expected tokens per second of a step
        of `b` decodes, (b + scale * sum of the first m `gains` / (1 + MARGIN)) / (T(b + m) + H_m): the first
        maximum (the fewest drafts among equals); with `first_gain`, the first m that beats m = 0 (0: none
        does). `seconds`: T(R) from another table (`choose_in_call`), with no host time. `scale`: the
        speculator's calibration of the gains (`KeepCalibration.factor`).

        It runs every step, between model steps that have evicted its code and data from the caches: up to
        `SMALL` gains in plain Python (the numpy version, a dozen small-array calls, took ~140 us a step at
        batch 1 on the AVX2 machine, ~2% of the step; this one ~60), more in numpy (a batch of 32 has up to
        512 gains). Both compute the same values in the same order."""
        if seconds is None:
            host, draft_host = self.price.host_seconds, self.price.draft_host_seconds
            t = self.price.table(b + len(gains))
        else:
            host = draft_host = 0.0
            t = np.asarray(seconds[:b + len(gains) + 1], dtype=float)
        weight = scale / (1 + self.MARGIN)
        if len(gains) > self.SMALL:
            hosts = np.full(len(gains) + 1, draft_host)
            hosts[0] = host
            rate = (b + np.concatenate([[0.0], np.cumsum(gains)]) * weight) / np.maximum(t[b:] + hosts, 1e-9)
            if first_gain:
                above = np.flatnonzero(rate[1:] > rate[0])
                return int(above[0]) + 1 if len(above) else 0
            return int(np.argmax(rate))
        t = t.tolist()
        best, best_rate, kept = 0, b / max(t[b] + host, 1e-9), 0.0
        for m, g in enumerate(gains, 1):
            kept += g
            rate = (b + kept * weight) / max(t[b + m] + draft_host, 1e-9)
            if rate > best_rate:  # strictly: the first maximum
                if first_gain:
                    return m
                best, best_rate = m, rate
        return best

    def choose_in_call(self, probs: list[float], seconds: list[float], batch: int = 1) -> int:
        """The draft length for one decode's proposal with keep probabilities `probs`, for a step inside a C
        call of several (`Speculator.in_call_drafts`) among `batch` decodes: as `choose` for one candidate,
        priced by `seconds` (T(R) of such steps, `CallStepPrice.table`; no host time: the call pays it once
        for all its steps)."""
        gains, g = [], 1.0
        for p in probs[:len(seconds) - 1 - batch]:
            g *= p
            if g <= 0:
                break
            gains.append(g)
        return self._best_count(batch, gains, seconds=seconds)

    def choose(self, cands: list[Candidate], num_decodes: int, scale: float = 1.0,
               weights: list[float] | None = None) -> list[int]:
        """Draft tokens to verify per candidate; `num_decodes`: the decode batch the candidates are part of
        (one row each, the candidates included; with `Speculator.propose`'s `batch`, requests about to decode
        count too, priced as decode rows). `weights`: per candidate, what its kept tokens are worth against
        the batch's mean (`FinishBalance`; None: all alike). Merges the candidates' gain sequences through a
        heap, in plain Python: the speculator's path for small batches (`choose_rows` is the same choice in
        arrays)."""
        if not self.adaptive:
            return [len(c.accept_probs) for c in cands]
        ks = [0] * len(cands)
        # merge the candidates' gain sequences, highest first (each is non-increasing: a prefix product)
        heap = [(-c.accept_probs[0] * (1.0 if weights is None else weights[i]), i, 0)
                for i, c in enumerate(cands) if c.accept_probs and c.accept_probs[0] > 0]
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
        best = self._best_count(num_decodes, gains, scale=scale)
        for i in order[:best]:
            ks[i] += 1
        return ks

    def choose_rows(self, probs: np.ndarray, lengths: list[int], num_decodes: int, scale: float = 1.0,
                    weights: list[float] | None = None) -> list[int]:
        """`choose` with the candidates' keep probabilities as the rows of one array (each row's first
        `lengths[i]` entries; the rest 0), each at most 1.

        The m draft tokens of highest gain are the first m of all candidates' gains (their prefix products)
        in descending order, ties in row-major order: a row's gains never rise (probabilities <= 1), so
        that order takes each candidate's tokens as a prefix, the order `choose`'s heap pops them in. A gain
        of 0 ends its candidate. The speculator's path for larger batches: a batch of 32 has up to 512 gains,
        merged through the heap in ~0.4 ms of a ~17 ms step (code_edit on the AVX-512 machine)."""
        if not self.adaptive:
            return list(lengths)
        if not probs.size:
            return [0] * len(lengths)
        gains = np.cumprod(probs, axis=1)
        if weights is not None:
            gains *= np.asarray(weights)[:, None]
        positive = gains > 0
        row_of = np.nonzero(positive)[0]
        if not len(row_of):
            return [0] * len(lengths)
        flat = gains[positive]
        order = np.argsort(-flat, kind="stable")
        ordered = flat[order]
        best = self._best_count(num_decodes, ordered if len(ordered) > self.SMALL else ordered.tolist(), scale=scale)
        return np.bincount(row_of[order[:best]], minlength=len(lengths)).tolist()


def expected_tokens(probs: list[float] | np.ndarray) -> float:
    """Expected tokens one verification emits: 1 + sum_j prod_{i<=j} p_i."""
    return 1.0 + float(np.cumprod(np.asarray(probs, dtype=float)).sum()) if len(probs) else 1.0
