"""Start-up profile for the cost model: a few synthetic steps run through the real model runner.

    EngineCore.__init__ ─▶ profile_steps(runner, kv, ...) ─▶ [(StepWork, seconds)] ─▶ CostModel.calibrate

The shapes move each cost term on its own (tokens, sequences, attention pairs, decode context) so the
fit can tell them apart; on the default model on CPU the whole profile takes ~1-2 s. The KV it writes
is garbage: blocks come from the pool and go back without being registered in the prefix cache, so no
later request reads them. Sampling is greedy, so the sampler's random stream is left untouched.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

from deepinfer.engine.cost_model import StepWork
from deepinfer.engine.request import Request
from deepinfer.engine.runner import ModelRunner
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import ScheduledRequest, SchedulerOutput
from deepinfer.kvcache.manager import KVCacheManager

logger = logging.getLogger(__name__)

# One step per entry: groups of (count, new_tokens, context_before). The first step only warms up.
Shape = tuple[tuple[int, int, int], ...]
PROFILE_SHAPES: tuple[Shape, ...] = (
    ((1, 1, 16),),  # warm-up, not kept
    ((1, 1, 16),),  # the floor: one short decode
    ((1, 1, 1024),),  # one long-context decode
    ((8, 1, 256),),
    ((16, 1, 64),),  # many sequences, little context
    ((4, 1, 1024),),  # decode KV reads
    ((1, 32, 0),),
    ((1, 128, 0),),
    ((1, 384, 0),),  # linear layers
    ((1, 128, 1024),),  # attention pairs: the same chunk after a long context
    ((4, 1, 256), (1, 128, 256)),  # mixed
)
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def profile_steps(runner: ModelRunner, kv: KVCacheManager, max_model_len: int, max_num_seqs: int,
                  max_num_batched_tokens: int, shapes: Sequence[Shape] = PROFILE_SHAPES,
                  time_limit_s: float = 3.0) -> list[tuple[StepWork, float]]:
    """Run each shape as one step (shrunk to the engine's limits) and return the measured samples.
    Stops early once `time_limit_s` is spent, so a slow machine does not stall start-up."""
    ids = itertools.count()
    samples: list[tuple[StepWork, float]] = []
    started = time.perf_counter()
    for i, shape in enumerate(shapes):
        plan = _plan(shape, ids, max_model_len, max_num_seqs, max_num_batched_tokens)
        reqs = [s.request for s in plan.scheduled]
        try:
            if not plan.scheduled or not all(kv.allocate(r, r.num_tokens) for r in reqs):
                continue
            result = runner.execute(plan, kv.group_tables)
        finally:
            for r in reqs:
                kv.free(r)
        if i > 0 or len(shapes) == 1:
            samples.append((StepWork.from_output(plan), result.seconds))
        if time.perf_counter() - started > time_limit_s:
            break
    logger.info("cost model profile: %d steps in %.2fs", len(samples), time.perf_counter() - started)
    return samples


def _plan(shape: Shape, ids: itertools.count, max_model_len: int, max_num_seqs: int,
          max_num_batched_tokens: int) -> SchedulerOutput:
    out = SchedulerOutput()
    tokens = 0
    for count, new, context in shape:
        new = min(new, max_num_batched_tokens - tokens, max_model_len - 1)
        context = max(0, min(context, max_model_len - 1 - new))
        for _ in range(count):
            if new <= 0 or len(out.scheduled) >= max_num_seqs:
                break
            # token values do not matter for timing; the context's KV is never read for its content
            req = Request(f"profile-{next(ids)}", [1] * (context + new), _GREEDY)
            req.num_computed_tokens = context
            out.scheduled.append(ScheduledRequest(req, new, context))
            tokens += new
    out.scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # the runner expects decodes first
    return out
