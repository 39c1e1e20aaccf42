"""The KV tiers wired into the engine: real store files in tmp_path, real processes, tiny float32 models.

Every run compares greedy output with the uncached run of the same prompt and checks that no device
block leaks; cached tokens are checked per tier (`RequestOutput.num_cached_tokens_by_tier`).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.request import Request
from deepinfer.kvcache.manager import KVCacheManager
from deepinfer.kvcache.space import iter_files, read_header, scan
from deepinfer.kvcache.writer import StoreWriter
from deepinfer.server.app import build_app
from tests.models.test_models_vs_hf import _assert_all_free
from tests.server_utils import inprocess_app

ROOT = Path(__file__).resolve().parents[2]
BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def _llm(path, store: Path | None, **kw) -> LLM:
    """An engine on `store`, writing every computed block (these tests are about what a single request
    leaves there; admission by reuse has its own tests)."""
    kw.setdefault("kv_cache_memory", "64MiB")
    if store:
        kw.setdefault("kv_store_admit", "always")
    return LLM(str(path), dtype="float32", profile_cost_model=False, kv_store=str(store) if store else "none", **kw)


def _run(llm: LLM, prompt: list[int], **kw):
    out = llm.generate([prompt], GREEDY, **kw)[0]
    assert sum(out.num_cached_tokens_by_tier.values()) == out.num_cached_tokens
    return out


def _reference(model, prompt: list[int]) -> list[int]:
    with _llm(model, None) as llm:
        return _run(llm, prompt).outputs[0].token_ids


CHILD = """
import json, resource, sys
model, store, prompt, fsize = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
from deepinfer import LLM, SamplingParams
llm = LLM(model, dtype="float32", kv_cache_memory="64MiB", profile_cost_model=False, kv_store=store,
          kv_store_admit="always")
if fsize:  # a full disk: any write past fsize bytes fails with EFBIG (Python ignores SIGXFSZ)
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
llm.engine.core.flush_kv_store()
s = llm.engine.stats()
llm.close()
print(json.dumps({"tokens": out.outputs[0].token_ids, "cached": out.num_cached_tokens_by_tier,
                  "written": s["kv_store_written_blocks"], "write_errors": s["kv_store_write_errors"]}))
"""


def _child(model, store: Path, prompt: list[int], fsize: int = 0) -> dict:
    """Serve `prompt` once in a fresh process on `store`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model), str(store), json.dumps(prompt), str(fsize)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- restart, processes, host tier


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_restart_on_the_same_store(arch, tiny_models, tmp_path):
    prompt = _prompt(1, 70)
    with _llm(tiny_models[arch], tmp_path) as llm:
        first = _run(llm, prompt)
        assert first.num_cached_tokens == 0
        _assert_all_free(llm)
    with _llm(tiny_models[arch], tmp_path) as llm:  # a new engine: nothing on the device
        again = _run(llm, prompt)
        assert again.num_cached_tokens_by_tier["store"] == again.num_cached_tokens >= len(prompt) - BS
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        # loaded blocks are device blocks like any other: the next request finds them there
        third = _run(llm, prompt)
        assert third.num_cached_tokens_by_tier["device"] == again.num_cached_tokens
        assert third.outputs[0].token_ids == first.outputs[0].token_ids
        _assert_all_free(llm)


def test_store_objects_are_fsynced_only_with_kv_store_fsync(tiny_models, tmp_path, monkeypatch):
    """Off by default (reads validate every object, so a torn one is a miss); --kv-store-fsync flushes each."""
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    for i, flag in enumerate((False, True)):
        synced.clear()
        with _llm(tiny_models["llama"], tmp_path / str(i), **({"kv_store_fsync": True} if flag else {})) as llm:
            _run(llm, _prompt(20, 70))
            assert llm.engine.core.flush_kv_store()
            writes = llm.engine.core.kv.tiers.store.counters["writes"]
        assert writes >= 1
        assert len(synced) == (writes if flag else 0)


