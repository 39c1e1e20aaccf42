"""Scheduler invariants with a real KV manager and no model: budgets, FIFO, preemption, no leaks; the
compute policy (time budget, shrinking chunks, buckets, aging) with a cost model of known coefficients;
and greedy output that does not depend on the policy, on a tiny model."""

from __future__ import annotations

import argparse
import random

import numpy as np
import pytest

from deepinfer.config import EngineConfig, SchedulerConfig, add_config_arguments, engine_config_from_args
from deepinfer.engine.cost_model import CostModel, StepWork, chunk_features
from deepinfer.engine.policies import ComputeBudgetPolicy, TokenBudgetPolicy
from deepinfer.engine.request import Request
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import Scheduler
from deepinfer.kvcache.manager import KVCacheManager


def _make(num_blocks=16, block_size=4, max_seqs=8, budget=32, max_len=64, scheduler="tokens") -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, "m", "l")
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, scheduler=scheduler),
                     kv, max_len)


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


@pytest.mark.parametrize("scheduler", ["tokens", "compute"])
def test_random_workload_preempts_and_finishes_everything_without_leaks(scheduler):
    rng = random.Random(0)
    s = _make(num_blocks=12, budget=24, max_len=48, scheduler=scheduler)
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


@pytest.mark.parametrize("scheduler", ["tokens", "compute"])
def test_image_runs_that_attend_both_ways_are_never_split_across_chunks(scheduler):
    """Under `whole_image_runs` (Gemma 3) no prefill chunk ends inside a run of image placeholders, whatever
    the decodes beside it leave of the step's tokens and however chunks would have fallen; everything finishes,
    with preemptions, and no block leaks. A run the step could not hold beside a full batch is refused."""
    import torch

    from deepinfer.multimodal.inputs import MultiModalInputs

    rng = random.Random(3)
    s = _make(num_blocks=24, budget=16, max_len=64, max_seqs=4, scheduler=scheduler)
    s.whole_image_runs = True
    reqs = []
    for i in range(16):
        before, after, per = rng.randrange(0, 12), rng.randrange(1, 10), rng.choice([4, 8, 12])
        tiles = rng.randrange(1, 3)
        positions, prompt = [], [rng.randrange(5, 100) for _ in range(before)]
        for _ in range(tiles):
            positions += range(len(prompt), len(prompt) + per)
            prompt += [1] * per + [rng.randrange(5, 100)]
        prompt += [rng.randrange(5, 100) for _ in range(after)]
        mm = MultiModalInputs(torch.zeros(tiles, 3, 4, 4), None, tuple(positions), per)
        s.check_image_runs(mm)
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 10), ignore_eos=True), multi_modal=mm)
        reqs.append(r)
        s.add(r)
    chunks = []
    schedule = s.schedule

    def recorded():
        out = schedule()
        chunks.extend((x.request.multi_modal, x.start, x.start + x.num_new_tokens) for x in out.scheduled
                      if x.start < x.request.num_prompt_tokens)
        return out

    s.schedule = recorded
    steps = 0
    while s.has_unfinished():
        _run_step(s, rng)
        steps += 1
        assert steps < 2000, "no progress"
    assert all(r.finished for r in reqs)
    assert all(mm.run_cut(start, end) is None for mm, start, end in chunks)
    assert any(end == first for mm, _, end in chunks for first, _ in mm.runs)  # some were cut back to a run
    assert s.num_preemptions > 0
    _assert_no_leak(s)
    with pytest.raises(ValueError, match="14 placeholder tokens must be prefilled in one step"):
        s.check_image_runs(MultiModalInputs(torch.zeros(1, 3, 4, 4), None, tuple(range(2, 16)), 14))


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


# ---------------------------------------------------------------------- compute policy

# seconds: per step, per token, per request, per prefill attention pair, per KV token a decode reads
COEFS = (0.01, 1e-4, 1e-4, 1e-7, 1e-6)
STEP_BUDGET = 0.05


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _compute(num_blocks=1024, block_size=16, max_seqs=64, budget_tokens=2048, max_len=8192, aging_s=1.0,
             clock=None) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, "m", "l")
    cm = CostModel(coefficients=COEFS)
    policy = ComputeBudgetPolicy(cm, STEP_BUDGET, min_chunk=block_size, aging_s=aging_s, clock=clock or FakeClock())
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget_tokens)
    return Scheduler(config, kv, max_len, policy, cm)


