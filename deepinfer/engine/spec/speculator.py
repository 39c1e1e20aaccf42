"""The engine's speculative decoding: proposer + draft-length policy + metrics, behind three calls the
scheduler makes.

    Scheduler.schedule ─▶ Speculator.propose(decoding requests) ─▶ drafts per request (k chosen)
                          the request is scheduled with 1 + k tokens: its last token and the drafts
    ModelRunner.run    ─▶ verify.verify (one forward for the whole batch, then acceptance per request)
    Scheduler.update   ─▶ Speculator.verified(request, drafted, accepted): statistics; the scheduler
                          rewinds num_computed_tokens past the accepted tokens and frees the KV blocks
                          that only rejected positions used (KVCacheManager.truncate)
    Scheduler._finish  ─▶ Speculator.finished(request, status)

A proposer that is cheap to skip (n-gram, suffix: pure functions of the request's tokens) is not run at
all on a step where, by the policy's bound, no drafts could pay (every request's acceptance estimate too
low for the step's price of more rows), except every few steps for requests owed exploration tries while
exploration's budget lasts, nor for a request backing off after repeated misses (`tries.py`): speculation
then costs a decode step that check and an integer increment per request.

Drafts are capped so a step never emits past `max_tokens` or the context length, and, for structured
requests, cut at the first token the grammar refuses (checked on the matcher, then rolled back).

Up to four plain greedy decodes with the n-gram proposer, alone in the engine (`Scheduler.SPECULATING_CALL_REQUESTS`),
skip all of this for several steps at a time: the scheduler asks `in_call_drafts` for each request's draft
length per match length at that batch, the runner's C call looks up, drafts and verifies step after step
(`FusedDecoder.spec_steps`), and `in_call_done` records what each step verified. At batch 1 the Python
between model steps (~0.7 ms of a ~5 ms drafting step on the AVX-512 machine) was what kept code edits
under 2x of no speculation; at batch 2-4 a drafting step also left the several-step C calls of plain
decodes.
"""

from __future__ import annotations

import itertools
import operator
import time

import numpy as np

from deepinfer.config import SpeculativeMethod
from deepinfer.engine.cost_model import CostModel
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.spec.metrics import SpecMetrics
from deepinfer.engine.spec.ngram import LookupPlan, NgramProposer
from deepinfer.engine.spec.policy import (
    ROW_BY_ROW,
    AcceptanceStats,
    Candidate,
    DraftLengthPolicy,
    FinishBalance,
    HeldProposal,
    KeepCalibration,
    PooledAcceptance,
    ceiling_gains,
    estimate_rows,
)
from deepinfer.engine.spec.proposer import Draft, Proposer
from deepinfer.engine.spec.step_price import (
    CallStepPrice,
    prices_in_cpu_time,
    profile_order,
    profile_row_counts,
    profile_rows,
    profile_schedule,
)
from deepinfer.engine.spec.suffix import SuffixProposer
from deepinfer.engine.spec.tries import ExploreLedger, TryRules


def build_proposer(method: SpeculativeMethod) -> Proposer:
    if method.method == "ngram":
        return NgramProposer(method.prompt_lookup_min, method.prompt_lookup_max)
    if method.method == "suffix":
        return SuffixProposer(method.suffix_max_depth, method.suffix_min_match, method.suffix_min_confidence,
                              method.suffix_recent_requests)
    raise ValueError(f"speculative method {method.method!r} runs a model: the engine core builds its proposer "
                     "(engine/spec/model_proposers.py)")