@pytest.mark.slow  # ~20 s: two engine processes
def test_processes_share_one_store(tiny_models, tmp_path):
    model, p, q = tiny_models["llama"], _prompt(2, 70), _prompt(3, 50)
    with _llm(model, tmp_path) as llm:  # holds the store open while other processes use it
        other = _child(model, tmp_path, p)
        assert other["cached"] == {"device": 0, "host": 0, "store": 0} and other["written"] > 0
        out = _run(llm, p)  # computed by the other process, never by this one
        assert out.num_cached_tokens_by_tier["store"] >= len(p) - BS
        assert out.outputs[0].token_ids == other["tokens"]
        mine = _run(llm, q)
        assert llm.engine.core.flush_kv_store()
        later = _child(model, tmp_path, q)  # a separate process, after this one wrote q
        assert later["cached"]["store"] >= len(q) - BS and later["tokens"] == mine.outputs[0].token_ids
        _assert_all_free(llm)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_host_tier_serves_what_the_device_evicted(overlap, tiny_models):
    model = tiny_models["llama"]
    probe = _llm(model, None)
    per_block = probe.engine.core.runner.kv_bytes_per_block
    probe.close()
    a, b = _prompt(4, 70), _prompt(5, 70)
    # 6 device blocks: b's 5 blocks evict most of a's
    with _llm(model, None, kv_cache_memory=str(6 * per_block), host_cache_memory="1MiB",
              overlap_host_work=overlap) as llm:
        first = _run(llm, a)
        _run(llm, b)
        assert llm.engine.stats()["kv_host_blocks"] >= 3
        again = _run(llm, a)
        tiers = again.num_cached_tokens_by_tier
        assert tiers["host"] > 0 and tiers["store"] == 0 and again.num_cached_tokens >= len(a) - BS
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        _assert_all_free(llm)


# ---------------------------------------------------------------- damage, expiry, failures


def _segments(store: Path) -> dict[tuple[int, int], Path]:
    """Segment files by (chain position of the first block, block count)."""
    out = {}
    for e in iter_files(store):
        if not e.tmp:
            with open(e.path, "rb") as f:
                hdr = read_header(f)
            out[hdr.first_pos, hdr.nblocks] = e.path
    return out


def _flip_first_block(path: Path) -> None:
    data = bytearray(path.read_bytes())
    with open(path, "rb") as f:
        start = read_header(f).header_len
    data[start + 10] ^= 0xFF  # in the first block's payload: the header still reads as valid, the CRC does not
    path.write_bytes(bytes(data))


