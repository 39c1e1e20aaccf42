"""Continuous batching under one token budget per step, with no separate prefill/decode phases.

Each step: running requests that decode come first (one token each), then running
requests still prefilling (next chunk), then waiting requests in FIFO order while the
token budget, `max_num_seqs` and free blocks allow. How many prompt tokens a request
gets in a step is decided in one place, the `PrefillPolicy` (token budget here; a
compute-aware policy plugs in the same way). When blocks run out, the newest running
request not yet scheduled this step is preempted: its blocks are freed and it is
recomputed later from its tokens, so nothing deadlocks and nothing is dropped.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

from deepinfer.config import SchedulerConfig
from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.request import Request, RequestStatus


class PrefillPolicy(ABC):
    """Decides how many of a request's uncomputed tokens run in this step."""

    @abstractmethod
    def chunk_size(self, req: Request, start: int, remaining: int, token_budget: int) -> int:
        """`start`: tokens already in the KV cache; `remaining`: tokens left to compute;
        `token_budget`: tokens still free in this step. Returns 0..min(remaining, token_budget)."""


class TokenBudgetPolicy(PrefillPolicy):
    """As many tokens as the step's token budget has left (classic chunked prefill)."""

    def chunk_size(self, req: Request, start: int, remaining: int, token_budget: int) -> int:
        return min(remaining, token_budget)


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start: int  # num_computed_tokens when scheduled


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # decodes (1 token) first
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 policy: PrefillPolicy | None = None) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.policy = policy or TokenBudgetPolicy()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

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

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        prefill_chunks: list[ScheduledRequest] = []
        # decodes first (stable: oldest first), then running prefills
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            remaining = req.num_tokens - req.num_computed_tokens
            n = 1 if remaining == 1 else self.policy.chunk_size(req, req.num_computed_tokens, remaining, budget)
            n = min(n, budget, remaining)
            if n <= 0:
                continue
            while not self.kv.allocate(req, n):
                victim = self._newest_unscheduled(scheduled_ids)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            item = ScheduledRequest(req, n, req.num_computed_tokens)
            (out.scheduled if n == 1 else prefill_chunks).append(item)
            scheduled_ids.add(req.request_id)
            budget -= n
        if not out.preempted:
            self._admit_waiting(budget, out, prefill_chunks)
        # single-token work (decodes, 1-token prompt tails) first, then multi-token chunks
        ones = [s for s in prefill_chunks if s.num_new_tokens == 1]
        out.scheduled.extend(ones)
        out.scheduled.extend(s for s in prefill_chunks if s.num_new_tokens != 1)
        return out

    def _admit_waiting(self, budget: int, out: SchedulerOutput, chunks: list[ScheduledRequest]) -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not req.ready_to_schedule():
                skipped.append(self.waiting.popleft())
                continue
            cached = self.kv.find_cached_prefix(req)
            start = len(cached) * self.kv.block_size
            remaining = req.num_tokens - start
            n = min(self.policy.chunk_size(req, start, remaining, budget), budget, remaining)
            if n <= 0 or not self.kv.allocate(req, n, cached):
                break  # FIFO: the head waits for room rather than being overtaken
            self.waiting.popleft()
            req.num_computed_tokens = start
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = min(start, req.num_prompt_tokens)
                self.kv.record_prefix_query(req, req.num_cached_tokens)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            chunks.append(ScheduledRequest(req, n, start))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _newest_unscheduled(self, scheduled_ids: set[str]) -> Request:
        for req in reversed(self.running):
            if req.request_id not in scheduled_ids:
                return req
        raise RuntimeError("no request left to preempt")  # unreachable: the current request is unscheduled

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        self.running.remove(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ update

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Apply a finished step: advance computed counts, append sampled tokens, finish
        requests that hit a stop condition. Returns the requests that got a new token."""
        advanced = []
        for item in out.scheduled:
            req = item.request
            if req.finished:
                continue  # aborted while the step ran
            req.num_computed_tokens = item.start + item.num_new_tokens
            self.kv.register_computed(req)
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.token_ids.append(token)
            advanced.append(req)
            status = self._stop_status(req, token)
            if status is not None:
                self._finish(req, status)
        return advanced

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
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.kv.free(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        del self.requests[req.request_id]