def _req(rid: str, n: int, max_tokens: int = 1, arrival: float = 0.0) -> Request:
    rng = random.Random(rid)  # distinct prompts: no prefix-cache hits between requests
    return Request(rid, [rng.randrange(5, 1000) for _ in range(n)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=arrival)


def _step(s: Scheduler):
    out = s.schedule()
    sampled = {x.request.request_id: 7 for x in out.scheduled if x.start + x.num_new_tokens == x.request.num_tokens}
    s.update(out, sampled)
    return out


def test_compute_policy_respects_time_budget_except_the_progress_chunk():
    rng = random.Random(3)
    s = _compute(num_blocks=160, max_seqs=48)
    for i in range(60):
        s.add(_req(f"r{i}", rng.choice([8, 40, 300, 1500]), max_tokens=rng.randrange(1, 40)))
    over = 0
    while s.has_unfinished():
        out = _step(s)
        assert out.num_tokens <= 2048 and len(s.running) <= 48
        if s.cost_model.predict(StepWork.from_output(out)) > STEP_BUDGET + 1e-12:
            over += 1  # only the minimum-progress chunk may overshoot: one prefill chunk of <= one block
            chunks = [x.num_new_tokens for x in out.scheduled if x.num_new_tokens > 1]
            assert len(chunks) <= 1 and all(n <= 16 for n in chunks)
    assert s.num_preemptions > 0  # blocks ran out on the way: preemption still works under this policy
    assert s.kv.pool.num_free == s.kv.pool.num_blocks


def test_chunks_shrink_as_a_long_prompt_attends_to_more_context():
    s = _compute()
    r = _req("long", 6000)
    s.add(r)
    sizes = []
    while r.num_computed_tokens < r.num_prompt_tokens:
        sizes.append(_step(s).num_tokens)
    body = sizes[:-1]  # the last chunk is whatever is left
    assert body == sorted(body, reverse=True) and body[-1] < body[0] / 3, sizes
    cm = s.cost_model
    start = 0
    for n in body:  # each chunk is the largest that fits
        assert cm.predict(StepWork(((n, start),))) <= STEP_BUDGET < cm.predict(StepWork(((n + 1, start),)))
        start += n


def test_decodes_over_budget_still_leave_a_minimum_prefill_chunk():
    s = _compute(num_blocks=8192)
    for i in range(40):  # 40 decodes at 2000 tokens of context: ~0.09 s predicted, about twice the budget
        s.add(_req(f"d{i}", 2000, max_tokens=1000))
    s.policy.time_budget_s = 10.0  # let them all in quickly
    while any(r.num_output_tokens == 0 for r in s.running) or s.waiting:
        _step(s)
    s.policy.time_budget_s = STEP_BUDGET
    assert s.cost_model.predict(StepWork(tuple((1, r.num_computed_tokens) for r in s.running))) > STEP_BUDGET
    s.add(_req("late", 100))
    out = _step(s)
    assert [x.num_new_tokens for x in out.scheduled if x.request.request_id == "late"] == [16]
    assert sum(x.num_new_tokens == 1 for x in out.scheduled) == 40


def test_short_prompts_behind_a_long_one_are_served_before_it_finishes():
    def first_tokens(scheduler: Scheduler) -> tuple[int, dict[str, int]]:
        long = _req("long", 3000)
        scheduler.add(long)
        done_at, first = None, {}
        for step in range(1, 200):
            if step == 2:  # the long prompt is already running when the short ones arrive
                for i in range(3):
                    scheduler.add(_req(f"s{i}", 30, arrival=0.1))
            _step(scheduler)
            for rid in ("s0", "s1", "s2"):
                if rid not in first and rid not in scheduler.requests and step >= 2:
                    first[rid] = step  # finished = got its one token
            if done_at is None and long.num_computed_tokens >= long.num_prompt_tokens:
                done_at = step
            if done_at and len(first) == 3:
                return done_at, first
        raise AssertionError("did not finish")

    long_done, short_first = first_tokens(_compute(aging_s=100))
    assert max(short_first.values()) < long_done  # admitted and answered while the long one prefills
    tokens = _make(num_blocks=1024, block_size=16, budget=512, max_len=8192, max_seqs=64)
    long_done_t, short_first_t = first_tokens(tokens)
    assert min(short_first_t.values()) >= long_done_t  # strict FIFO: they wait for the whole prefill


@pytest.mark.parametrize("long_first", [False, True])
def test_a_long_prompt_does_not_hold_the_first_token_of_a_short_one_in_its_step(long_first):
    """A short and a long prompt waiting together (in either arrival order): under the time budget alone
    both fit one step, and the short one's first token would wait for the long one's whole prefill. The
    short one goes first (a tiny prompt), and the long one takes a chunk that at most doubles the step
    and finishes in the next."""
    def first_steps(stretch: float) -> tuple[dict[str, int], float]:
        s = _compute()
        s.policy.time_budget_s = 0.5  # room for both in one step (the long one is not tiny: over 0.125 s)
        s.policy.first_token_stretch = stretch
        for r in ([_req("long", 1500), _req("short", 40)] if long_first else [_req("short", 40), _req("long", 1500)]):
            s.add(r)
        done: dict[str, int] = {}
        first_step_seconds = 0.0
        for step in range(1, 10):
            out = _step(s)
            if step == 1:
                first_step_seconds = s.cost_model.predict(StepWork.from_output(out))
            for x in out.scheduled:
                if x.start + x.num_new_tokens == x.request.num_prompt_tokens:
                    done.setdefault(x.request.request_id, step)
            if len(done) == 2:
                return done, first_step_seconds
        raise AssertionError("did not finish")

    alone = CostModel(coefficients=COEFS).predict(StepWork(((40, 0),)))
    done, seconds = first_steps(2.0)
    assert done == {"short": 1, "long": 2} and seconds <= 2 * alone + 1e-12
    # without the stretch, the batching rule alone keeps the long one out (1 x its 0.15+ s > one 0.01 s overhead)
    done, seconds = first_steps(float("inf"))
    assert done == {"short": 1, "long": 2} and seconds <= 2 * alone + 1e-12


@pytest.mark.parametrize("scheduler", ["tokens", "compute"])
def test_a_prompt_waits_for_its_prefix_being_computed_instead_of_computing_it_twice(scheduler):
    s = _compute() if scheduler == "compute" else _make(num_blocks=64, block_size=16, budget=2048, max_len=512)
    shared = _req("first", 64).prompt_token_ids
    first, twin, other = (Request("first", shared, SamplingParams(max_tokens=1, ignore_eos=True)),
                          Request("twin", shared + [9, 9], SamplingParams(max_tokens=1, ignore_eos=True)),
                          _req("other", 40))
    for r in (first, twin, other):
        s.add(r)
    out = _step(s)
    assert sorted((x.request.request_id, x.num_new_tokens) for x in out.scheduled) == [("first", 64), ("other", 40)]
    out = _step(s)  # first's 4 blocks are cached now: the twin computes only what it adds
    assert [(x.request.request_id, x.start, x.num_new_tokens) for x in out.scheduled] == [("twin", 64, 2)]
    _assert_no_leak(s)


def _prompts_joining(costs: list[float], o: float) -> int:
    """How many queued prompts (their predicted prefill seconds, in queue order) the first step answers under
    the batching rule: the k-th joins the p before it while p * c_k <= o * (prompts queued from it on)."""
    p = 0
    for k, c in enumerate(costs):
        if p and p * c > o * (len(costs) - k):
            break
        p += 1
    return p


@pytest.mark.parametrize("overhead", [0.01, 0.001, 1.0])
def test_prompts_that_arrived_together_batch_while_the_overhead_saved_outweighs_the_delay(overhead):
    """Eight similar prompts waiting together: the k-th joins a step that already completes p = k - 1 of them
    only while p * (its prefill time) <= (step overhead) * (prompts queued from it on); every prompt in a step
    is whole, and the rest go to the next steps. A cheap-overhead machine answers them in small groups, an
    expensive one (an accelerator, where a step costs its weight reads) in one step."""
    s = _compute()
    cm = s.cost_model
    cm.coef = np.array([overhead, *COEFS[1:]])
    s.policy.time_budget_s = 10.0
    reqs = [_req(f"r{i}", 120 + 10 * i) for i in range(8)]
    for r in reqs:
        s.add(r)
    expected = _prompts_joining([cm.predict_features(chunk_features(r.num_prompt_tokens, 0)) for r in reqs], overhead)
    out = _step(s)
    assert [x.request.request_id for x in out.scheduled] == [r.request_id for r in reqs[:expected]]
    assert all(x.start + x.num_new_tokens == x.request.num_prompt_tokens for x in out.scheduled)
    assert expected == {0.01: 4, 0.001: 1, 1.0: 8}[overhead]
    done = expected
    while done < len(reqs):  # the rest follow in later steps, none cut into a chunk
        out = _step(s)
        prefills = [x for x in out.scheduled if x.num_new_tokens > 1]
        assert prefills and all(x.start == 0 and x.num_new_tokens == x.request.num_prompt_tokens for x in prefills)
        done += len(prefills)
    assert all(r.finished for r in reqs)
    _assert_no_leak(s)


def test_aging_keeps_a_stream_of_short_prompts_from_starving_a_long_one():
    def run(aging_s: float) -> int | None:
        clock = FakeClock()
        s = _compute(aging_s=aging_s, clock=clock, max_seqs=256, num_blocks=4096)
        long = _req("long", 1500)
        s.add(long)
        for step in range(80):
            clock.now = step * STEP_BUDGET
            for i in range(12):  # more short work arrives every step than one step can serve
                s.add(_req(f"s{step}-{i}", 40, arrival=clock.now))
            _step(s)
            if long.num_computed_tokens >= long.num_prompt_tokens:
                return step
        return None

    assert run(aging_s=float("inf")) is None  # without aging, short prompts always go first: starved
    finished = run(aging_s=1.0)
    # aged after 1 s (20 steps); from then on it is served first and gets (nearly) whole steps
    assert finished is not None and finished < 40


def test_compute_order_preempted_then_aged_then_buckets_fifo():
    clock = FakeClock()
    s = _compute(clock=clock)
    policy = s.policy
    clock.now = 10.0
    reqs = [_req("long-old", 3000, arrival=9.5), _req("short-b", 20, arrival=9.8), _req("mid", 600, arrival=9.1),
            _req("short-a", 20, arrival=9.7), _req("aged-long", 3000, arrival=5.0), _req("pre", 3000, arrival=9.9)]
    reqs[-1].status = reqs[-1].status.PREEMPTED
    order = policy.prefill_order([], reqs, lambda r: 0)
    assert [r.request_id for r in order] == ["pre", "aged-long", "short-a", "short-b", "mid", "long-old"]
    assert [policy.bucket(n, 0) for n in (20, 100, 600, 3000)] == [0, 1, 2, 3]
    # a cached prefix makes a long prompt cheap to serve: it is bucketed by what is left to compute
    assert policy.bucket(3000, 2990) <= 1


def test_fifo_within_a_bucket_and_max_num_seqs_under_compute():
    s = _compute(max_seqs=2)
    for i in range(4):
        s.add(_req(f"r{i}", 3, arrival=float(i)))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2", "r3"]


def test_scheduler_flags():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, SchedulerConfig)
    args = parser.parse_args(["--scheduler", "tokens", "--step-time-budget-ms", "80", "--no-profile-cost-model"])
    config = engine_config_from_args(args).scheduler
    assert (config.scheduler, config.step_time_budget_ms, config.profile_cost_model) == ("tokens", 80.0, False)
    assert SchedulerConfig().scheduler == "compute"
    kv = KVCacheManager(8, 4, "m", "l")
    assert isinstance(Scheduler(config, kv, 32).policy, TokenBudgetPolicy)
    compute = Scheduler(SchedulerConfig(step_time_budget_ms=80), kv, 32)
    assert isinstance(compute.policy, ComputeBudgetPolicy) and compute.step_time_budget == pytest.approx(0.08)
    auto = Scheduler(SchedulerConfig(), kv, 32)  # one full fresh prefill step, at least 4 one-sequence decodes
    model = auto.cost_model
    full = model.predict(StepWork(((SchedulerConfig().max_num_batched_tokens, 0),)))
    assert auto.step_time_budget == pytest.approx(max(full, 4 * model.predict(StepWork(((1, 4),)))))
    small = Scheduler(SchedulerConfig(max_num_batched_tokens=1), kv, 32)
    assert small.step_time_budget == pytest.approx(4 * model.predict(StepWork(((1, 4),))))
    with pytest.raises(ValueError):
        EngineConfig.from_kwargs(step_time_budget_ms=0)


