"""Prefill policies: in what order prefill work is considered and how many tokens each piece gets.

The Scheduler owns the mechanics (KV blocks, preemption, `max_num_seqs`, the token budget) and
asks its policy, every step:

    begin_step()                                       a new step, nothing in it yet
    add_work(new_tokens, context, prefill, completes)  the scheduler put this in the step (decodes too)
    prefill_order(running_prefills, waiting, ...)      which prefill work to consider, best first
    chunk_size(req, start, remaining, token_budget)    how many of req's tokens to run now

`tokens` (TokenBudgetPolicy): running prefills, then waiting requests FIFO; each piece gets all the
token budget has left (classic chunked prefill).

`compute` (ComputeBudgetPolicy): a step has a time budget (the target inter-token latency of the
decodes in it). Decodes always run; prefill chunks fill the time left, each sized with the cost
model so the predicted step time fits: a long prompt's later chunks attend to more context and so
get fewer tokens. Prefill work (running and waiting alike) is served by bucket of predicted
remaining prefill time, short first, FIFO within a bucket; preempted requests come first, and any
request whose first token has waited longer than `aging_s` comes before every bucket (oldest
first), so a stream of short prompts cannot starve a long one. The first prefill chunk of a step
always gets at least `min_chunk` tokens, even when the decodes alone fill the budget. Once a step
completes a prompt (its first token comes out of the step), later chunks may stretch the step to at
most `first_token_stretch` times its predicted time so far: a long prompt that arrived with a short
one takes a small chunk now and the rest next step, instead of holding the short one's first token
for its whole prefill.

Within that stretch, a further prompt joins a step that already completes p prompts only if that lowers
the sum of first-token times (`_worth_batching`): its whole remaining prefill (c seconds, predicted) delays
those p first tokens by c each, while leaving it to the next step costs it and the n - 1 prompts queued
behind it that step's fixed part o each: the cost model's overhead plus the step's decodes, which every
step runs before any prompt in it is answered. It joins iff p * c <= o * n, and never when the rest of
its prompt exceeds the step's token budget left (its chunk would be a pure delay for the p). One that
passes may still be cut by the stretch bound above. Where prefill is cheap beside a step's fixed part (an
accelerator, short prompts) prompts batch; where it is expensive and nothing decodes yet (a 158-token
prompt takes ~0.4 s on a 2-core AVX2 machine in float32, against ~10 ms of overhead), a wave of prompts
that arrived together is answered one by one instead of all at the end of one long step; and as the
answered ones start decoding, each further step costs the queue their decodes too, so the rest of the wave
joins in larger groups. (o was the overhead alone before: under guidellm's 32 streams, 32 x 158-token
prompts at once on a 2-core Zen 4, the wave went one prompt a step beside 20-30 decodes, ~115 ms a step,
and its last first token came at 4.5 s: the p95 TTFT.)
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

from deepinfer.config import SchedulerConfig
from deepinfer.engine.cost_model import CostModel, StepWork, add_chunk, chunk_features, empty_step
from deepinfer.engine.request import Request, RequestStatus

# Auto step-time budget: the predicted time of one step that prefills `max_num_batched_tokens` fresh
# tokens (the largest step the token policy runs), and at least this many one-sequence decode steps.
# A smaller budget (first tried: 4 decode steps, ~75 ms on an AMX Xeon) cut prefill into so many small
# chunks that 32 x 158-token prompts took 1.5x longer to prefill than under `tokens`; with this one,
# fresh short prompts get the same chunks as under `tokens`, and what the cost model adds is shrinking
# the chunks that would overrun it: late chunks of long prompts (attention grows with context) and
# steps already full of decodes.
AUTO_BUDGET_MIN_DECODE_STEPS = 4.0
# Bucket upper bounds, in step-time budgets of predicted remaining prefill time: tiny prompts take at
# most a quarter of a step, short ones fit in one, medium ones in a few; the rest are long. Tiny comes
# apart from short because the auto budget fits a whole `max_num_batched_tokens` prompt: in one bucket, a
# 40-token prompt that arrived just after a 1500-token one would wait for it (with `first_token_stretch`,
# the tiny one goes first and the long one takes the next step).
BUCKET_BOUNDS = (0.25, 1.0, 8.0)


class PrefillPolicy(ABC):
    """Decides which prefill work runs in a step and how many of a request's tokens it gets."""

    def begin_step(self) -> None:  # noqa: B027 - optional hook
        """A new step starts: nothing is scheduled in it yet."""

    def add_work(self, new_tokens: int, context: int, prefill: bool = False,  # noqa: B027
                 completes: bool = False) -> None:
        """The scheduler placed `new_tokens` tokens after `context` computed ones in this step;
        `prefill` tells chunks chosen by `chunk_size` from decodes; `completes`: the chunk ends its
        request's prefill (the step samples the request's next token)."""

    def prefill_order(self, running: list[Request], waiting: Iterable[Request],
                      start_of: Callable[[Request], int]) -> list[Request]:
        """Running requests still prefilling and waiting requests, in the order to serve them.
        `start_of(req)` estimates the tokens `req` has computed (or will find in the prefix cache).
        Default: running first, then waiting in queue order (preempted requests sit at its front)."""
        return [*running, *waiting]

    @abstractmethod
    def chunk_size(self, req: Request, start: int, remaining: int, token_budget: int) -> int:
        """`start`: tokens already in the KV cache; `remaining`: tokens left to compute;
        `token_budget`: tokens still free in this step. Returns 0..min(remaining, token_budget)."""


