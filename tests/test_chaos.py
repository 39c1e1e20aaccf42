"""The fault campaign of `benchmarks/chaos.py`, with a tiny model: real servers and clusters on 127.0.0.1, real
processes killed with SIGKILL, a real store on disk (corrupted, filled, slowed). Every request must end
either with output identical to a clean run or with a clear error; nothing hangs, no KV block stays in use.

The cluster cases start three to five processes each and are marked slow, as are three of the single-server
store cases (~20-26 s each, CI time); the engine kill runs in the default suite. Unit-level faults of the same
parts live next to them (tests/kvcache/test_kv_tiers.py, test_kv_prefetch.py, test_kvstore.py,
test_cluster*.py, test_server_faults.py); these add load and the whole path from HTTP to disk.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.chaos import Ctx, run_case


def _case(name: str, model: Path, tmp_path: Path):
    res = run_case(name, Ctx(str(model), tmp_path, concurrency=4, max_tokens=16, num_prompts=16))
    if res.skipped:
        pytest.skip(res.skipped)
    logs = {p.name: p.read_text()[-2000:] for p in tmp_path.glob("*.log")}
    assert res.passed, (res.failures, res.facts, dict(res.outcomes), logs)
    return res


@pytest.mark.slow  # ~15 s; test_server_faults.py kills the engine mid-stream in the default suite
def test_engine_killed_under_load(tiny_models, tmp_path):
    res = _case("engine_kill", tiny_models["llama"], tmp_path)
    assert res.outcomes["error"] + res.outcomes["error_stream"] > 0
    assert res.facts["health_503_after_s"] < 15


@pytest.mark.slow  # ~26 s
def test_corrupt_store_objects_are_recomputed(tiny_models, tmp_path):
    res = _case("store_corrupt", tiny_models["llama"], tmp_path)
    assert res.facts["corrupt_counted"] > 0
    assert set(res.outcomes) <= {"ok", "ok_stream"}


@pytest.mark.slow  # ~19 s
def test_full_store_disk_keeps_serving(tiny_models, tmp_path):
    res = _case("store_full", tiny_models["llama"], tmp_path)
    assert res.facts["write_errors"] + res.facts["capacity_dropped"] > 0


@pytest.mark.slow  # ~26 s
def test_engine_killed_while_writing_the_store_leaves_nothing_half_loaded(tiny_models, tmp_path):
    res = _case("engine_kill_store", tiny_models["llama"], tmp_path)
    assert res.facts["store_tier_tokens"] > 0


@pytest.mark.slow
def test_slow_store_reads(tiny_models, tmp_path):
    res = _case("store_slow", tiny_models["llama"], tmp_path)
    assert res.facts["store_tier_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_cluster_worker_killed_under_load(role, tiny_models, tmp_path):
    _case(f"{role}_kill", tiny_models["llama"], tmp_path)


@pytest.mark.slow
def test_decode_worker_killed_mid_kv_transfer(tiny_models, tmp_path):
    _case("decode_kill_transfer", tiny_models["llama"], tmp_path)


@pytest.mark.slow
def test_corrupt_bytes_on_the_kv_transfer_wire(tiny_models, tmp_path):
    res = _case("transfer_corrupt", tiny_models["llama"], tmp_path)
    assert res.facts["blocks_imported"] < res.facts["prompt_full_blocks"]