def test_greedy_output_identical_under_tokens_and_compute(tiny_models, hf_models):
    from deepinfer import LLM
    from tests.conftest import hf_greedy

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 5, 16, 17, 40, 73, 150, 260)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    path = str(tiny_models["qwen3"])
    tokens = LLM(path, dtype="float32", kv_cache_memory="64MiB", scheduler="tokens", max_num_batched_tokens=48,
                 profile_cost_model=False)
    # a tight time budget: chunk sizes vary from step to step with the measured profile
    compute = LLM(path, dtype="float32", kv_cache_memory="64MiB", scheduler="compute", step_time_budget_ms=2.0)
    got_t = [o.outputs[0].token_ids for o in tokens.generate(prompts, params)]
    got_c = [o.outputs[0].token_ids for o in compute.generate(prompts, params)]
    assert got_t == got_c
    for p, out in zip(prompts, got_c, strict=True):
        assert out == hf_greedy(hf_models["qwen3"], p, 10)


def test_a_pass_of_several_decode_steps_is_cut_to_the_time_budget():
    """`_pass_steps`: num_scheduler_steps where the profiled price of a step fits the budget that many times,
    fewer for dearer steps (more rows), at least one; all of them with the default (unprofiled) prices."""
    kv = KVCacheManager(64, 4, "m", "l")
    cfg = SchedulerConfig(max_num_seqs=8, num_scheduler_steps=8, multi_step_budget_ms=30.0)
    model = CostModel()
    s = Scheduler(cfg, kv, 256, cost_model=model)
    reqs = [Request(f"r{i}", list(range(20)), SamplingParams()) for i in range(8)]
    assert s._pass_steps(reqs[:1]) == 8  # unprofiled: the rough default prices (~30 ms a step) are no measure
    # a profile: 2 ms a step plus 0.6 ms a decode row, and a prefill rate
    model.calibrate([(StepWork(((1, 20),) * b), 0.002 + 0.0006 * b) for b in (1, 2, 4, 8) for _ in range(3)]
                    + [(StepWork(((64, 0),)), 0.002 + 0.0006 * 64)] * 3)
    assert model.profiled
    assert s._pass_steps(reqs[:1]) == 8  # 2.6 ms: 11 fit, capped at num_scheduler_steps
    assert s._pass_steps(reqs[:8]) == 4  # 6.8 ms: 4 fit in 30 ms
    tight = Scheduler(SchedulerConfig(max_num_seqs=8, num_scheduler_steps=8, multi_step_budget_ms=1.0), kv, 256,
                      cost_model=model)
    assert tight._pass_steps(reqs[:1]) == 1
    # a closed batch (the offline API): nobody can arrive and wait for the pass, so the budget does not cut it,
    # unless drafts may pay for its requests (a plain pass drafts nothing)
    tight.closed_batch = True
    assert tight._pass_steps(reqs[:8]) == 8
    assert tight._pass_steps(reqs[:8], drafts_may_pay=True) == 1