def test_reused_admission_stores_a_prefix_at_its_second_use(tiny_models, tmp_path):
    """--kv-store-admit reused (a unified server's default): a prompt seen once is not written; its blocks
    go to the store when a request hits them in the device cache, or computes them again after they were
    evicted, and from there a restarted engine loads them like any stored prefix."""
    model, prompt, again = tiny_models["llama"], _prompt(30, 70), _prompt(31, 70)
    full = (len(prompt) - 1) // BS  # blocks a lookup can use (the last token is always computed)
    # a small device cache (~170 blocks), which a few dozen other prompts evict
    with _llm(model, tmp_path, kv_store_admit="reused", kv_cache_memory="2MiB") as llm:
        stats = llm.engine.stats
        ref = _run(llm, prompt)
        assert llm.engine.core.flush_kv_store()
        assert stats()["kv_store_written_blocks"] == 0 and stats()["kv_store_declined_blocks"] >= full
        hit = _run(llm, prompt)  # a device hit: the second use
        assert hit.num_cached_tokens_by_tier["device"] >= full * BS
        assert llm.engine.core.flush_kv_store()
        assert stats()["kv_store_written_blocks"] >= full
        # computed again after eviction: fill the device cache with other prompts, then rerun `again`
        _run(llm, again)
        pool = llm.engine.core.kv.groups[0].pool
        for seed in range(100, 100 + pool.num_blocks // 4 + 2):
            _run(llm, _prompt(seed, 70))
        assert llm.engine.core.flush_kv_store()
        written = stats()["kv_store_written_blocks"]
        recomputed = _run(llm, again)
        assert recomputed.num_cached_tokens == 0  # evicted: computed again, its second use
        assert llm.engine.core.flush_kv_store()
        assert stats()["kv_store_written_blocks"] - written >= full
        _assert_all_free(llm)
    with _llm(model, tmp_path, kv_store_admit="reused") as llm:  # a restart: both prompts load from the store
        for p, expect in ((prompt, ref), (again, recomputed)):
            out = _run(llm, p)
            assert out.num_cached_tokens_by_tier["store"] >= full * BS
            assert out.outputs[0].token_ids == expect.outputs[0].token_ids
        _assert_all_free(llm)


def test_reused_admission_writes_agent_traffic_at_once(tiny_models, tmp_path):
    model, prompt = tiny_models["llama"], _prompt(32, 70)
    with _llm(model, tmp_path, kv_store_admit="reused") as llm:
        _run(llm, prompt, retention_class="agent")  # --kv-store-admit-always-classes: agent by default
        assert llm.engine.core.flush_kv_store()
        assert llm.engine.stats()["kv_store_written_blocks"] >= (len(prompt) - 1) // BS
        assert llm.engine.stats()["kv_store_declined_blocks"] == 0
    with _llm(model, tmp_path, kv_store_admit="reused", kv_store_admit_always_classes="") as llm:
        _run(llm, _prompt(33, 70), retention_class="agent")
        assert llm.engine.core.flush_kv_store()
        assert llm.engine.stats()["kv_store_written_blocks"] == 0


def test_consecutive_runs():
    from deepinfer.kvcache.manager import consecutive_runs

    assert consecutive_runs([]) == []
    assert consecutive_runs([4]) == [(4, 1)]
    assert consecutive_runs([1, 2, 3, 7, 8, 10]) == [(1, 3), (7, 2), (10, 1)]


def test_store_admission_by_role():
    from deepinfer.config import KVStoreConfig

    auto = KVStoreConfig()
    assert auto.admission() == "reused"  # a unified server
    assert auto.admission("prefill") == auto.admission("decode") == "always"  # workers behind a router
    assert KVStoreConfig(kv_store_admit="always").admission() == "always"
    assert KVStoreConfig(kv_store_admit="reused").admission("prefill") == "reused"
    assert auto.always_classes() == {"agent"}
    assert KVStoreConfig(kv_store_admit_always_classes=" agent, batch ,").always_classes() == {"agent", "batch"}
    with pytest.raises(ValueError, match="kv_store_admit"):
        KVStoreConfig(kv_store_admit="sometimes")


def test_corrupt_store_file_is_a_miss_and_output_stays_right(tiny_models, tmp_path):
    model, short, long = tiny_models["qwen3"], _prompt(6, 70), _prompt(7, 300)
    with _llm(model, tmp_path) as llm:
        ref_short, ref_long = _run(llm, short), _run(llm, long)
    segs = _segments(tmp_path)
    # short: blocks 0-3 in one segment; long: 0-15 (written once computed), 16-18 (written when it finished)
    assert set(segs) == {(0, 4), (0, 16), (16, 3)}
    _flip_first_block(segs[0, 4])
    _flip_first_block(segs[16, 3])
    with _llm(model, tmp_path) as llm:
        out_short, out_long = _run(llm, short), _run(llm, long)
        assert out_short.num_cached_tokens == 0  # found by the lookup (headers), refused by the load (CRC)
        # the first segment loads, the second does not: its blocks are recomputed in the same request
        assert out_long.num_cached_tokens_by_tier == {"device": 0, "host": 0, "store": 16 * BS}
        assert out_short.outputs[0].token_ids == ref_short.outputs[0].token_ids
        assert out_long.outputs[0].token_ids == ref_long.outputs[0].token_ids
        assert llm.engine.stats()["kv_store_corrupt"] == 2
        _assert_all_free(llm)


def test_expired_entries_are_not_used_and_retention_is_per_request(tiny_models, tmp_path):
    model, brief, kept = tiny_models["llama"], _prompt(8, 70), _prompt(9, 70)
    classes = "agent=72h,chat=7d,brief=1s"
    with _llm(model, tmp_path, kv_retention=classes) as llm:
        with pytest.raises(ValueError, match="retention class"):
            llm.generate([brief], GREEDY, retention_class="forever")
        ref_brief = _run(llm, brief, retention_class="brief")
        ref_kept = _run(llm, kept, retention_class="agent")
    written = time.time()
    assert set(scan(tmp_path)["by_class"]) == {"brief", "agent"}
    time.sleep(max(0.0, written + 1.5 - time.time()))
    with _llm(model, tmp_path, kv_retention=classes) as llm:
        out_brief, out_kept = _run(llm, brief), _run(llm, kept)
        assert out_brief.num_cached_tokens == 0 and llm.engine.stats()["kv_store_expired"] >= 1
        assert out_kept.num_cached_tokens_by_tier["store"] >= len(kept) - BS
        assert out_brief.outputs[0].token_ids == ref_brief.outputs[0].token_ids
        assert out_kept.outputs[0].token_ids == ref_kept.outputs[0].token_ids
        _assert_all_free(llm)


def test_failing_store_degrades_to_no_caching(tiny_models, tmp_path):
    model, prompt = tiny_models["llama"], _prompt(10, 70)
    (tmp_path / "objects").write_bytes(b"not a directory")  # every write and read of a segment fails
    outs = []
    for _ in range(2):
        with _llm(model, tmp_path) as llm:
            outs.append(_run(llm, prompt))
            assert llm.engine.core.flush_kv_store()
            assert llm.engine.stats()["kv_store_write_errors"] >= 1
            _assert_all_free(llm)
    assert outs[1].num_cached_tokens == 0
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_full_disk_degrades_to_no_caching(tiny_models, tmp_path):
    model, prompt = tiny_models["llama"], _prompt(11, 70)
    full = _child(model, tmp_path, prompt, fsize=512)
    assert full["written"] == 0 and full["write_errors"] >= 1
    assert full["tokens"] == _reference(model, prompt)
    assert scan(tmp_path)["objects"] == 0 and scan(tmp_path)["tmp_files"] == 0


# ---------------------------------------------------------------- write batching, the background writer


class _RecordingTiers:
    """Stands in for KVTiers: no host tier, a store in groups of 4 blocks, writes recorded."""

    host = None
    prefetcher = None
    group_blocks = 4

    def __init__(self) -> None:
        self.writer = object()
        self.writes: list[tuple[int, list[int], str | None]] = []

    def lookup(self, hashes, start):
        return 0, 0

    def write(self, hashes, tables, start, count, retention_class):
        assert len(hashes) >= start + count  # the chain reaches the run (KVTiers cuts it)
        self.writes.append((start, list(tables[0][start:start + count]), retention_class))


def test_store_writes_cut_at_segment_boundaries_and_only_what_a_request_computed():
    kv = KVCacheManager(num_blocks=16, block_size=4, model_identity="m", kv_layout="l")
    tiers = _RecordingTiers()
    kv.attach_tiers(tiers)
    a = Request("a", list(range(30)), GREEDY, retention_class="agent")
    assert kv.allocate(a, 30)
    table = kv.block_tables["a"]
    a.num_computed_tokens = 10
    kv.register_computed(a)  # 2 full blocks: short of the first group's end
    assert tiers.writes == []
    a.num_computed_tokens = 22
    kv.register_computed(a)  # 5 full blocks: the first group goes now, as one segment
    assert tiers.writes == [(0, table[0:4], "agent")]
    a.num_computed_tokens = 30
    kv.register_computed(a)
    kv.free(a)  # the rest when the request leaves the device
    assert tiers.writes[1:] == [(4, table[4:7], "agent")]
    # b shares a's first 2 blocks on the device: only the blocks b computed first are written
    b = Request("b", list(range(8)) + [99] * 10, GREEDY)
    hit = kv.lookup_prefix(b)
    assert len(hit.blocks) == 2 and hit.num_load == 0
    assert kv.allocate(b, 10, hit)
    b.num_computed_tokens = 18
    kv.register_computed(b)
    assert tiers.writes[2:] == [(2, kv.block_tables["b"][2:4], None)]
    kv.free(b)
    assert kv.pool.num_free == kv.pool.num_blocks


def test_store_writer_drops_when_full_and_flushes_in_order():
    gate, calls = threading.Event(), []

    def put(hashes, payloads, cls, start):
        gate.wait(10)
        calls.append((start, len(payloads), cls))
        return len(payloads)

    w = StoreWriter(put, max_pending_bytes=300)
    assert w.submit([b"a"], [b"x" * 100], "chat", 0)
    assert w.submit([b"a", b"b"], [b"y" * 100], None, 1)
    assert w.submit([b"a", b"b", b"c"], [b"z" * 100], "agent", 2)
    assert not w.submit([b"d"], [b"w"], None, 3)  # over the byte bound: dropped, not blocking
    assert not w.flush(timeout=0.05)
    gate.set()
    assert w.flush(timeout=5)
    assert calls == [(0, 1, "chat"), (1, 1, None), (2, 1, "agent")]
    assert w.stats() == {"submitted_blocks": 3, "dropped_blocks": 1, "written_blocks": 3, "failed_puts": 0,
                         "pending_bytes": 0}
    w.close()
    assert not w.submit([b"e"], [b"v"], None, 0)


# ---------------------------------------------------------------- the HTTP API


@contextmanager
def _server(model, store: Path):
    engine = AsyncEngine(EngineConfig.from_kwargs(
        model=str(model), dtype="float32", kv_cache_memory="16MiB", max_model_len=512, profile_cost_model=False,
        kv_store=str(store), kv_store_admit="always", kv_retention="agent=72h,chat=7d,batch=1h"))
    try:
        with inprocess_app(build_app(engine, "tiny")) as base:
            yield base
    finally:
        engine.shutdown()  # waits for queued store writes


def _tier_metric(base: str, tier: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("deepinfer:prefix_cache_hits_by_tier_total{") and f'tier="{tier}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(tier)


def test_api_retention_choice_and_cached_tokens_across_restart(tiny_models, tmp_path):
    p, q = _prompt(12, 70), _prompt(13, 40)
    body = {"model": "tiny", "prompt": p, "max_tokens": 4, "temperature": 0}
    with _server(tiny_models["llama"], tmp_path) as base:
        url = f"{base}/v1/completions"
        bad = httpx.post(url, json={**body, "prompt_cache_retention": "forever"}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_cache_retention"
        assert bad.json()["error"]["type"] == "invalid_request_error" and "forever" in bad.json()["error"]["message"]
        bad = httpx.post(url, json=body, headers={"x-cache-retention": "forever"}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-cache-retention"
        first = httpx.post(url, json={**body, "prompt_cache_retention": "agent"}, timeout=60).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        chat = httpx.post(f"{base}/v1/chat/completions", headers={"x-cache-retention": "batch"}, timeout=60,
                          json={"model": "tiny", "messages": [{"role": "user", "content": "hi " * 40}],
                                "max_tokens": 2})
        assert chat.status_code == 200
        httpx.post(url, json={**body, "prompt": q}, timeout=60).raise_for_status()  # the default class: chat
    assert set(scan(tmp_path)["by_class"]) == {"agent", "batch", "chat"}
    with _server(tiny_models["llama"], tmp_path) as base:
        again = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= len(p) - BS and again["usage"]["prompt_cache_hit_tokens"] == cached
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert _tier_metric(base, "store") == cached and _tier_metric(base, "device") == 0


def test_openai_retention_values_map_to_classes():
    from deepinfer.config import parse_retention
    from deepinfer.kvcache.engine_tiers import resolve_retention

    policy = parse_retention("agent=72h,chat=7d,batch=1h", default_class="batch")
    assert resolve_retention(policy, None) == "batch"
    assert resolve_retention(policy, "in-memory") == "batch"
    assert resolve_retention(policy, "24h") == "chat"  # the default keeps entries 1 h: the longest class instead
    assert resolve_retention(parse_retention("agent=72h,chat=7d"), "24h") == "chat"
    assert resolve_retention(policy, "agent") == "agent"
    with pytest.raises(ValueError, match="unknown cache retention class"):
        resolve_retention(policy, "forever")