class Speculator:
    QUIET_STEPS = 4  # steps a batch skips the lookup after one that chose no drafts (`_quiet`)
    # scheduled steps since the last that drafted within which a plain pass of several decode steps stays within
    # the time budget (`drafts_may_pay`)
    RECENT_DRAFT_STEPS = 4
    # the steps of a speculating C call that explores (`in_call_drafts`): a call's steps draft behind every long
    # enough match, and its tries are counted only when it returns
    EXPLORE_CALL_STEPS = 4
    HINDSIGHT_UNTIL = 64  # pooled verifications (hindsight's included) after which hindsight stops (`_hindsight_on`)
    STALE_STEPS = 64  # steps without a verification after which hindsight is on again (`_rearm_if_stale`)

    def __init__(self, method: SpeculativeMethod, cost_model: CostModel, proposer: Proposer | None = None,
                 tries: TryRules | None = None) -> None:
        self.method = method
        self.k_max = method.num_speculative_tokens
        self.proposer = proposer or build_proposer(method)
        self.policy = DraftLengthPolicy(cost_model, method.adaptive)
        self.pool = PooledAcceptance(method.initial_acceptance, self.k_max, method.initial_continuation)
        self.metrics = SpecMetrics(self.proposer.name, self.k_max)
        self.tries = tries or TryRules()
        self.ledger = ExploreLedger()
        self.calibration = KeepCalibration()
        self.balance = FinishBalance()  # closed batches: what each request's kept tokens are worth
        self._quiet_until, self._quiet_batch = 0, 0  # `_quiet`
        self._drafted_at = -self.RECENT_DRAFT_STEPS  # the last step that chose drafts (`drafts_may_pay`)
        self._hindsight_until = self.HINDSIGHT_UNTIL  # pooled verifications while hindsight is on (`_hindsight_on`)
        self._verified_at = 0  # `num_steps` at the last verification (or re-arm: `_rearm_if_stale`)
        self._price_probe = False  # the next proposal verifies a step past the C path (`_probe_past_c_path`)
        self.num_steps = 0  # decode steps proposed for (a call of several counts each): back-offs' and quiet spells' clock
        self._last_propose: float | None = None
        self._last_run: float | None = None
        self._last_steps = 1  # decode steps in that run (`observe_step`)
        self._drafted = False  # whether the last proposal gave drafts (its step's host time is priced apart)
        self._call_price: CallStepPrice | None = None  # steps inside speculating C calls (`in_call_drafts`)
        # at one torch thread, steps are priced in CPU time (the model step's `cpu_seconds`, the host's
        # `thread_time` between proposals), as the start-up profile measures them: on a shared machine wall
        # time moved 2-3x from step to step, and the table built from it (each count's median of 5 wall
        # samples over a lagging load factor) priced batch 1's 3rd row like a 2nd decode where it costs
        # 20% of one, so the policy chose k = 1-2 where k = 3-5 paid (AVX2 fp32, code_edit). The load a
        # step runs under slows every row count alike, so the choice between counts needs no wall time.
        self.cpu_clock = prices_in_cpu_time()

    def calibrate(self, runner, kv, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """Seed the price of verification with a short profile of verification steps (`step_price`)."""
        from deepinfer.layers.gguf_kernels import max_rows

        k = min(self.k_max, max_model_len // 2)
        context = min(128, max_model_len - 1 - k)
        if k < 1 or context < 1:
            return
        counts = profile_row_counts(min(max_num_seqs * (1 + k), max_num_batched_tokens), max_rows())
        fused = getattr(runner.model, "fused", None)
        if fused is not None and not fused.row_invariant:
            self.policy.price.c_path_rows = fused.max_rows
        self.policy.price.row_blocks = any(getattr(m, "pads_rows", False) for m in runner.model.modules())
        c_path = self.policy.price.c_path_rows
        small = max(c_path, max_rows())
        counts = profile_schedule(profile_order(counts, c_path), small)
        sink, runner.stream_sink = runner.stream_sink, None  # the MTP proposer must not keep the profile's rows
        try:
            self.policy.price.seed(profile_rows(runner, kv, counts, k, context, reference=max(small, 1)))
        finally:
            runner.stream_sink = sink

    def _state(self, req: Request) -> AcceptanceStats:
        if req.spec is None:
            req.spec = AcceptanceStats.new(self.method.initial_acceptance, self.k_max, self.method.acceptance_ewma / 4,
                                           self.pool.rates)
        return req.spec

    def propose(self, decodes: list[Request], max_model_len: int, batch: int = 0,
                waiting: bool = False) -> dict[str, list[int]]:
        """Draft tokens for the decoding requests of a step (request id -> drafts; absent: none). A request
        with a token still in flight (a step scheduled ahead, `overlap_host_work`) drafts nothing and is not
        counted: its drafts would follow a token not known yet.

        `batch`: the decode batch these requests are part of, counting requests that will decode within a few
        steps (still computing their prompt, or admitted next), at least the decodes. The policy values a
        kept token at a step of that batch, not of the decodes alone: while seven of a batch of eight
        prefill, the first to decode would otherwise price its drafts as a lone request's (a kept token
        worth a whole step), and the tokens it gains only make it finish ahead of the others, leaving a tail
        of smaller steps that cost nearly as much (code_edit b=8 on the AVX2 machine: ~10 such drafting
        steps per run, 0.93x of no speculation). `waiting`: requests wait for a slot (a closed batch's
        weights, `FinishBalance`, wait until they are all in)."""
        decodes = [r for r in decodes if not r.num_pending_tokens]
        now = time.thread_time() if self.cpu_clock else time.perf_counter()
        if self._last_propose is not None and self._last_run is not None:
            # the wall time from the previous proposal to this one, less that call's model time, is the
            # host's share of its steps (a call of several decode steps shares it among them; capped: an idle
            # engine between requests is not host work, and `idle` drops the sample after one)
            host = min(now - self._last_propose - self._last_run, self._last_run) / self._last_steps
            self.policy.price.observe_host(host, self._drafted)
        self._last_propose, self._last_run, self._drafted = now, None, False
        self.num_steps += 1
        if not decodes:
            return {}
        states = [self._state(r) for r in decodes]
        limits = self._limits(decodes, max_model_len)
        for r, st in zip(decodes, states, strict=True):
            if st.hindsight is not None:
                self._check_hindsight(r, st)
        batch = max(batch, len(decodes))
        self._rearm_if_stale(batch)
        weights = None if waiting else self.balance.weights(decodes, time.perf_counter())
        out, looked, unmatched = self._choose_drafts(decodes, states, limits, batch, weights)
        if self._hindsight_on():
            self._keep_for_hindsight(decodes, states, limits, looked, unmatched, out)
        return out

    def _choose_drafts(self, decodes: list[Request], states: list[AcceptanceStats], limits: list[int],
                       batch: int, weights: list[float] | None = None
                       ) -> tuple[dict[str, list[int]], list[Draft] | None, list[bool] | None]:
        """`propose`'s choice for the requests `decodes` (`limits`: the most drafts each may verify;
        `weights`: `FinishBalance.weights`): the drafts (request id -> tokens); where it looked the requests
        up, each one's proposal (None where it looked up none); where it asked the proposer's cheap check,
        whether it ruled each request out."""
        # the back-off and exploration rules (tries.py) and the price bound need a proposer the speculator
        # may skip at will
        tries = self._skippable()
        explore = tries and self._may_explore(batch)
        probe, self._price_probe = self._price_probe, False  # one try per stale spell (`_rearm_if_stale`)
        priced = True
        estimates = None  # the states' estimates (`estimate_rows`), once per step where the price reads them
        unmatched = None  # per request: its lookup (or the proposer's cheap check) found nothing
        unpaused = None  # the limits of the requests that may draft, where some were then looked up
        if tries:
            limits = self._unpaused(states, limits, self.num_steps)
            quiet = not probe and self._quiet(batch, self.num_steps)
            if not quiet and any(limits):
                unpaused = limits
                matched = self._matched(decodes, limits)
                unmatched = [lim > 0 and not m for lim, m in zip(limits, matched, strict=True)]
                limits = matched
                if not any(limits):
                    return self._no_drafts(decodes, states, unmatched), None, unmatched
                estimates = estimate_rows(states)
            if quiet or not (probe or self._drafts_can_pay(states, limits, batch, estimates, weights)):
                # no drafts pay by the price: look up only requests owed exploration, every few steps
                priced = False
                if not quiet:
                    self._go_quiet(batch, states, unpaused, limits, estimates)
                lookup = explore and self.num_steps % self.tries.lookup_every == 0
                limits = [lim if lookup and self.tries.explorable(s) else 0 for s, lim in zip(states, limits, strict=True)]
                if any(limits):
                    self.ledger.charge(ExploreLedger.LOOKUP_SHARE * self.policy.price.seconds(len(decodes)))
        if not any(limits):  # the common step of a workload that does not repeat itself: nothing else to do
            return self._no_drafts(decodes, states, unmatched), None, unmatched
        drafts = self.proposer.propose_batch(decodes, limits)
        cands = []
        for r, d, lim in zip(decodes, drafts, limits, strict=True):
            d = d.truncated(lim)
            if r.grammar is not None and len(d):
                d = d.truncated(_grammar_prefix(r, d))
            cands.append((r, d))
        keep = None  # per candidate, the keep probabilities of its proposal's tokens (rows of an array past 8)
        if priced and len(cands) <= ROW_BY_ROW:  # request by request: cheaper than array operations here
            rows = estimates.tolist() if estimates is not None else [s.estimates() for s in states]
            keep = [self.policy.accept_probs(self.pool.match_probs(e, d.match), d.confidence, len(d))
                    for (_, d), e in zip(cands, rows, strict=True)]
            ks = self.policy.choose([Candidate(r.num_computed_tokens, p) for (r, _), p in zip(cands, keep, strict=True)],
                                    batch, scale=self.calibration.factor, weights=weights)
        elif priced:
            lengths = [len(d) for _, d in cands]
            if estimates is None:
                estimates = estimate_rows(states)
            keep = self._keep_probs(estimates, [d for _, d in cands], lengths)
            ks = self.policy.choose_rows(keep, lengths, batch, scale=self.calibration.factor, weights=weights)
        else:
            ks = [0] * len(cands)
        if priced and tries and not any(ks) and any(len(d) for _, d in cands):
            self._go_quiet(batch, states, unpaused, [len(d) for _, d in cands], estimates)  # proposals priced out
        if probe and keep is not None:
            ks = self._probe_past_c_path(cands, keep, ks)
        if explore:
            ks = self._explore(cands, states, ks, batch)
        out = {}
        self._drafted = any(ks)
        if self._drafted:
            self._drafted_at = self.num_steps
        for i, ((r, d), s, k, lim) in enumerate(zip(cands, states, ks, limits, strict=True)):
            self.metrics.chose(k)
            r.draft_probs = d.probs[:k] if k and d.probs is not None else None
            if k:
                out[r.request_id] = list(d.token_ids[:k])
                s.last_match = d.match
                # what the estimates expect it to keep (`KeepCalibration`): the sum of its gains' prefix products
                s.predicted_kept = float(sum(itertools.accumulate(keep[i][:k], operator.mul))) if keep is not None else 0.0
            else:
                s.relax(unmatched=(lim > 0 and not len(d)) or (unmatched is not None and unmatched[i]))
        return out, [d for _, d in cands], unmatched

    def _hindsight_on(self) -> bool:
        """Whether requests that draft nothing hold their proposals for hindsight (`_keep_for_hindsight`):
        while the pooled estimates rest on fewer than HINDSIGHT_UNTIL verifications (a new engine, which
        knows only the prior). Past that they stop: on an engine warmed by spec.py's earlier rows, holding
        proposals throughout read 0.97-0.98 of the same engine without (JSON at batch 8 and 32, chat at 32,
        code edits at 8; 3 starts): the lookups' time, and drafts chosen at estimates near break-even. An
        engine that goes STALE_STEPS steps without verifying anything turns it on for another
        HINDSIGHT_UNTIL (`_rearm_if_stale`)."""
        return self._holds_proposals() and self.pool.verifications < self._hindsight_until

    def _holds_proposals(self) -> bool:
        """Whether hindsight applies at all (`SpeculativeMethod.hindsight`, an adaptive draft length and a
        proposer the speculator may skip at will)."""
        return self.method.hindsight and self.policy.adaptive and self.proposer.skippable

    def _rearm_if_stale(self, batch: int) -> None:
        """After STALE_STEPS steps without a verification: hindsight (if off) is on for another
        HINDSIGHT_UNTIL pooled verifications and the calibration starts over; and at a batch whose plain
        steps take the C decode path, while the counts past it are priced by the start-up profile alone
        (`StepPrice.unserved_past_c_path`), the next proposal verifies a step past it
        (`_probe_past_c_path`). Nothing else teaches an engine that drafts nothing: one whose first run of
        code edits at batch 8 kept half of its few drafts
        (calibration 0.66, pooled first-draft rate 0.73) priced every later proposal out, past the C path
        where a draft row needs ~0.75 of a kept token, and drafted 6-36 tokens a run where its twins drafted
        400-500 (about one start in ten on the 2-core Zen 4). Hindsight costs lookups, not rows: it checks
        the proposals the engine does not draft against the tokens it decodes, and it stops again after the
        burst; the calibration's evidence is the drafts of a time the engine has since stopped drafting in."""
        if self.num_steps - self._verified_at < self.STALE_STEPS:
            return
        price = self.policy.price
        if self._holds_proposals() and not self._hindsight_on():
            self._verified_at = self.num_steps
            self._hindsight_until = self.pool.verifications + self.HINDSIGHT_UNTIL
            self.calibration = KeepCalibration()
        if self._skippable() and batch <= price.c_path_rows and price.unserved_past_c_path():
            self._verified_at = self.num_steps
            self._price_probe = True

    def _probe_past_c_path(self, cands: list[tuple[Request, Draft]], keep: list[list[float]] | np.ndarray,
                           ks: list[int]) -> list[int]:
        """The priced draft lengths `ks`, raised so that the step goes past the C decode path's rows: the
        candidates' whole proposals, the likeliest first draft first, until it does (`ks` where they cannot
        take it there, or it is there already). A start-up profile measured in a slow spell priced the counts
        past the C path at up to 1.5x what served steps took (T(16) 30.9 ms where other starts read
        18.7-21.4), and an engine at batch 8 then never chose such a step, so no served step corrected them
        (session 41, the 2-core Zen 4). One served step is enough: a count's served over profiled seconds
        scales every count of its regime (`StepPrice._entries`). Its predicted cost is charged to
        exploration's ledger."""
        price, decodes = self.policy.price, len(cands)
        if decodes + sum(ks) > price.c_path_rows:
            return ks
        out = list(ks)
        for i in sorted(range(decodes), key=lambda i: -keep[i][0] if len(cands[i][1]) else 1.0):
            if decodes + sum(out) > price.c_path_rows or not len(cands[i][1]):
                break
            out[i] = max(out[i], len(cands[i][1]))
        if decodes + sum(out) <= price.c_path_rows:
            return ks
        self.ledger.charge(price.seconds(decodes + sum(out)) - price.seconds(decodes + sum(ks)))
        return out

    def _keep_for_hindsight(self, decodes: list[Request], states: list[AcceptanceStats], limits: list[int],
                            looked: list[Draft] | None, unmatched: list[bool] | None,
                            out: dict[str, list[int]]) -> None:
        """Hold on to a proposal for each request that drafts nothing this step (priced out, quiet, backed
        off) and holds none yet: what it would have verified (`limits[i]` tokens at most, its lookup's if it
        had one this step), to be checked against the tokens it decodes next (`_check_hindsight`). Not for
        requests the proposer's check ruled out this step (`unmatched`), requests with a grammar (their
        drafts are cut to what it allows) or proposals with their own probabilities (their acceptance is
        not the target's probability of the draft)."""
        for i, (r, st, lim) in enumerate(zip(decodes, states, limits, strict=True)):
            if r.request_id in out:
                st.hindsight = None  # it drafts: its verification teaches what the held proposal would
                continue
            if lim <= 0 or st.hindsight is not None or r.grammar is not None or (unmatched and unmatched[i]):
                continue
            d = looked[i] if looked is not None else None
            if d is None or not len(d):
                if not self.proposer.likely_to_propose(r):
                    continue
                d = self.proposer.propose(r, lim)
            if len(d) and d.probs is None:
                st.hindsight = HeldProposal(tuple(d.token_ids[:lim]), len(r.token_ids), d.match)

    def _check_hindsight(self, req: Request, state: AcceptanceStats) -> None:
        """A held proposal against the tokens `req` decoded since: each position they settle (kept: it
        matches, as every one before it; or the first mismatch) teaches the request's and the pooled
        estimates as a verification would (`AcceptanceStats.learn`, `PooledAcceptance.observe`), a token at
        a time, so the first positions are learnt after one step; it is dropped at its first mismatch or
        last token. For greedy decoding the tokens decoded are the ones verification would have kept; when
        sampling, a draft token is kept with the target's probability of it, the probability that the sample
        is that token. A request priced out of drafting learns while it does not draft: code edits at batch
        8, where the 9th row costs a jump, started from the prior, at which no draft pays, and never drafted
        (fixed k = 5: 1.3x decode)."""
        held = state.hindsight
        tokens = held.tokens
        decoded = req.token_ids[held.start:held.start + len(tokens)]
        kept = 0
        for drafted, actual in zip(tokens, decoded, strict=False):
            if drafted != actual:
                break
            kept += 1
        settled = min(kept + 1, len(decoded))  # the positions the decoded tokens settle
        if settled > held.learnt:
            state.learn(held.match, settled, kept, self.method.acceptance_ewma, held.learnt)
            self.pool.observe(held.match, settled, kept, held.learnt)
            held.learnt = settled
        if kept < len(decoded) or kept == len(tokens):
            state.hindsight = None
            self.metrics.hindsight(settled, kept)

    def _matched(self, decodes: list[Request], limits: list[int]) -> list[int]:
        """`limits` with 0 for each request the proposer's cheap check (`Proposer.likely_to_propose`, on the
        tokens as they are now: False means its lookup finds nothing) rules out: such a request cannot draft,
        so it neither enters the price's bound nor is looked up. Chat at batch 8 (AVX-512 machine): the bound
        over all eight requests cost ~0.22 ms after every 4-step call (~1% of the run) where an n-gram is
        found at ~11% of positions."""
        return [lim if lim and self.proposer.likely_to_propose(r) else 0
                for r, lim in zip(decodes, limits, strict=True)]

    def _no_drafts(self, decodes: list[Request], states: list[AcceptanceStats],
                   unmatched: list[bool] | None = None) -> dict[str, list[int]]:
        """A step in which no request drafts: each state idles (`relax`; `unmatched[i]`: request i was looked
        up, or ruled out by the proposer's check, and nothing was found), the metrics count k = 0 for all."""
        for i, s in enumerate(states):
            s.relax(unmatched=unmatched is not None and unmatched[i])
        self.metrics.chose(0, len(decodes))
        for r in decodes:
            r.draft_probs = None
        return {}

    def _keep_probs(self, estimates: np.ndarray, drafts: list[Draft], lengths: list[int]) -> np.ndarray:
        """Each proposal's per-position keep probabilities (`DraftLengthPolicy.accept_probs` of its request's
        estimates, the rows of `estimates`, times its match length's factors), as the rows of one array, 0
        past each proposal."""
        probs = self.pool.match_prob_rows(estimates, [d.match for d in drafts])
        for i, d in enumerate(drafts):
            if d.confidence is not None and len(d):
                n = len(d)
                probs[i, :n] = np.sqrt(np.maximum(0.0, probs[i, :n] * np.asarray(d.confidence, dtype=float)))
        return np.where(np.arange(probs.shape[1]) < np.array(lengths)[:, None], probs, 0.0)

    def _explore(self, cands: list[tuple[Request, Draft]], states: list[AcceptanceStats], ks: list[int],
                 batch: int) -> list[int]:
        """The priced draft lengths `ks` raised by exploration (`tries.py`), its cost charged to the ledger."""
        price, decodes = self.policy.price, len(cands)
        room = self._explore_rows() - batch - sum(ks)  # explored rows stay on the C path
        explored = []
        for (_, d), s, k in zip(cands, states, ks, strict=True):
            e = min(max(k, self.tries.explore(s, d)), k + max(0, room))
            room -= e - k
            explored.append(e)
        if explored == ks:
            return ks
        # where the price chose no drafts, the step also pays a drafting step's longer host time
        host = price.draft_host_seconds - price.host_seconds if not any(ks) else 0.0
        self.ledger.charge(price.seconds(decodes + sum(explored)) - price.seconds(decodes + sum(ks)) + max(0.0, host))
        per_token = price.seconds(batch) / batch  # what a kept token saves: its share of a plain step
        for s, k, e in zip(states, ks, explored, strict=True):
            if e > k:
                s.explored_from, s.explore_refund = k, per_token
        return explored

    def _explore_rows(self) -> int:
        """The most rows an exploring step may have: the C decode path's (`StepPrice.c_path_rows`; no limit
        without one). Past it, on the 2-core AVX2 machine, exploration cost far more than the ledger's
        price of its rows (chat b=32 0.94x, code_edit b=8 0.90x of the same engine without it, 5 repeats
        interleaved; the ledger held its priced cost at 2%): there a draft row costs most of what a kept
        token saves, and the estimates exploration taught let the price choose drafts near their
        break-even. What it is for, a start-up table that priced batch 1's draft rows too high, happens on
        the C path."""
        return self.policy.price.c_path_rows or 1 << 30

    def _may_explore(self, batch: int) -> bool:
        return batch < self._explore_rows() and self.ledger.allows(self.tries.budget)

    def wants_fresh_step(self, requests: list[Request], max_model_len: int, batch: int = 0,
                         waiting: bool = False) -> bool:
        """Whether the engine should let the step in flight finish before it schedules the next one, so that
        `requests` (that step's) can draft: a step scheduled ahead of the one in flight has their next token
        pending, and they draft nothing in it (`propose`). False only where `propose` would give them no
        drafts, or likely none: an adaptive, skippable proposer whose price says no drafts pay at this
        batch, or that would find no draft on any request's tokens as they are now
        (`Proposer.likely_to_propose`), and no exploration lookup is due next step (`batch` as in
        `propose`). The engine then keeps overlapping host work with the model (`LLMEngine.step_tokens`),
        as without speculation, instead of running every other step without it (chat at batch 1: the
        prior's drafts pay on the C path's cheap rows, but an n-gram is found at ~11% of positions, and
        losing every other step's overlap cost 3-6% of throughput). `waiting` as in `propose`."""
        if not self._skippable() or self._price_probe:
            return True
        requests = [r for r in requests if not r.finished]
        if not requests:
            return True
        states = [self._state(r) for r in requests]
        step = self.num_steps + 1  # the step the next `propose` counts
        limits = self._unpaused(states, self._limits(requests, max_model_len), step)
        likely = [lim if lim and self.proposer.likely_to_propose(r) else 0
                  for r, lim in zip(requests, limits, strict=True)]
        batch = max(batch, len(requests))
        weights = None if waiting else self.balance.weights(requests, time.perf_counter())
        if not self._quiet(batch, step) and self._drafts_can_pay(states, likely, batch, weights=weights):
            return True
        return step % self.tries.lookup_every == 0 and self._may_explore(batch) and any(
            lim and self.tries.explorable(s) for s, lim in zip(states, limits, strict=True))

    def drafts_may_pay(self, requests: list[Request], max_model_len: int) -> bool:
        """Whether drafts could pay for `requests`' next steps as a batch of their own, should the proposer find
        some: one of the last RECENT_DRAFT_STEPS steps chose drafts and the price's bound on the requests'
        estimates' ceilings (`_drafts_can_pay`) allows them (not whether the proposer finds any now). The
        scheduler then keeps a plain pass of several decode steps of them, which drafts nothing, within its
        time budget. Always where the draft length is fixed or the proposer is not skippable. (The recent
        drafts: chat at batch 8, whose loose ceilings allow drafts its proposals rarely earn, otherwise
        decoded in one-step passes, 0.96x of no speculation.)"""
        if not self._skippable():
            return True
        if self.num_steps - self._drafted_at >= self.RECENT_DRAFT_STEPS:
            return False
        states = [self._state(r) for r in requests]
        limits = self._unpaused(states, self._limits(requests, max_model_len), self.num_steps + 1)
        return self._drafts_can_pay(states, limits, len(requests))

    def _go_quiet(self, batch: int, states: list[AcceptanceStats], unpaused: list[int] | None, found: list[int],
                  estimates: np.ndarray | None) -> None:
        """No drafts paid this step: the next QUIET_STEPS steps at this batch size or larger skip the lookup
        and the price (`_quiet`), at batches from the C decode path's rows up. Not where it was for want of
        proposals (`found`: per request, the drafts it was offered) while the requests' ceilings say drafts
        would pay if every request that may draft (`unpaused`: their limits) had some and fewer than half of
        them had: a code edit's copy resumes a token or two after an edited name, and at batch 8 the quiet
        steps after one where only one or two of the eight matched drafted nothing for four steps (adaptive
        0.8x of a fixed k = 5 on the AMX Xeon, session 55). `unpaused` None: no request was looked up."""
        if unpaused is not None:
            may = sum(1 for lim in unpaused if lim)
            if 2 * sum(1 for n in found if n) < may and self._drafts_can_pay(states, unpaused, batch, estimates):
                return
        if batch >= self.policy.price.c_path_rows:
            self._quiet_until, self._quiet_batch = self.num_steps + self.QUIET_STEPS, batch

    def _quiet(self, batch: int, step: int) -> bool:
        """Whether the step skips the lookup and the price: within QUIET_STEPS of a step that chose no
        drafts for a batch this size or smaller (at least the C decode path's rows, any size without one:
        below it a lookup is cheap and drafts pay often), by the bound of `_drafts_can_pay` or after
        looking up and pricing proposals. That bound is loose where drafts are near their break-even
        (batch 8 past the C path: a boosted ceiling of 0.99 against a break-even of ~0.83), and the
        lookups and the choice it then allows every step cost ~0.8 ms of a 30 ms step (code_edit b=8 on
        the AVX2 machine) for drafts that are not chosen; the bound itself, computed every step at batch
        32, cost ~0.3 ms of a 17 ms step (AVX-512 machine) while it kept saying no: between observations
        the states only drift towards their prior, which cannot raise their ceilings."""
        return step < self._quiet_until and batch >= self._quiet_batch

    def _skippable(self) -> bool:
        return self.policy.adaptive and self.proposer.skippable

    def _limits(self, requests: list[Request], max_model_len: int) -> list[int]:
        """The most drafts each request may verify (the model length and its max_tokens leave room for)."""
        limits = []
        for r in requests:
            k = min(self.k_max, max_model_len - r.num_tokens - 1)
            if r.max_tokens is not None:
                k = min(k, r.max_tokens - r.num_output_tokens - 1)  # the step also emits the target's token
            limits.append(max(0, k))
        return limits

    def _unpaused(self, states: list[AcceptanceStats], limits: list[int], step: int) -> list[int]:
        return [0 if self.tries.backed_off(s, step) else lim for s, lim in zip(states, limits, strict=True)]

    def _drafts_can_pay(self, states: list[AcceptanceStats], limits: list[int], batch: int,
                        estimates: np.ndarray | None = None, weights: list[float] | None = None) -> bool:
        """The policy's bound (`DraftLengthPolicy.drafts_can_pay`) on the states' gain ceilings (times
        their requests' `weights`, where given); `estimates`: `estimate_rows(states)` where the caller has it."""
        if not any(limits):
            return self.policy.drafts_can_pay(batch, [])
        if estimates is None:
            estimates = estimate_rows(states)
        ceilings = ceiling_gains(estimates, [s.prior for s in states], limits, self.proposer.confident,
                                 self.pool.boost())
        if weights is not None:  # each request's ceilings are its limit's first entries, in request order
            ceilings = ceilings * np.repeat(weights, limits)
        return self.policy.drafts_can_pay(batch, ceilings)

    def observe_step(self, num_rows: int, seconds: float, cpu_seconds: float | None = None, steps: int = 1) -> None:
        """A finished step in which every request decoded or verified drafts: `num_rows` rows (decodes and
        drafts) in `seconds` of model-runner time, `cpu_seconds` of its threads' CPU time (prices
        verification; CPU time at one torch thread, see `cpu_clock`). `steps` > 1: that many decode steps
        of the rows in one call (`num_scheduler_steps`, where no request drafted): each is priced at its
        share, the host time between calls comes once per call, and each step counts on the clock of
        back-offs and quiet spells: counted once per call, a quiet spell of QUIET_STEPS proposals lasted 16
        decode steps in the 4-step calls of batch 8, a sixth of a 96-token run of code edits without drafts
        after every step that priced its proposals out."""
        if self.cpu_clock and cpu_seconds:
            seconds = cpu_seconds
        self.policy.price.observe(num_rows, seconds / steps)
        self.ledger.observe(seconds, steps)
        self._last_run, self._last_steps = seconds, steps
        self.num_steps += steps - 1

    def in_call_drafts(self, reqs: list[Request], max_rows: int) -> list[LookupPlan] | None:
        """For a batch of plain greedy decodes `reqs`: per request the prompt lookup, with a draft length per
        n-gram match length (0 below the shortest match), for a call of several speculative steps in C
        (`FusedDecoder.spec_steps`, steps of at most `max_rows` rows, one per decode and the rest for drafts),
        or None where this speculator cannot hand its choice to C (not the n-gram proposer, or a fixed draft
        length longer than the rows a step has for drafts). Adaptive, each length is the policy's choice
        (`DraftLengthPolicy.choose_in_call`) for a proposal of that match length at this batch, from the
        request's estimates as they are now, its first draft's from the request's own record behind that match
        length (`AcceptanceStats.first_keep_rate`): the call's steps keep it, and `in_call_done` teaches the
        estimates what they verified. The host time between proposals spans the call and is not sampled
        (`idle`)."""
        batch = len(reqs)
        room = max_rows - batch
        if type(self.proposer) is not NgramProposer or room < 1 or (not self.policy.adaptive and self.k_max > room):
            return None
        self.idle()
        proposer = self.proposer
        if self._call_price is None or self._call_price.max_rows != max_rows:
            self._call_price = CallStepPrice(self.policy.price, max_rows)
        seconds = self._call_price.table() if self.policy.adaptive else []
        explore = self._skippable() and self._may_explore(batch)
        plans = []
        for req in reqs:
            state = self._state(req)
            ks = [0] * (proposer.max_n + 1)
            explores = False
            if not self.policy.adaptive:
                ks[proposer.min_n:] = [self.k_max] * (proposer.max_n + 1 - proposer.min_n)
            elif not self.tries.backed_off(state, self.num_steps):
                estimates, cap = state.estimates(), min(self.k_max, room)
                explores = explore and not state.call_explored and self.tries.explorable(state)
                for m in range(proposer.min_n, proposer.max_n + 1):
                    probs = self.pool.match_probs(estimates, m)[:cap]
                    if probs:
                        probs = [state.first_keep_rate(m, probs[0]), *probs[1:]]
                    ks[m] = self.policy.choose_in_call(probs, seconds, batch)
                    # exploration (tries.py) behind matches long enough, as `propose` explores: without it a
                    # request whose estimates start from rates pooled over other traffic never verifies a draft
                    # and never learns (code edits after JSON requests at batch 1: no drafts, 0.6x of a fixed
                    # k = 5). One short call in a request's life: the call's steps explore behind every such
                    # match, 16 steps of them cost JSON requests at batch 1 ~5-10% of CPU time
                    if explores and m >= self.tries.min_match:
                        ks[m] = max(ks[m], min(self.tries.tokens, cap))
            plans.append(LookupPlan(tuple(ks), proposer.min_n, proposer.max_n, proposer.max_lookback, explores))
        return plans

    def call_scheduled(self, reqs: list[Request], plans: list[LookupPlan]) -> None:
        """`in_call_drafts`' plans for `reqs` got their call (the scheduler had its blocks): an exploring plan
        spends its request's one exploring call."""
        for req, plan in zip(reqs, plans, strict=True):
            if plan.explores:
                self._state(req).call_explored = True

    def in_call_done(self, verdicts: list[tuple[Request, list[tuple[int, int, int]]]],
                     steps: list[tuple[int, float]]) -> None:
        """The steps of an `in_call_drafts` call: (rows, seconds) each, and per request (match length, drafts,
        drafts kept) of each step it was in, in order. A step without drafts does not relax the request's
        estimates towards the prior as `propose` does (a choice measured this way; a request that misses keeps
        its lower estimates through a call's plain steps)."""
        self.num_steps += len(steps)
        if self._call_price is not None:
            for rows, seconds in steps:
                self._call_price.observe(rows, seconds)
        for req, rows in verdicts:
            for match, drafted, kept in rows:
                self.metrics.chose(drafted)
                if drafted:
                    self._state(req).last_match = match
                    self.verified(req, drafted, kept)

    def idle(self) -> None:
        """The engine ran out of work: the time until the next proposal is no step's host time."""
        self._last_propose = None

    def verified(self, req: Request, drafted: int, accepted: int) -> None:
        self._verified_at = self.num_steps
        state = self._state(req)
        if state.predicted_kept > 0:
            self.calibration.observe(state.predicted_kept, accepted)
            state.predicted_kept = 0.0
        state.observe(drafted, accepted, self.method.acceptance_ewma)
        self.pool.observe(state.last_match, drafted, accepted)
        if state.explore_refund:
            self.ledger.refund(max(0, accepted - state.explored_from) * state.explore_refund)
            state.explore_refund = 0.0
        if self.policy.adaptive:
            self.tries.after_verify(state, drafted, accepted, self.num_steps)
        self.metrics.verified(drafted, accepted)
        self.proposer.on_verified(req, drafted, accepted)

    def finished(self, req: Request, status: RequestStatus | None = None) -> None:
        """`req` ends with `status` (None: not known to the caller; as a stop)."""
        self.balance.on_finished(req.request_id, status is RequestStatus.FINISHED_LENGTH)
        self.proposer.on_finished(req)

    def stats(self) -> dict[str, float]:
        return self.metrics.stats()


def _grammar_prefix(req: Request, draft: Draft) -> int:
    """How many leading draft tokens the request's grammar allows (0 while it compiles)."""
    g = req.grammar
    if g is None or not g.live:
        return len(draft) if g is None else 0
    n = 0
    for t in draft.token_ids:
        if not g.accept(t):
            break
        n += 1
        if g.terminated:
            break
    if n:
        g.matcher.rollback(n)  # type: ignore[union-attr]
    return n
