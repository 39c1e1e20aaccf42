"""Scheduler invariants with a real KV manager and no model: budgets, FIFO, preemption, no leaks."""

from __future__ import annotations

import random

from deepinfer.config import SchedulerConfig
from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.request import Request
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import Scheduler


def _make(num_blocks=16, block_size=4, max_seqs=8, budget=32, max_len=64) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, "m", "l")
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), kv, max_len)


def _run_step(s: Scheduler, rng: random.Random) -> list[Request]:
    out = s.schedule()
    assert out.num_tokens <= s.config.max_num_batched_tokens
    assert len(s.running) <= s.config.max_num_seqs
    # decodes come before multi-token chunks
    sizes = [x.num_new_tokens for x in out.scheduled]
    assert sizes == sorted(sizes, key=lambda n: n > 1)
    sampled = {x.request.request_id: rng.randrange(5, 100) for x in out.scheduled
               if x.start + x.num_new_tokens == x.request.num_tokens}
    for x in out.scheduled:  # every scheduled token has a slot in its request's block table
        assert len(s.kv.block_tables[x.request.request_id]) * s.kv.block_size >= x.start + x.num_new_tokens
    return s.update(out, sampled)


def _assert_no_leak(s: Scheduler) -> None:
    pool = s.kv.pool
    assert pool.num_free == pool.num_blocks
    assert all(c == 0 for c in pool.ref_counts)
    assert not s.kv.block_tables


def test_random_workload_preempts_and_finishes_everything_without_leaks():
    rng = random.Random(0)
    s = _make(num_blocks=12, budget=24, max_len=48)
    reqs = []
    for i in range(20):
        prompt = [rng.randrange(5, 100) for _ in range(rng.randrange(1, 30))]
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 15), ignore_eos=True))
        reqs.append(r)
        s.add(r)
    steps = 0
    while s.has_unfinished():
        _run_step(s, rng)
        steps += 1
        if steps == 7:  # abort one running and one waiting request midway
            if s.running:
                s.abort(s.running[-1].request_id)
            if s.waiting:
                s.abort(s.waiting[-1].request_id)
        assert steps < 2000, "no progress"
    assert s.num_preemptions > 0
    assert all(r.finished for r in reqs)
    for r in reqs:
        if r.finish_reason == "length":
            assert r.num_output_tokens == r.max_tokens or r.num_tokens >= 48
    _assert_no_leak(s)


def test_fifo_admission_and_max_num_seqs():
    s = _make(max_seqs=2, budget=100)
    for i in range(4):
        s.add(Request(f"r{i}", [1, 2, 3], SamplingParams()))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2", "r3"]


def test_chunked_prefill_respects_budget():
    s = _make(num_blocks=64, budget=10, max_len=200)
    r = Request("long", list(range(5, 40)), SamplingParams(max_tokens=1))
    s.add(r)
    chunks = []
    while not r.finished:
        out = s.schedule()
        chunks.append(out.num_tokens)
        s.update(out, {"long": 7} if r.num_computed_tokens + out.num_tokens == r.num_tokens else {})
    assert chunks == [10, 10, 10, 5]
    _assert_no_leak(s)


def test_abort_waiting_and_running_frees_blocks():
    s = _make()
    a, b = Request("a", [1] * 10, SamplingParams()), Request("b", [2] * 10, SamplingParams())
    s.add(a)
    s.schedule()
    s.add(b)
    assert s.abort("a").finish_reason == "abort"
    assert s.abort("b").finish_reason == "abort"
    assert s.abort("b") is None
    _assert_no_leak(s)
    assert not s.has_unfinished()
