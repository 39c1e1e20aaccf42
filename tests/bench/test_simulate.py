"""`deepinfer bench simulate`: the discrete-event model on small traces whose answers are known by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from deepinfer.bench.simulate import (
    DEFAULT_TRACE,
    TRACE_ENV,
    BlockStore,
    SimConfig,
    TraceRequest,
    decode_step_seconds,
    ideal_hit_rate,
    load_coefficients,
    load_trace,
    resolve_trace,
    run,
    simulate,
)
from deepinfer.cli import main
from deepinfer.engine.cost_model import CostModel, StepWork

MODEL = CostModel()


def req(at: float, n_in: int, n_out: int, ids: tuple[int, ...] = ()) -> TraceRequest:
    return TraceRequest(at, n_in, n_out, ids)


def cfg(**kw) -> SimConfig:
    return SimConfig(**{"prefill_workers": 1, "decode_workers": 1, "load_seconds_per_token": 0.0, **kw})


def test_one_worker_ttft_is_the_sum_of_queued_prefills():
    reqs = [req(0.0, 1000, 1), req(0.0, 3000, 1), req(0.0, 500, 1)]
    res = simulate(reqs, "round_robin", cfg(), MODEL)
    times = [MODEL.prefill_seconds(r.input_length, 0, 2048) for r in reqs]
    np.testing.assert_allclose(res.ttft, np.cumsum(times))
    assert res.prefill_busy == pytest.approx([sum(times)])


def test_later_arrival_waits_only_for_the_remaining_work():
    first = MODEL.prefill_seconds(4000, 0, 2048)
    reqs = [req(0.0, 4000, 1), req(first / 2, 100, 1)]
    res = simulate(reqs, "deepinfer", cfg(), MODEL)
    np.testing.assert_allclose(res.ttft, [first, first / 2 + MODEL.prefill_seconds(100, 0, 2048)])


def test_hit_rate_of_repeated_hash_ids():
    # 2 blocks of 512; the second request shares the first block, the third both (and is only 700 tokens long)
    reqs = [req(0.0, 1024, 1, (1, 2)), req(100.0, 1024, 1, (1, 3)), req(200.0, 700, 1, (1, 2))]
    expected = (0 + 512 + 700) / (1024 + 1024 + 700)
    assert ideal_hit_rate(reqs) == pytest.approx(expected)
    res = simulate(reqs, "round_robin", cfg(prefill_workers=2), MODEL)
    assert res.hit_rate == pytest.approx(expected)  # arrivals far apart: every earlier prefill has finished


def test_concurrent_requests_miss_what_is_still_being_prefilled():
    reqs = [req(0.0, 1024, 1, (1, 2)), req(0.0, 1024, 1, (1, 2))]
    assert ideal_hit_rate(reqs) == pytest.approx(0.5)
    # two workers start both at once: nothing is in the store yet
    assert simulate(reqs, "round_robin", cfg(prefill_workers=2), MODEL).hit_rate == 0.0
    # one worker: the second starts after the first wrote its blocks, and its prefill is cheaper
    one = simulate(reqs, "round_robin", cfg(), MODEL)
    assert one.hit_rate == pytest.approx(0.5)
    np.testing.assert_allclose(np.diff(one.ttft), MODEL.prefill_seconds(1024, 1024, 2048))


def test_deepinfer_queues_a_request_behind_its_prefix_in_prefill():
    """Two workers; the second request shares the first one's blocks and arrives while the first is being
    prefilled: deepinfer queues it behind the first (same finish, half the compute) where the others
    start it on the idle worker and recompute the shared block."""
    first = MODEL.prefill_seconds(1024, 0, 2048)
    reqs = [req(0.0, 1024, 1, (1, 2)), req(0.01 * first, 1030, 1, (1, 2, 3))]
    di = simulate(reqs, "deepinfer", cfg(prefill_workers=2), MODEL)
    assert di.hit_rate == pytest.approx(1024 / 2054)
    assert di.ttft[1] == pytest.approx(first - 0.01 * first + MODEL.prefill_seconds(1030, 1024, 2048))
    assert sorted(di.prefill_busy)[0] == 0.0  # the second worker stayed free
    assert simulate(reqs, "least_requests", cfg(prefill_workers=2), MODEL).hit_rate == 0.0


def test_store_lru_and_prefix_only():
    store = BlockStore(capacity_blocks=2)
    store.write([1, 2])
    assert store.cached_blocks([1, 2, 3]) == 2
    assert store.cached_blocks([2, 1]) == 2
    assert store.cached_blocks([3, 1]) == 0  # a prefix cache: a miss ends the match
    store.cached_blocks([1], touch=True)  # 1 becomes most recent
    store.write([5])  # evicts 2
    assert store.cached_blocks([1]) == 1 and store.cached_blocks([2]) == 0


def test_round_robin_alternates_workers():
    # far apart: each prefill ends before the next arrives, so only the policy decides the worker
    sizes = [1000, 100, 2000, 200, 3000, 300]
    reqs = [req(100.0 * i, n, 1) for i, n in enumerate(sizes)]
    c = cfg(prefill_workers=2)
    busy = [sum(MODEL.prefill_seconds(n, 0, 2048) for n in sizes[k::2]) for k in (0, 1)]
    assert simulate(reqs, "round_robin", c, MODEL).prefill_busy == pytest.approx(busy)
    # least_requests sees two idle workers each time and takes the first
    assert simulate(reqs, "least_requests", c, MODEL).prefill_busy[1] == 0.0


def test_decode_picks_count_requests_still_in_prefill():
    # two requests arrive together, the second's prefill ends first. Picked at arrival, the second pick
    # sees the first request's reservation (as the router counts it) and takes the other worker; picked
    # after prefill, the first sees the second one decoding. Either way both decode workers get work.
    reqs = [req(0.0, 4000, 50), req(0.0, 100, 500)]  # the second still decodes when the first is ready
    for pick in ("arrival", "prefill_done"):
        res = simulate(reqs, "deepinfer", cfg(prefill_workers=2, decode_workers=2, decode_pick=pick), MODEL)
        assert min(res.decode_request_seconds) > 0.0, pick


def test_decode_step_matches_the_cost_model():
    work = StepWork(((1, 99), (1, 499), (1, 9)))
    assert decode_step_seconds(MODEL.coef, 3, 100 + 500 + 10) == pytest.approx(MODEL.predict(work))


def test_decode_time_of_a_lone_request():
    res = simulate([req(0.0, 100, 4)], "round_robin", cfg(), MODEL)
    steps = sum(decode_step_seconds(MODEL.coef, 1, 100 + g) for g in (1, 2, 3))
    assert res.tpot == pytest.approx([steps / 3])


def test_deepinfer_beats_round_robin_on_a_skewed_trace():
    # every 4th prompt is huge; round robin piles them all on worker 0 of 4
    reqs = [req(i * 0.5, 30_000 if i % 4 == 0 else 500, 8) for i in range(80)]
    c = cfg(prefill_workers=4, decode_workers=2)
    rr = simulate(reqs, "round_robin", c, MODEL).row()
    di = simulate(reqs, "deepinfer", c, MODEL).row()
    assert di["ttft_p99"] < 0.7 * rr["ttft_p99"]
    assert di["prefill_imbalance"] < rr["prefill_imbalance"]


def test_deterministic(tmp_path):
    reqs = [req(i * 0.3, 200 + 97 * (i % 7), 1 + i % 5, tuple(range(i % 3))) for i in range(60)]
    c = cfg(prefill_workers=3, decode_workers=2)
    a, b = simulate(reqs, "least_requests", c, MODEL), simulate(reqs, "least_requests", c, MODEL)
    assert a.row() == b.row()
    np.testing.assert_array_equal(a.ttft, b.ttft)


def test_bad_trace_and_config(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 0, "output_length": 1}\n')
    with pytest.raises(ValueError, match="input_length"):
        load_trace(bad)
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="not a trace record"):
        load_trace(bad)
    with pytest.raises(ValueError, match="unknown routing policy"):
        SimConfig(policies=("fastest",))
    with pytest.raises(ValueError, match="time_scale"):
        SimConfig(time_scale=0.0)
    with pytest.raises(ValueError, match="store_capacity_blocks"):
        SimConfig(store_capacity_blocks=-1)
    assert main(["bench", "simulate", "--trace", str(bad), "--max-requests", "0"]) == 2
    coef = tmp_path / "c.json"
    coef.write_text(json.dumps({"overhead": 0.01, "token": 1e-4}))
    with pytest.raises(ValueError, match="lack"):
        load_coefficients(str(coef))
    coef.write_text(json.dumps([0.01, 1e-4, 1e-4, 1e-8, 1e-6]))
    assert load_coefficients(str(coef)) == (0.01, 1e-4, 1e-4, 1e-8, 1e-6)
    assert main(["bench", "simulate", "--trace", str(tmp_path / "missing.jsonl")]) == 2


def test_trace_path_flag_then_env_then_default(tmp_path, monkeypatch):
    monkeypatch.delenv(TRACE_ENV, raising=False)
    assert resolve_trace(None) == DEFAULT_TRACE and not DEFAULT_TRACE.is_absolute()
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [7, 8]}\n')
    monkeypatch.setenv(TRACE_ENV, str(mine))
    assert resolve_trace(None) == mine
    assert resolve_trace(str(tmp_path / "flag.jsonl")) == tmp_path / "flag.jsonl"  # the flag wins
    report, _ = run(SimConfig(policies=("round_robin",)))
    assert "trace mine.jsonl: 1 requests" in report
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "gone.jsonl"))
    with pytest.raises(FileNotFoundError, match="DEEPINFER_TRACE"):
        run(SimConfig())


# the shared trace: $DEEPINFER_TRACE, else where the default points from the checkout's root
SHARED_TRACE = Path(__file__).resolve().parents[2] / resolve_trace(None)


@pytest.mark.skipif(not SHARED_TRACE.is_file(), reason="shared trace not present")
def test_shared_trace_loads_and_a_capped_run_completes(capsys):
    reqs = load_trace(SHARED_TRACE)
    assert len(reqs) == 12031
    assert 0.3 < ideal_hit_rate(reqs) < 0.45  # the trace README: about 37-40%
    report, results = run(SimConfig(trace=str(SHARED_TRACE), max_requests=300, prefill_workers=2,
                                    decode_workers=2))
    assert [r.policy for r in results] == ["round_robin", "least_requests", "deepinfer"]
    assert all(len(r.ttft) == 300 and np.isfinite(r.ttft).all() and (r.ttft > 0).all() for r in results)
    assert "| deepinfer |" in report
    assert main(["bench", "simulate", "--trace", str(SHARED_TRACE), "--max-requests", "50", "--prefill-workers", "2", "--decode-workers",
                 "2", "--policies", "deepinfer"]) == 0
    assert "| deepinfer |" in capsys.readouterr().out
