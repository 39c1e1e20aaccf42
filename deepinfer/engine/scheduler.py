"""Continuous batching under one token budget per step, with no separate prefill/decode phases.

Each step: running requests that decode come first (one token each), then prefill work (running
requests still prefilling and waiting requests) in the order the `PrefillPolicy` gives, while the
token budget, `max_num_seqs` and free blocks allow. The policy (`policies.py`) also decides how many
prompt tokens each piece gets: `tokens` fills the token budget in FIFO order; `compute` fills a
step-time budget predicted by the cost model, serving short prompts first. When blocks run out, the
newest running request not yet scheduled this step is preempted: its blocks are freed, it goes back
to the front of the queue and is recomputed later from its tokens, so nothing deadlocks and nothing
is dropped; no waiting request is admitted in a step that preempted.

A waiting request starts after its cached prefix: device blocks, then blocks the KV tiers (host
memory, store) hold, which count as computed; the engine loads them before the step runs. One whose
prefix reaches into the store waits (skipped, not blocking the queue) while those blocks are read in
the background (`kvcache/prefetch.py`); every step starts the reads of all waiting requests, so a request
deep in the queue is staged by the time its turn comes.

Speculative decoding (`spec/`, optional): a decoding request may be scheduled with 1 + k tokens, its
last token and k draft tokens from the `Speculator`, when its blocks fit without preempting anyone (else
it decodes one token); `update` appends the tokens the runner's verification kept, rewinds
`num_computed_tokens` to them and frees the blocks only rejected positions used (`KVCacheManager.truncate`).

Several decode steps per pass (`num_scheduler_steps`): when the step is nothing but plain greedy decodes
(at most `decode_steps_rows` of them) and no request waits, each is scheduled with `num_steps` > 1 and
blocks for that many tokens; the runner decodes them in one C call, each step's argmax the next one's input,
and `update` appends the tokens like kept drafts (cut at a stop condition, the KV past it rolled back).
Up to four plain greedy decodes with the n-gram proposer (`SPECULATING_CALL_REQUESTS`, at most half of
`decode_steps_rows`), nothing else running or waiting, get such a call whose steps also speculate
(`_speculative_call`): blocks for one token a step plus the step's spare rows (shared among the requests'
drafts), and the draft length per match length the speculator chose at its start; the runner's C call drafts
and verifies step after step.

Structured requests wait (skipped, not blocking the queue) until their grammar has compiled; one
whose grammar failed is finished with `Request.error` and reported through `take_failed`. `update`
advances a request's grammar matcher once per appended token, and the grammar's termination ends it.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer.config import SchedulerConfig
from deepinfer.engine.cost_model import CostModel, StepWork
from deepinfer.engine.policies import (
    ComputeBudgetPolicy,
    PrefillPolicy,
    TokenBudgetPolicy,
    make_policy,
    resolve_step_time_budget,
)
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.sampler import plain_greedy
from deepinfer.kvcache.manager import KVCacheManager, PrefixHit

if TYPE_CHECKING:
    from deepinfer.engine.spec.ngram import LookupPlan
    from deepinfer.engine.spec.speculator import Speculator
    from deepinfer.multimodal.inputs import MultiModalInputs

__all__ = ["ComputeBudgetPolicy", "PrefillPolicy", "ScheduledRequest", "Scheduler", "SchedulerOutput",
           "TokenBudgetPolicy"]


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start: int  # num_computed_tokens when scheduled
    # speculative decoding: draft tokens verified after the request's last token (num_new_tokens = 1 + k)
    draft_token_ids: list[int] = field(default_factory=list)
    # greedy decode steps the runner takes for this one-token row in one call (its tokens fed back in C)
    num_steps: int = 1
    # those steps speculate in C (`Scheduler._speculative_call`): their prompt lookup and draft lengths, and the
    # most tokens the call may append (its blocks are allocated)
    in_call_drafts: LookupPlan | None = None
    max_new_tokens: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # decodes (1 token) first
    preempted: list[Request] = field(default_factory=list)
    committed: bool = False  # see Scheduler.commit

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    # the most plain greedy decodes that get a speculating C call together (`_speculative_call`; the call takes
    # up to half the C path's rows). Four: over three interleaved pairs of spec.py runs at batch 2, 4 and 8
    # (AVX-512 machine, session 33) calls of up to four read code edits 1.50-1.56x / 1.20-1.25x / 1.04-1.08x of no
    # speculation against a lone request's calls' 1.45-1.48x / 1.02-1.26x / 0.98-1.13x (adaptive / fixed k = 5 at
    # batch 8 0.93-0.96 against 0.82-0.96), chat at batch 8 0.95-0.99x against 0.95-0.98x; session 32 had read chat
    # at batch 8 a median 0.97x with them and 1.00x without over six or seven runs each, a difference these pairs
    # did not show (both within the A/A spread)
    SPECULATING_CALL_REQUESTS = 4

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 policy: PrefillPolicy | None = None, cost_model: CostModel | None = None,
                 speculator: Speculator | None = None, decode_steps_rows: int = 0, max_loras: int = 1) -> None:
        """`policy` defaults to the one `config.scheduler` names, built on `cost_model` (default: an
        uncalibrated CostModel); `speculator`: speculative decoding (None: off); `decode_steps_rows`: the most
        decodes the runner can take several steps of in one call (0: none, `num_scheduler_steps` is moot);
        `max_loras`: the most distinct LoRA adapters the running requests use at once."""
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.cost_model = cost_model or CostModel()
        # resolved once: an auto budget must not drift with the online fit, or step sizes would wander
        self.step_time_budget = resolve_step_time_budget(config, self.cost_model, kv.block_size)
        self.policy = policy or make_policy(config, self.cost_model, self.step_time_budget, kv.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.failed: list[Request] = []  # ended by the engine with `Request.error`, not yet reported
        self.speculator = speculator
        self.decode_steps_rows = decode_steps_rows
        self.max_loras = max_loras
        # set by the caller while it adds no request until all have finished (`LLMEngine.closed_batch`, the
        # offline `LLM.generate`): no request can arrive during a pass, so `multi_step_budget_ms` is moot
        self.closed_batch = False
        # seconds the vision tower takes per image tile (the runner measures it; None: not yet): under the
        # `compute` policy a step starts encoding only as many tiles as its time budget has room for
        self.tile_seconds: Callable[[], float | None] = lambda: None
        self._step_tiles = 0  # tiles the step being scheduled starts encoding
        # a model whose image placeholders attend to their whole run (Gemma 3): no prefill chunk ends inside one
        self.whole_image_runs = False

    # ------------------------------------------------------------------ queue

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ schedule

    def decode_batch_ahead(self) -> int:
        """The decode batch of the next few steps: the running requests (decoding or computing their prompt)
        and the waiting ones the batch has room for (speculation values a kept token by it)."""
        return min(self.config.max_num_seqs, len(self.running) + len(self.waiting))

    def take_failed(self) -> list[Request]:
        """Requests the engine ended with an error (`Request.error`) since the last call."""
        failed, self.failed = self.failed, []
        return failed

    def _fail_bad_grammars(self) -> None:
        for req in [r for r in self.waiting if r.grammar is not None and r.grammar.poll() and r.grammar.error]:
            req.error = req.grammar.error
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            self.failed.append(req)

    def schedule(self) -> SchedulerOutput:
        self._fail_bad_grammars()
        self._start_prefetches()
        out = SchedulerOutput()
        policy = self.policy
        policy.begin_step()
        self._step_tiles = 0
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        prefill_chunks: list[ScheduledRequest] = []
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1 and not self._ends_pending(r)]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        if self.speculator is not None and not prefills:
            call = self._speculative_call(decodes)
            if call:
                out.scheduled.extend(call)
                for item in call:
                    policy.add_work(1, item.start)
                return out
        drafts = self.speculator.propose(decodes, self.max_model_len, self.decode_batch_ahead(), bool(self.waiting)) \
            if self.speculator is not None else {}
        verifying: list[ScheduledRequest] = []
        for req in decodes:  # oldest first; never held back by the time budget
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue
            draft = drafts.get(req.request_id, [])[:budget - 1]
            # drafts only where their blocks fit as they are: speculation never preempts anyone
            if draft and self.kv.allocate(req, 1 + len(draft)):
                item = ScheduledRequest(req, 1 + len(draft), req.num_computed_tokens, draft)
                verifying.append(item)  # after every one-token row: the attention backend wants decodes first
            elif self._allocate_running(req, 1, out, scheduled_ids):
                item = ScheduledRequest(req, 1, req.num_computed_tokens)
                out.scheduled.append(item)
            else:
                continue
            scheduled_ids.add(req.request_id)
            policy.add_work(item.num_new_tokens, req.num_computed_tokens)
            budget -= item.num_new_tokens
        admitting = not out.preempted
        computing = self._blocks_in_prefill(prefills) if self.waiting else set()  # only waiting prompts ask
        adapters: set[int] | None = None  # the running requests' LoRA slots, once a waiting request with one asks
        for req in policy.prefill_order(prefills, self.waiting, self._estimated_start):
            if budget == 0:
                break
            if req.status is RequestStatus.RUNNING:
                start = req.num_computed_tokens
                remaining = req.num_tokens - start
                n = min(policy.chunk_size(req, start, remaining, budget), budget, remaining)
                if n <= 0:
                    break  # the step is full; what comes later in the order is worth less
                n = self._whole_runs(req, start, self._tiles_fit(req, start, n), budget)
                if n <= 0:
                    continue  # its next image tile waits for a step with encoding time (or tokens) left
                if not self._allocate_running(req, n, out, scheduled_ids):
                    admitting = False
                    continue
                admitting = admitting and not out.preempted
            else:  # waiting (or preempted earlier in this very step, which `admitting` now refuses)
                # Under `compute` a short waiting prompt may come before a running long prefill; if its
                # blocks leave that prefill short, the prefill preempts as above (newest first).
                if not admitting or len(self.running) >= self.config.max_num_seqs:
                    admitting = False
                    continue
                if not req.ready_to_schedule():
                    continue
                if req.lora is not None:  # at most max_loras adapters among the running requests
                    if adapters is None:
                        adapters = {r.lora.slot for r in self.running if r.lora is not None}
                    if req.lora.slot not in adapters and len(adapters) >= self.max_loras:
                        continue
                # device blocks, then host / store hits: those get fresh blocks, loaded before the step runs
                hit = self.kv.lookup_prefix(req)
                if hit.prefetching:
                    continue  # its store hits are being read off the engine thread; the others go ahead
                if computing and hit.num_blocks < (req.num_tokens - 1) // self.kv.block_size and \
                        req.block_hashes[hit.num_blocks] in computing:
                    continue  # a prompt in prefill is computing its next blocks: they are cached once done
                start = hit.start(self.kv.block_size)
                remaining = req.num_tokens - start
                n = min(policy.chunk_size(req, start, remaining, budget), budget, remaining)
                if n <= 0:
                    break
                n = self._whole_runs(req, start, self._tiles_fit(req, start, n), budget)
                if n <= 0:
                    continue
                if not self.kv.allocate(req, n, hit):
                    admitting = False  # FIFO: the head waits for room rather than being overtaken
                    continue
                self._admit(req, start, hit)
                if req.lora is not None:
                    adapters.add(req.lora.slot)
                computing.update(req.block_hashes[hit.num_blocks:])
            prefill_chunks.append(ScheduledRequest(req, n, start))
            scheduled_ids.add(req.request_id)
            policy.add_work(n, start, prefill=True, completes=start + n == req.num_tokens)
            budget -= n
        # single-token work (decodes, 1-token prompt tails) first, then multi-token chunks
        ones = [s for s in prefill_chunks if s.num_new_tokens == 1]
        out.scheduled.extend(ones)
        out.scheduled.extend(verifying)
        out.scheduled.extend(s for s in prefill_chunks if s.num_new_tokens != 1)
        steps = self._decode_steps(out)
        for item in out.scheduled if steps > 1 else ():
            item.num_steps = steps
        return out

    def image_tiles_per_step(self) -> int | None:
        """How many image tiles a step may start encoding: as many as the step time budget holds at the measured
        seconds per tile, at least 1 (None: no bound; the `tokens` policy, whose token budget bounds the
        placeholders, and so the tiles, a step takes). Before any tile was timed, 1."""
        if self.config.scheduler != "compute":
            return None
        seconds = self.tile_seconds()
        if seconds is None:
            return 1
        return max(1, int(self.step_time_budget / max(seconds, 1e-9)))

    def _tiles_fit(self, req: Request, start: int, n: int) -> int:
        """`n` tokens of `req` from `start`, cut before the first image tile whose encoding the step has no room
        for (`image_tiles_per_step`; a tile starts encoding with the chunk holding its first placeholder). The
        step's first tile always fits: a prompt's images never wait forever. Counts the tiles it lets in."""
        mm = req.multi_modal
        limit = self.image_tiles_per_step() if mm is not None else None
        if limit is None or start >= req.num_prompt_tokens:
            return n
        per = mm.tokens_per_tile
        first = -(-bisect_left(mm.positions, start) // per)  # the first tile starting at or after `start`
        allowed = max(limit - self._step_tiles, 0 if self._step_tiles else 1)
        last = min(first + allowed, mm.num_tiles)  # tiles first .. last - 1 may start here
        if last < mm.num_tiles:
            n = min(n, mm.positions[last * per] - start)
        self._step_tiles += sum(1 for t in range(first, last) if mm.positions[t * per] < start + n)
        return n

    def _whole_runs(self, req: Request, start: int, n: int, budget: int) -> int:
        """Under `whole_image_runs`: `n` tokens of `req` from `start` cut back to the first placeholder of a run
        they would end inside; when the chunk starts at or inside that run (nothing before it to take instead),
        stretched to the run's end if the step's token budget holds it, else 0 (it waits for a step with room:
        `check_image_runs` made sure an empty enough step has it)."""
        mm = req.multi_modal
        if not self.whole_image_runs or mm is None or n <= 0:
            return n
        cut = mm.run_cut(start, start + n)
        if cut is None:
            return n
        first, last = cut
        if first > start:
            return first - start
        return last + 1 - start if last + 1 - start <= budget else 0

    def check_image_runs(self, mm: MultiModalInputs) -> None:
        """ValueError unless every run of `mm`'s placeholders fits one step beside the most decodes (with their
        drafts) that can run with it (under `whole_image_runs` a run is never split across steps, so a step
        must have room for it whatever else runs)."""
        longest = max((last + 1 - first for first, last in mm.runs), default=0)
        room = self.image_run_room()
        if self.whole_image_runs and longest > room:
            raise ValueError(f"an image's {longest} placeholder tokens must be prefilled in one step, and a step "
                             f"of max_num_batched_tokens={self.config.max_num_batched_tokens} has room for {room} "
                             f"beside up to {self.config.max_num_batched_tokens - room} decode tokens (max_num_seqs "
                             f"- 1 = {self.config.max_num_seqs - 1} requests, with their drafts)")

    def image_run_room(self) -> int:
        """The tokens a step always has for a run of image placeholders: the token budget less the most decode
        tokens (drafts included) that can share the step."""
        per_decode = 1 + (self.speculator.k_max if self.speculator is not None else 0)
        return self.config.max_num_batched_tokens - (self.config.max_num_seqs - 1) * per_decode

    def in_use_adapters(self) -> set[int]:
        """The LoRA slots of every unfinished request (their adapters must stay loaded)."""
        return {r.lora.slot for r in self.requests.values() if r.lora is not None and not r.finished}

    def _speculative_call(self, decodes: list[Request]) -> list[ScheduledRequest]:
        """Plain greedy decodes with rows to spare on the whole-layer C path (at most half of `decode_steps_rows`),
        nothing else running or waiting: their next `num_scheduler_steps` steps as one C call that also
        speculates (`Speculator.in_call_drafts`), with blocks for every token the call may append to each (one
        a step, and the step's spare rows; never preempting). Empty: schedule as usual. Between model steps
        the host's Python costs ~0.7 ms a drafting step (~15% of one at batch 1 on the AVX-512 machine), which
        the call pays once; and a drafting step of a few decodes otherwise leaves the several-step C calls."""
        rows = self.decode_steps_rows
        # at most half the rows: with fewer to spare, a call's steps may draft 1-3 tokens in all, where the
        # ordinary path's price can choose a step past the C path with many (code edits at batch 8 whose
        # first requests finished early, leaving 5-7: 0.88-0.95 of a fixed k = 5 with calls there)
        if (self.config.num_scheduler_steps <= 1 or not decodes or len(decodes) > self.SPECULATING_CALL_REQUESTS
                or 2 * len(decodes) > rows or len(self.running) != len(decodes) or self.waiting):
            return []
        # priced only for a batch that may get a call (this runs every step); at least two steps whatever the
        # budget: a call's kept drafts are appended as a pass's tokens are (`update`), which a one-step item
        # is not, and without the call the ordinary path would verify the drafts in a step past the C path's
        # rows (other kernels: in float32's default mode its output then parted from decoding without
        # speculation, seen once in a combined test run)
        steps = max(2, self._pass_steps(decodes))
        per_step = 1 + rows - len(decodes)  # the most tokens a step appends to one request
        budgets = []
        for req in decodes:
            # a LoRA request's rows take the layer loop (the C call reads the base weights alone)
            if req.status is not RequestStatus.RUNNING or req.num_pending_tokens or not plain_greedy(req) \
                    or req.lora is not None:
                return []
            max_new = min(steps * per_step, self.max_model_len - req.num_tokens)
            if req.max_tokens is not None:
                max_new = min(max_new, req.max_tokens - req.num_output_tokens)
            if max_new <= 1:
                return []
            budgets.append(max_new)
        plans = self.speculator.in_call_drafts(decodes, rows)
        if plans is None:
            return []
        if any(plan.explores for plan in plans):
            steps = min(steps, self.speculator.EXPLORE_CALL_STEPS)
            budgets = [min(n, steps * per_step) for n in budgets]
        if not self.kv.allocate_all(list(zip(decodes, budgets, strict=True))):
            return []
        self.speculator.call_scheduled(decodes, plans)
        return [ScheduledRequest(req, 1, req.num_computed_tokens, num_steps=steps, in_call_drafts=plan,
                                 max_new_tokens=n) for req, plan, n in zip(decodes, plans, budgets, strict=True)]

    def _pass_steps(self, decodes: list[Request], drafts_may_pay: bool = False) -> int:
        """Steps for a pass of several decode steps of `decodes`: `num_scheduler_steps`, fewer where the cost
        model prices one step of them so that the pass would outlast `multi_step_budget_ms` (at least 1); all
        of them without a start-up profile (the default prices are a slow CPU's, ~30 ms a step) and in a closed
        batch (nobody can arrive and wait for the pass) unless `drafts_may_pay`: a plain pass drafts nothing,
        and the speculator says drafts could pay for these requests as soon as their proposer finds some."""
        limit = self.config.num_scheduler_steps
        if (self.closed_batch and not drafts_may_pay) or not self.cost_model.profiled:
            return limit
        step = self.cost_model.predict(StepWork(tuple((1, r.num_tokens - 1) for r in decodes)))
        if step <= 0:
            return limit
        return max(1, min(limit, int(self.config.multi_step_budget_ms / 1e3 / step)))

    def _decode_steps(self, out: SchedulerOutput) -> int:
        """How many greedy decode steps the runner takes for this step's rows in one call: 1 unless every row is
        a plain greedy decode (at most `decode_steps_rows` of them) and nobody waits (a new prompt would wait for
        the whole call); then up to `num_scheduler_steps`, no row past its max_tokens or the model length, with
        blocks for every step (never preempting anyone; without them, one step)."""
        items = out.scheduled
        if self.config.num_scheduler_steps <= 1 or not items or len(items) > self.decode_steps_rows or self.waiting \
                or out.preempted:
            return 1
        reqs = [item.request for item in items]
        # a code edit's copy resumes a token or two after an edited name: a 16-step pass of a closed batch of
        # eight there drafted nothing for 16 steps (adaptive 0.81x of a fixed k = 5 at code_edit b=8, session 55)
        speculating = self.closed_batch and self.speculator is not None \
            and self.speculator.drafts_may_pay(reqs, self.max_model_len)
        steps = self._pass_steps(reqs, drafts_may_pay=speculating)
        for item in items:
            req = item.request
            if item.num_new_tokens != 1 or item.draft_token_ids or req.num_tokens != item.start + 1 \
                    or not plain_greedy(req) or req.lora is not None:
                return 1
            if req.max_tokens is not None:
                steps = min(steps, req.max_tokens - req.num_output_tokens)
            steps = min(steps, self.max_model_len - req.num_tokens)
        if steps <= 1 or not self.kv.allocate_all([(item.request, steps) for item in items]):
            return 1
        return steps

    def _blocks_in_prefill(self, prefills: list[Request]) -> set[bytes]:
        """Hashes of the full prompt blocks that running prefills have yet to compute. A waiting prompt whose
        next block is among them waits: admitted now it would compute the same blocks a second time."""
        if not self.kv.enable_prefix_caching:
            return set()
        size = self.kv.block_size
        return {h for r in prefills for h in r.block_hashes[r.num_computed_tokens // size:]}

    def _start_prefetches(self) -> None:
        """Look up every waiting request that can run, which starts the background read of its store
        hits (the admission loop may stop before the queue's end; the lookups are memoised)."""
        prefetcher = self.kv.tiers.prefetcher if self.kv.tiers is not None else None
        if prefetcher is None:
            return
        prefetcher.begin_step()
        for req in self.waiting:
            if req.request_id not in prefetcher and req.ready_to_schedule():
                self.kv.lookup_prefix(req)

    def _allocate_running(self, req: Request, n: int, out: SchedulerOutput, scheduled_ids: set[str]) -> bool:
        """Blocks for `n` more tokens of a running request, preempting the newest unscheduled running
        requests (possibly `req` itself) until they fit. True if `req` is still running and allocated."""
        while not self.kv.allocate(req, n):
            victim = self._newest_unscheduled(scheduled_ids)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _admit(self, req: Request, start: int, hit: PrefixHit) -> None:
        self.waiting.remove(req)
        req.num_computed_tokens = start
        self.kv.admit(req, hit)
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        self.running.append(req)

    def _estimated_start(self, req: Request) -> int:
        """Tokens `req` would not need to compute now: its computed ones, or its cached prefix if waiting."""
        if req.status is RequestStatus.RUNNING:
            return req.num_computed_tokens
        return self.kv.lookup_prefix(req).start(self.kv.block_size)

    def _newest_unscheduled(self, scheduled_ids: set[str]) -> Request:
        for req in reversed(self.running):
            if req.request_id not in scheduled_ids:
                return req
        raise RuntimeError("no request left to preempt")  # unreachable: the current request is unscheduled

    def _preempt(self, req: Request) -> None:
        self.requeue(req)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1

    def requeue(self, req: Request) -> None:
        """Take a running request back to the head of the queue, its blocks freed (it starts over)."""
        self.kv.free(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.replay_end = req.kv_floor = 0
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ update

    def _ends_pending(self, req: Request) -> bool:
        """True when the token a running step is sampling for `req` will end it by length, so
        scheduling its next token ahead of that step's result would be wasted."""
        if not req.num_pending_tokens:
            return False
        limit = req.max_tokens is not None and req.num_output_tokens + req.num_pending_tokens >= req.max_tokens
        return limit or req.num_tokens >= self.max_model_len

    def commit(self, out: SchedulerOutput) -> None:
        """A planned step was launched: its tokens count as computed, and each request it samples
        for has one pending token, so the next step can be scheduled before this one's result."""
        out.committed = True
        for item in out.scheduled:
            req = item.request
            end = item.start + item.num_new_tokens
            if end == req.num_tokens or item.draft_token_ids:
                req.num_pending_tokens += 1
            req.num_computed_tokens = end  # verified drafts: rewound to the kept ones by `update`

    def update(self, out: SchedulerOutput, sampled: dict[str, int],
               accepted: dict[str, list[int]] | None = None) -> list[Request]:
        """Apply a finished (committed) step: append sampled tokens, publish computed blocks, finish
        requests that hit a stop condition. Returns the requests that got a new token. Requests
        finished while it ran are skipped; one preempted by a step scheduled ahead of this result
        still gets its token (it was sampled from valid KV), so output never depends on timing.
        `accepted`: per request that verified drafts, the drafts kept (appended before its sampled
        token; a stop condition met by one of them ends the request there); per request decoded for several
        steps, the tokens before the last step's, appended the same way."""
        if not out.committed:  # schedule() -> update() with nothing in between (the step ran inline)
            self.commit(out)
        advanced = []
        for item in out.scheduled:
            req = item.request
            token = sampled.get(req.request_id)
            if token is not None:
                req.num_pending_tokens = max(0, req.num_pending_tokens - 1)
            kept: list[int] = []
            if item.draft_token_ids or item.num_steps > 1:
                kept = (accepted or {}).get(req.request_id, []) if token is not None else []
                if self.speculator is not None and token is not None and item.draft_token_ids:
                    self.speculator.verified(req, len(item.draft_token_ids), len(kept))
                if req.status is RequestStatus.RUNNING and not req.finished:
                    # KV is valid for the last token and the kept drafts only: roll the rest back
                    req.num_computed_tokens = item.start + 1 + len(kept)
                    self.kv.truncate(req, req.num_computed_tokens)
            if req.finished:
                continue  # aborted (or stopped by a stop string) while the step ran
            if req.status is RequestStatus.RUNNING and not kept:
                self.kv.register_computed(req)
            if token is None:
                continue
            advanced.append(req)
            for t in [*kept, token]:
                req.token_ids.append(t)
                if self._append_ends(req, t):
                    break
            if kept and req.status is RequestStatus.RUNNING:
                self.kv.register_computed(req)  # after appending: the kept drafts' blocks are named by them
        return advanced

    def _append_ends(self, req: Request, token: int) -> bool:
        """Stop checks and grammar for a token just appended; finishes `req` and returns True if it ends it."""
        status = self._stop_status(req, token)
        if req.grammar is not None:
            # the one place a structured request's matcher advances: once per appended token
            if not req.grammar.accept(token):
                # only when no token satisfied both the grammar and another rule (e.g. min_tokens)
                req.error = f"token {token} violates the request's grammar; no allowed token was left"
                status = RequestStatus.FINISHED_ABORTED
            elif status is None and req.grammar.terminated:
                status = RequestStatus.FINISHED_STOPPED
        if status is not None:
            self._finish(req, status)
            return True
        return False

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        if req.num_output_tokens >= req.params.min_tokens:
            if token in req.params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not req.params.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if req.max_tokens is not None and req.num_output_tokens >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """Finish a request from outside (e.g. a stop string matched in the detokenized text)."""
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            req.stop_reason = stop_reason
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if self.speculator is not None:
            self.speculator.finished(req, status)
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.kv.free(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            self.kv.free(req)  # it holds no blocks, but maybe a prefetch
        req.status = status
        del self.requests[req.request_id]
