"""Store hits read ahead of admission (`kv_prefetch.StorePrefetcher`) in a real engine on a real store.

Faults are injected into the store's reads (slow, stuck, failing, the object corrupted between the
lookup and the read); everything else runs for real. Every test checks greedy output against a run
without the store and that no device block leaks.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.kvcache.blocks import gather_block, scatter_block, scatter_blocks
from tests.kvcache.test_kv_tiers import BS, _flip_first_block, _llm, _prompt, _reference, _run, _segments
from tests.models.test_models_vs_hf import _assert_all_free


def _stored(model, store: Path, *prompts: list[int]) -> None:
    """Serve `prompts` once on `store`, so their blocks are on disk (closing flushes the writer)."""
    with _llm(model, store) as llm:
        for p in prompts:
            _run(llm, p)


def _fault_reads(llm, before=None) -> None:
    """Run `before()` at the start of every store read (`KVBlockStore.load`) of this engine."""
    store = llm.engine.core.tiers.store
    real = store.load

    def get(*args, **kwargs):
        before()
        return real(*args, **kwargs)

    store.load = get


def _drive(engine, until=None, timeout: float = 120.0) -> dict[str, list[float]]:
    """Step `engine` until it is idle (or `until()`); the times at which each request got a token."""
    times: dict[str, list[float]] = {}
    deadline = time.monotonic() + timeout
    while engine.has_unfinished() and not (until is not None and until()):
        assert time.monotonic() < deadline, "engine made no progress"
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
            got = times.setdefault(out.request_id, [])
            got.extend([time.monotonic()] * (n - len(got)))
    return times


def _add(engine, rid: str, prompt: list[int], max_tokens: int = 8) -> None:
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                       request_id=rid, prompt_token_ids=prompt)


@pytest.mark.parametrize("prefetch", [True, False])
def test_slow_store_read_does_not_stall_other_requests(prefetch, tiny_models, tmp_path):
    model, cached, other = tiny_models["llama"], _prompt(20, 200), _prompt(21, 20)
    _stored(model, tmp_path, cached)
    delay = 1.5
    with _llm(model, tmp_path, kv_store_prefetch=prefetch) as llm:
        engine = llm.engine
        _fault_reads(llm, lambda: time.sleep(delay))
        _add(engine, "other", other, max_tokens=40)
        times = _drive(engine, until=lambda: engine.core.scheduler.running and
                       engine.core.scheduler.running[0].num_output_tokens > 0)
        _add(engine, "cached", cached)
        added = time.monotonic()
        times.update(_drive(engine))
        o = [t for t in times["other"] if t >= added]
        worst_gap = max(b - a for a, b in zip([added, *o], o, strict=False))
        if prefetch:
            # decoding went on while the read slept; the cached request came after
            assert worst_gap < delay / 2
            assert times["cached"][0] - added >= delay
            assert engine.stats()["kv_prefetch_store_blocks"] == len(cached) // BS
        else:  # the synchronous load held the step that carried other's next token
            assert worst_gap >= delay
        _assert_all_free(llm)


@pytest.mark.parametrize("wait_ms", [0, 5000])
def test_a_read_done_within_the_wait_is_admitted_in_the_same_step(wait_ms, tiny_models, tmp_path):
    model, cached = tiny_models["llama"], _prompt(30, 120)
    _stored(model, tmp_path, cached)
    with _llm(model, tmp_path, kv_store_prefetch_wait_ms=wait_ms) as llm:
        engine = llm.engine
        _fault_reads(llm, lambda: time.sleep(0.3))  # longer than scheduling the step takes
        _add(engine, "r", cached)
        engine.step()
        running = [r.request_id for r in engine.core.scheduler.running]
        # waited for: the read finished well within 5 s, the request ran in that step; not waited for: next step
        assert running == (["r"] if wait_ms else [])
        times = _drive(engine)
        assert len(times["r"]) == 8 and engine.stats()["kv_prefetch_store_blocks"] == 7
        _assert_all_free(llm)


def test_output_identical_with_and_without_prefetch(tiny_models, tmp_path):
    model = tiny_models["qwen3"]
    full, shared, fresh = _prompt(22, 300), _prompt(22, 300)[:150] + _prompt(23, 60), _prompt(24, 90)
    _stored(model, tmp_path / "store", full)
    refs = [_reference(model, p) for p in (full, shared, fresh)]
    for prefetch in (True, False):
        store = tmp_path / f"copy-{prefetch}"  # each run writes what it computes: start both alike
        shutil.copytree(tmp_path / "store", store)
        with _llm(model, store, kv_store_prefetch=prefetch) as llm:
            outs = llm.generate([full, shared, fresh], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
            assert [o.outputs[0].token_ids for o in outs] == refs
            assert outs[0].num_cached_tokens_by_tier["store"] >= len(full) - BS
            assert outs[1].num_cached_tokens >= 144  # 150 shared tokens: 9 whole blocks
            assert outs[2].num_cached_tokens == 0
            assert llm.engine.stats()["kv_prefetch_requests"] == (2 if prefetch else 0)
            _assert_all_free(llm)


def test_abort_during_prefetch_frees_everything(tiny_models, tmp_path):
    model, cached = tiny_models["llama"], _prompt(25, 120)
    _stored(model, tmp_path, cached)
    gate, reading = threading.Event(), threading.Event()
    with _llm(model, tmp_path) as llm:
        engine = llm.engine
        _fault_reads(llm, lambda: (reading.set(), gate.wait(30)))
        _add(engine, "doomed", cached)
        engine.step()  # looks it up, starts the read, runs nothing
        assert reading.wait(10)
        core = engine.core
        assert [r.request_id for r in core.scheduler.waiting] == ["doomed"]
        assert engine.stats()["kv_prefetch_in_flight"] == 1
        engine.abort_request("doomed")
        stats = engine.stats()
        assert stats["kv_prefetch_in_flight"] == 0 and stats["kv_prefetch_staged_bytes"] == 0
        assert not engine.has_unfinished()
        _assert_all_free(llm)
        gate.set()  # the read finishes on its thread; its result has nobody to go to
        time.sleep(0.2)
        again = _run(llm, cached)  # same prompt, new request: prefetched and loaded normally
        assert again.num_cached_tokens_by_tier["store"] >= len(cached) - BS
        assert again.outputs[0].token_ids == _reference(model, cached)
        _assert_all_free(llm)


def test_stuck_store_read_times_out_to_a_recompute(tiny_models, tmp_path):
    model, cached = tiny_models["llama"], _prompt(26, 120)
    _stored(model, tmp_path, cached)
    gate = threading.Event()
    with _llm(model, tmp_path) as llm:
        llm.engine.core.tiers.prefetcher.timeout_s = 0.5
        _fault_reads(llm, lambda: gate.wait(30))
        out = _run(llm, cached)  # never hangs: after the timeout the request recomputes
        assert out.num_cached_tokens == 0
        assert out.outputs[0].token_ids == _reference(model, cached)
        assert llm.engine.stats()["kv_prefetch_timeouts"] == 1
        _assert_all_free(llm)
        gate.set()


def test_object_corrupted_during_prefetch_is_a_miss(tiny_models, tmp_path):
    model, short, long = tiny_models["qwen3"], _prompt(27, 70), _prompt(28, 300)
    _stored(model, tmp_path, short, long)
    segs = _segments(tmp_path)
    assert set(segs) == {(0, 4), (0, 16), (16, 3)}
    damaged: list[Path] = []

    def corrupt_after_lookup() -> None:  # the lookup read valid headers; the payload rots before the read
        for key in ((0, 4), (16, 3)):
            if segs[key] not in damaged:
                _flip_first_block(segs[key])
                damaged.append(segs[key])

    with _llm(model, tmp_path) as llm:
        _fault_reads(llm, corrupt_after_lookup)
        out_short, out_long = _run(llm, short), _run(llm, long)
        assert out_short.num_cached_tokens == 0
        assert out_long.num_cached_tokens_by_tier == {"device": 0, "host": 0, "store": 16 * BS}
        assert out_short.outputs[0].token_ids == _reference(model, short)
        assert out_long.outputs[0].token_ids == _reference(model, long)
        stats = llm.engine.stats()
        assert stats["kv_store_corrupt"] == 2 and stats["kv_prefetch_short_reads"] == 2
        _assert_all_free(llm)


def test_failing_store_read_is_a_miss(tiny_models, tmp_path):
    model, cached = tiny_models["llama"], _prompt(29, 100)
    _stored(model, tmp_path, cached)

    def fail() -> None:
        raise RuntimeError("injected store read failure")

    with _llm(model, tmp_path) as llm:
        _fault_reads(llm, fail)
        out = _run(llm, cached)
        assert out.num_cached_tokens == 0
        assert out.outputs[0].token_ids == _reference(model, cached)
        assert llm.engine.stats()["kv_prefetch_errors"] == 1
        _assert_all_free(llm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_scatter_matches_block_by_block(dtype):
    def caches():
        return [(torch.zeros(6, 4, 2, 8, dtype=dtype), torch.zeros(6, 4, 2, 8, dtype=dtype)) for _ in range(3)]

    src = [(torch.randn(6, 4, 2, 8).to(dtype), torch.randn(6, 4, 2, 8).to(dtype)) for _ in range(3)]
    payloads = [gather_block(src, 1), bytes(gather_block(src, 4).numpy()), memoryview(gather_block(src, 2).numpy())]
    one, many = caches(), caches()
    for block, payload in zip([5, 0, 3], payloads, strict=True):
        scatter_block(one, block, payload)
    scatter_blocks(many, [5, 0, 3], payloads)
    for (k1, v1), (k2, v2) in zip(one, many, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert torch.equal(many[2][1][5], src[2][1][1]) and not many[0][0][1].any()
    with pytest.raises(ValueError):
        scatter_blocks(many, [1], [payloads[0][:-2]])