class TokenBudgetPolicy(PrefillPolicy):
    """As many tokens as the step's token budget has left (classic chunked prefill)."""

    def chunk_size(self, req: Request, start: int, remaining: int, token_budget: int) -> int:
        return min(remaining, token_budget)


class ComputeBudgetPolicy(PrefillPolicy):
    """Prefill chunks sized to fit a step-time budget; bucketed, aged FIFO order (see module doc)."""

    def __init__(self, cost_model: CostModel, time_budget_s: float, min_chunk: int = 16, aging_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic,
                 first_token_stretch: float = 2.0) -> None:
        if time_budget_s <= 0:
            raise ValueError(f"the step time budget must be positive, got {time_budget_s}")
        if first_token_stretch < 1:
            raise ValueError(f"first_token_stretch must be >= 1, got {first_token_stretch}")
        self.cost_model = cost_model
        self.time_budget_s = time_budget_s
        self.min_chunk = min_chunk
        self.aging_s = aging_s
        self.clock = clock  # tests drive aging with a fake clock
        self.first_token_stretch = first_token_stretch
        self._used = empty_step()
        self._decoding = empty_step()  # the step's fixed part: its overhead and the decodes in it
        self._prefilled = False
        self._answers = 0  # prompts this step completes (their first token comes out of it)
        self._queued_from: dict[str, int] = {}  # request id -> prefill candidates from it to the order's end

    def begin_step(self) -> None:
        self._used = empty_step()
        self._decoding = empty_step()
        self._prefilled = False
        self._answers = 0
        self._queued_from = {}

    def add_work(self, new_tokens: int, context: int, prefill: bool = False, completes: bool = False) -> None:
        add_chunk(self._used, new_tokens, context)
        if not prefill:
            add_chunk(self._decoding, new_tokens, context)
        self._prefilled |= prefill
        self._answers += prefill and completes

    def bucket(self, num_tokens: int, start: int) -> int:
        """0 tiny / 1 short / 2 medium / 3 long, by predicted time to prefill tokens [start, num_tokens)."""
        seconds = self.cost_model.prefill_seconds(num_tokens, start)
        for i, bound in enumerate(BUCKET_BOUNDS):
            if seconds <= bound * self.time_budget_s:
                return i
        return len(BUCKET_BOUNDS)

    def prefill_order(self, running: list[Request], waiting: Iterable[Request],
                      start_of: Callable[[Request], int]) -> list[Request]:
        now = self.clock()
        candidates = [*running, *waiting]

        def key(item: tuple[int, Request]) -> tuple[int, float, int]:
            i, req = item
            if req.status is RequestStatus.PREEMPTED:
                return (0, 0.0, i)  # back to the front, in the order the scheduler queued them
            if now - req.arrival_time >= self.aging_s:
                return (1, req.arrival_time, i)
            return (2 + self.bucket(req.num_tokens, start_of(req)), req.arrival_time, i)

        order = [req for _, req in sorted(enumerate(candidates), key=key)]
        self._queued_from = {req.request_id: len(order) - i for i, req in enumerate(order)}
        return order

    def chunk_size(self, req: Request, start: int, remaining: int, token_budget: int) -> int:
        limit = min(remaining, token_budget)
        budget_s = self.time_budget_s
        if self._answers:
            if not self._worth_batching(req, start, remaining, limit):
                return 0
            budget_s = min(budget_s, self.first_token_stretch * self.cost_model.predict_features(self._used))
        n = self.cost_model.largest_chunk(self._used, start, budget_s, limit)
        if not self._prefilled:  # progress guarantee: the step's first prefill chunk is never starved
            n = max(n, min(self.min_chunk, limit))
        return n

    def _worth_batching(self, req: Request, start: int, remaining: int, limit: int) -> bool:
        """Whether `req` should join a step that already completes `_answers` prompts (module docstring):
        only whole (the rest of its prompt fits the token budget left) and only if p * c <= o * n, o the
        predicted time of the step's overhead and decodes."""
        if limit < remaining:
            return False
        cost = self.cost_model
        c = cost.predict_features(chunk_features(remaining, start))
        o = cost.predict_features(self._decoding)
        n = self._queued_from.get(req.request_id, 1)
        return self._answers * c <= o * n


def resolve_step_time_budget(config: SchedulerConfig, cost_model: CostModel, block_size: int) -> float:
    """The step-time budget in seconds: the configured one, or auto (see AUTO_BUDGET_MIN_DECODE_STEPS)."""
    if config.step_time_budget_ms is not None:
        return config.step_time_budget_ms / 1000
    full_chunk = cost_model.bounded_prefill_seconds(config.max_num_batched_tokens)
    return max(full_chunk, AUTO_BUDGET_MIN_DECODE_STEPS * cost_model.predict(StepWork(((1, block_size),))))


def make_policy(config: SchedulerConfig, cost_model: CostModel, time_budget_s: float,
                block_size: int) -> PrefillPolicy:
    if config.scheduler == "tokens":
        return TokenBudgetPolicy()
    return ComputeBudgetPolicy(cost_model, time_budget_s, min_chunk=block_size,
                               aging_s=config.bucket_aging_ms / 1000, first_token_stretch=config.first_token_stretch)