def test_decodes_running_beside_a_wave_of_prompts_make_it_batch_in_larger_groups():
    """The step's fixed part o that splitting a wave costs every queued prompt is the overhead plus the step's
    decodes (each step runs them before its prompts are answered): with 24 requests decoding, the waiting
    prompts join a step while p * c <= o * n with that o, where the overhead alone admits one a step."""
    def first_step_prompts(decoding: int) -> tuple[list[str], int]:
        s = _compute()
        s.cost_model.coef = np.array([0.001, *COEFS[1:]])
        s.policy.time_budget_s = 10.0
        running = [_req(f"d{i}", 40, max_tokens=50) for i in range(decoding)]
        for r in running:
            s.add(r)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in running):  # until all of them decode
            _step(s)
        wave = [_req(f"w{i}", 150) for i in range(8)]
        for r in wave:
            s.add(r)
        out = _step(s)
        decodes = [x for x in out.scheduled if x.num_new_tokens == 1]
        o = s.cost_model.predict(StepWork(tuple((1, x.start) for x in decodes)))
        expected = _prompts_joining([s.cost_model.predict_features(chunk_features(150, 0))] * len(wave), o)
        prompts = [x.request.request_id for x in out.scheduled if x.num_new_tokens > 1]
        assert len(decodes) == decoding
        return prompts, expected

    alone, expected_alone = first_step_prompts(0)
    assert alone == ["w0"] == [f"w{i}" for i in range(expected_alone)]
    beside, expected_beside = first_step_prompts(24)
    assert beside == [f"w{i}" for i in range(expected_beside)] and len(beside) >= 3
