"""The KV block store, host tier and tier facade: real files in tmp_path, real processes for concurrency."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from deepinfer.config import EngineConfig, KVStoreConfig, parse_duration, parse_retention
from deepinfer.kvcache import (
    HostKVCache,
    KVBlockStore,
    KVLayout,
    RetentionPolicy,
    TieredKVStore,
)
from deepinfer.kvcache.hashing import extend_block_hashes, root_hash
from deepinfer.kvcache.space import LOCK_NAME, StoreSpace, iter_files

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout("float16", 4, 2, 1, 8)  # 256-byte blocks: enough to exercise every path, fast to write
MODEL = "test-model@1"
H = 3600.0


def chain(tokens: list[int], layout: KVLayout = LAYOUT, model: str = MODEL) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, layout.block_size, root_hash(model, layout.key))
    return hashes


def payload(h: bytes, layout: KVLayout = LAYOUT) -> bytes:
    """Derived from the hash alone, so any process can check what it reads."""
    return (h * (layout.block_nbytes // len(h) + 1))[:layout.block_nbytes]


def make_store(path: Path, clock=time.time, layout: KVLayout = LAYOUT, model: str = MODEL,
               max_bytes: int = 10**8, **kw) -> KVBlockStore:
    return KVBlockStore(path, model, layout, max_bytes, clock=clock, segment_blocks=4, **kw)


def segments(path: Path) -> list[Path]:
    return sorted(e.path for e in iter_files(path) if not e.tmp)


# children skip `deepinfer/__init__` (it imports torch): start-up in ~0.1 s instead of seconds
CHILD_PRELUDE = f"""
import json, sys, types
pkg = types.ModuleType("deepinfer"); pkg.__path__ = [{str(ROOT / "deepinfer")!r}]; sys.modules["deepinfer"] = pkg
from deepinfer.kvcache.hashing import extend_block_hashes, root_hash
from deepinfer.kvcache import KVBlockStore, KVLayout
LAYOUT = KVLayout("float16", 4, 2, 1, 8)
def chain(tokens):
    hs = []
    extend_block_hashes(hs, tokens, 4, root_hash({MODEL!r}, LAYOUT.key))
    return hs
def payload(h):
    return (h * (LAYOUT.block_nbytes // len(h) + 1))[:LAYOUT.block_nbytes]
"""


def spawn(body: str, *args: object) -> subprocess.Popen:
    code = CHILD_PRELUDE + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


# ---------------------------------------------------------------- store basics


def test_round_trip_restart_and_partial_reads(tmp_path):
    hs = chain(list(range(42)))  # 10 full blocks
    store = make_store(tmp_path)
    assert store.lookup(hs) == 0 and store.load(hs) == []
    assert store.put(hs, [payload(h) for h in hs], "agent") == 10
    assert store.lookup(hs) == 10
    assert [bytes(p) for p in store.load(hs)] == [payload(h) for h in hs]
    assert len(segments(tmp_path)) == 3  # groups of 4: 4 + 4 + 2 blocks
    assert all(len(p.name.split("-")[0]) == 32 for p in segments(tmp_path))  # hash hex only

    again = make_store(tmp_path)  # a restart: a new object on the same path
    assert again.lookup(hs) == 10
    assert again.lookup(hs, start=6) == 4
    assert [bytes(p) for p in again.load(hs, start=3, count=5)] == [payload(h) for h in hs[3:8]]
    assert again.put(hs, [payload(h) for h in hs]) == 0  # already there: nothing rewritten
    assert again.stats()["corrupt"] == 0


def test_growing_history_appends_and_branches_share(tmp_path):
    store = make_store(tmp_path)
    turn1 = list(range(22))  # 5 blocks
    turn2 = turn1 + list(range(100, 120))  # 10 blocks, extends turn 1
    h1, h2 = chain(turn1), chain(turn2)
    assert store.put(h1, [payload(h) for h in h1]) == 5
    assert store.put(h2, [payload(h) for h in h2]) == 5  # only the new blocks
    assert store.lookup(h2) == 10
    # another conversation shares 5 blocks, diverging inside a group someone else wrote: found by header probe
    other = chain(turn2[:20] + [7] * 12)
    assert store.lookup(other) == 5
    assert [bytes(p) for p in store.load(other)] == [payload(h) for h in h2[:5]]
    # blocks whose earlier positions are not stored still get stored (the host tier may hold the head)
    tail_only = chain(list(range(500, 532)))
    assert store.put(tail_only, [payload(h) for h in tail_only[5:]], start=5) == 3
    assert store.lookup(tail_only) == 0 and store.lookup(tail_only, 5) == 3


def test_group_listing_is_parsed_once_and_follows_other_writers_and_removals(tmp_path):
    from deepinfer.kvcache.space import group_dir

    reader, writer = make_store(tmp_path), make_store(tmp_path)
    base = list(range(4))  # one block all the conversations below share: one group directory
    # 3 blocks each: a group's partial segment, found through the listing (a full one is opened by name)
    convs = [chain(base + [100 + i] * 8) for i in range(12)]
    for h in convs[:10]:
        writer.put(h, [payload(x) for x in h])
    gdir = group_dir(tmp_path, convs[0][0])
    assert len(os.listdir(gdir)) >= 10
    old = time.time() - 10
    os.utime(gdir, (old, old))  # older than a timestamp tick: the listing may be kept
    assert reader.lookup(convs[3]) == 3
    first = reader._listing(gdir)
    assert reader._listing(gdir) is first  # unchanged directory: one stat, no listing parsed again
    # another store (process) writes into the group: the changed mtime makes the reader list it again
    writer.put(convs[10], [payload(x) for x in convs[10]])
    assert reader.lookup(convs[10]) == 3 and reader._listing(gdir) is not first
    assert [bytes(p) for p in reader.load(convs[10])] == [payload(x) for x in convs[10]]
    # ... and removes one: a miss now, never stale blocks
    for f in os.listdir(gdir):
        if f.startswith(convs[5][-1].hex()):
            os.unlink(gdir / f)
    assert reader.lookup(convs[5]) == 1  # the shared first block, from another conversation's segment
    assert reader.lookup(convs[11]) == 1


def test_header_length_formula_matches_encoding():
    from deepinfer.kvcache.format import SegmentHeader

    hdr = SegmentHeader(MODEL, LAYOUT.key, LAYOUT.dtype, "agent", 1.0, 2.0, 8, 256, [bytes(16)] * 5, [7] * 5)
    assert len(hdr.encode()) == hdr.header_len == SegmentHeader.length_for(5, MODEL, LAYOUT.key, "float16", "agent")
    assert SegmentHeader.decode(hdr.encode() + b"payload") == hdr


def test_put_validates_payload_size_and_count(tmp_path):
    store = make_store(tmp_path)
    hs = chain(list(range(8)))
    with pytest.raises(ValueError):
        store.put(hs, [b"short", b"short"])
    with pytest.raises(ValueError):
        store.put(hs[:1], [payload(h) for h in hs])


# ---------------------------------------------------------------- corruption


def _flip_payload(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 100)


def _garbage_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[40] ^= 0x01  # inside the fixed header: the header digest no longer matches
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "garbage_header", "other_model", "other_layout"])
def test_corrupt_or_mismatched_objects_are_misses_counted_and_removed(tmp_path, damage):
    hs = chain(list(range(16)))  # one full segment
    if damage == "other_model":
        make_store(tmp_path, model="another-model").put(hs, [payload(h) for h in hs])
    elif damage == "other_layout":
        other = KVLayout("float32", 4, 2, 1, 8)
        make_store(tmp_path, layout=other).put(hs, [payload(h, other) for h in hs])
    else:
        make_store(tmp_path).put(hs, [payload(h) for h in hs])
    (seg,) = segments(tmp_path)
    {"flip_payload": _flip_payload, "truncate": _truncate, "garbage_header": _garbage_header}.get(
        damage, lambda p: None)(seg)

    store = make_store(tmp_path)
    assert store.load(hs) == []
    assert store.stats()["corrupt"] == 1
    assert not seg.exists()
    assert store.lookup(hs) == 0 and store.stats()["corrupt"] == 1


def test_leftover_temp_file_is_never_loaded_and_gc_removes_it(tmp_path):
    hs = chain(list(range(16)))
    store = make_store(tmp_path)
    store.put(hs, [payload(h) for h in hs])
    (seg,) = segments(tmp_path)
    seg.unlink()
    # what a writer killed mid-write leaves behind: a partial temp file next to where the object would be
    tmp = seg.parent / f".{seg.name}.abc123.4000.tmp"
    tmp.write_bytes(b"DIKV" + b"\0" * 100)
    assert store.lookup(hs) == 0 and store.load(hs) == []
    assert store.gc()["tmp"] == 0  # young: it may be a write in flight
    old = time.time() - 2 * H
    os.utime(tmp, (old, old))
    assert store.gc()["tmp"] == 1 and not tmp.exists()


# ---------------------------------------------------------------- retention


def test_retention_ttl_expiry_and_gc(tmp_path):
    now = [1_000_000.0]
    store = make_store(tmp_path, clock=lambda: now[0])
    agent, chat = chain(list(range(16))), chain(list(range(50, 66)))
    store.put(agent, [payload(h) for h in agent], "agent")
    store.put(chat, [payload(h) for h in chat], "chat")
    unknown = chain(list(range(90, 94)))
    store.put(unknown, [payload(h) for h in unknown], "no-such-class")  # falls back to the default, chat
    assert store.scan()["by_class"].keys() == {"agent", "chat"}

    now[0] += 71 * H
    assert store.lookup(agent) == 4
    now[0] += 2 * H  # 73 h: agent expired, chat (7 d) not
    assert store.load(agent) == [] and store.stats()["expired"] == 1
    assert store.lookup(chat) == 4
    assert store.scan()["expired"] == 0  # the expired agent segment was removed when found

    now[0] += 6 * 86400
    assert store.scan()["expired"] == 2
    out = store.gc()
    assert out["expired"] == 2 and out["objects"] == 0
    assert store.load(chat) == []


def test_retention_spec_parsing_and_config():
    assert parse_duration("90s") == 90 and parse_duration("30m") == 1800 and parse_duration("1.5h") == 5400
    p = parse_retention("agent=72h, chat=7d,batch=90m", default_class="chat")
    assert p.ttls == {"agent": 72 * H, "chat": 7 * 86400, "batch": 5400}
    assert p.ttl("unknown") == 7 * 86400 and p.resolve(None) == "chat"
    for bad in ("agent=72x", "agent", "agent=0h"):
        with pytest.raises(ValueError):
            parse_retention(bad)
    with pytest.raises(ValueError):
        parse_retention("agent=1h", default_class="chat")
    with pytest.raises(ValueError):
        KVStoreConfig(kv_retention="chat=7days")
    with pytest.raises(ValueError):
        KVStoreConfig(kv_store_max_bytes="lots")
    cfg = EngineConfig.from_kwargs(kv_store="none", host_cache_memory="1GiB")
    assert cfg.kvstore.store_path() is None and cfg.kvstore.host_cache_memory == 2**30  # parsed once, here
    assert cfg.kvstore.retention == RetentionPolicy({"agent": 72 * H, "chat": 7 * 86400}, "chat")
    assert EngineConfig().kvstore.store_path() is None  # conftest: auto -> $DEEPINFER_KV_STORE=none


def test_auto_store_path_follows_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("DEEPINFER_KV_STORE", raising=False)
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    assert KVStoreConfig().store_path() == tmp_path / "cache" / "kvstore"
    monkeypatch.setenv("DEEPINFER_KV_STORE", str(tmp_path / "shared"))
    assert KVStoreConfig().store_path() == tmp_path / "shared"
    assert KVStoreConfig(kv_store=str(tmp_path / "x")).store_path() == tmp_path / "x"  # explicit wins


# ---------------------------------------------------------------- capacity


def test_capacity_evicts_least_recently_used(tmp_path):
    now = [1000.0]
    store = make_store(tmp_path, clock=lambda: now[0], max_bytes=6000)  # ~4 segments of 4 blocks
    chains = [chain([i] * 16) for i in range(8)]
    for i, hs in enumerate(chains):
        now[0] += 1
        store.put(hs, [payload(h) for h in hs])
        if i >= 2:
            now[0] += 1
            assert len(store.load(chains[0])) == 4  # kept in use: must survive
        assert sum(e.size for e in iter_files(tmp_path)) <= 6000
    assert store.lookup(chains[0]) == 4 and store.lookup(chains[-1]) == 4
    assert store.lookup(chains[1]) == 0  # least recently used: evicted
    assert store.stats()["evicted"] >= 4
    now[0] += 1
    big = chain(list(range(200)))  # more than the whole store: its head is kept, the rest dropped and counted
    written = store.put(big, [payload(h) for h in big])
    assert 0 < written < len(big) and store.lookup(big) == written
    assert store.stats()["dropped_capacity"] == 1


# ---------------------------------------------------------------- processes


CONCURRENT_CHILD = """
root, me, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = KVBlockStore(root, "test-model@1", LAYOUT, 10**8, segment_blocks=4)
shared = list(range(30))
bad = reads = 0
for r in range(rounds):
    hs = chain(shared + [1000 * me + r] * 10)
    store.put(hs, [payload(h) for h in hs])
    for other in range(2):
        for rr in range(r + 1):
            ohs = chain(shared + [1000 * other + rr] * 10)
            got = store.load(ohs)
            reads += len(got)
            bad += sum(bytes(p) != payload(h) for p, h in zip(got, ohs))
print(json.dumps({"bad": bad, "reads": reads, **store.stats()}))
"""


def test_two_processes_write_and_read_concurrently(tmp_path):
    rounds = 12
    procs = [spawn(CONCURRENT_CHILD, tmp_path, me, rounds) for me in range(2)]
    results = [result(p) for p in procs]
    for r in results:
        assert r["bad"] == 0 and r["corrupt"] == 0 and r["write_errors"] == 0 and r["reads"] > 0
    store = make_store(tmp_path)
    for me in range(2):
        for r in range(rounds):
            hs = chain(list(range(30)) + [1000 * me + r] * 10)
            assert [bytes(p) for p in store.load(hs)] == [payload(h) for h in hs]
    assert store.stats()["corrupt"] == 0


STORM_CHILD = """
import random
root, me, n, max_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
store = KVBlockStore(root, "test-model@1", LAYOUT, max_bytes, segment_blocks=4, fsync=False)
rng = random.Random(me)
bad = 0
for i in range(n):
    hs = chain([me, i] * 8)
    store.put(hs, [payload(h) for h in hs])
    old = chain([me, rng.randrange(i + 1)] * 8)
    bad += sum(bytes(p) != payload(h) for p, h in zip(store.load(old), old))
print(json.dumps({"bad": bad, **store.stats()}))
"""


def _locked_usage(root: Path) -> tuple[int, int | None]:
    """(bytes on disk: segments + in-flight writes, the usage counter) while no writer can reserve or evict."""
    fd = os.open(root / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        return sum(e.size for e in iter_files(root)), StoreSpace(root, 1)._read_counter(fd)
    finally:
        os.close(fd)


def test_capacity_bound_holds_continuously_under_a_write_storm(tmp_path):
    seg = 4 * LAYOUT.block_nbytes + 200
    max_bytes = 12 * seg
    make_store(tmp_path, max_bytes=max_bytes).put(chain([9] * 16), [payload(h) for h in chain([9] * 16)])
    procs = [spawn(STORM_CHILD, tmp_path, me, 40, max_bytes) for me in range(4)]
    peak = samples = 0
    while any(p.poll() is None for p in procs):
        peak = max(peak, _locked_usage(tmp_path)[0])
        samples += 1
        time.sleep(0.002)
    results = [result(p) for p in procs]
    assert samples > 0 and peak <= max_bytes
    on_disk, counter = _locked_usage(tmp_path)
    assert on_disk <= max_bytes and counter == on_disk  # the shared counter did not drift
    assert sum(r["evicted"] for r in results) > 0 and sum(r["writes"] for r in results) == 160
    assert all(r["bad"] == 0 and r["corrupt"] == 0 and r["write_errors"] == 0 for r in results)


def test_write_failure_store_path_not_a_directory(tmp_path):
    hs = chain(list(range(16)))
    store = make_store(tmp_path)
    store.put(hs[:2], [payload(h) for h in hs[:2]])
    objects = tmp_path / "objects"
    os.replace(objects, tmp_path / "moved")
    objects.write_bytes(b"not a directory")
    assert store.put(hs, [payload(h) for h in hs]) == 0  # dropped, not raised
    assert store.stats()["write_errors"] == 1
    assert store.load(hs) == [] and store.lookup(hs) == 0


FULL_DISK_CHILD = """
import resource
root = sys.argv[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (512, 512))  # any write past 512 bytes fails with EFBIG
store = KVBlockStore(root, "test-model@1", LAYOUT, 10**8, segment_blocks=4)
old, new = chain(list(range(64))), chain(list(range(100, 164)))  # 16 blocks: 4 segments each
written = store.put(new, [payload(h) for h in new])
got = store.load(old)
print(json.dumps({"written": written, "ok": [bytes(p) for p in got] == [payload(h) for h in old], **store.stats()}))
"""


def test_write_failure_full_disk_is_counted_and_reads_still_work(tmp_path):
    old = chain(list(range(64)))
    store = make_store(tmp_path)
    store.put(old, [payload(h) for h in old])
    r = result(spawn(FULL_DISK_CHILD, tmp_path))
    assert r["written"] == 0 and r["write_errors"] == 1 and r["ok"]  # the first failure ends the put
    assert store.scan()["tmp_files"] == 0 and store.scan()["objects"] == 4
    assert store.lookup(chain(list(range(100, 164)))) == 0


# ---------------------------------------------------------------- host tier and tiers


def test_host_tier_lru_bound():
    host = HostKVCache(max_bytes=1000)
    assert host.insert(b"a", b"x" * 400) == [] and host.insert(b"b", b"y" * 400) == []
    assert host.get(b"a") == b"x" * 400  # a is now most recent
    evicted = host.insert(b"c", memoryview(b"z" * 400))
    assert [h for h, _ in evicted] == [b"b"] and host.nbytes == 800 and len(host) == 2
    assert host.insert(b"huge", b"h" * 2000) == [(b"huge", b"h" * 2000)] and b"huge" not in host
    assert host.lookup([b"a", b"c", b"b"]) == 2 and host.lookup([b"a", b"c"], start=1) == 1
    assert host.get(b"b") is None
    s = host.stats()
    assert (s["entries"], s["bytes"], s["hits"], s["misses"], s["evictions"]) == (2, 800, 1, 1, 1)


def test_tier_lookup_chains_host_then_store_and_promotes(tmp_path):
    hs = chain(list(range(40)))  # 10 blocks
    bn = LAYOUT.block_nbytes
    store = make_store(tmp_path)
    store.put(hs, [payload(h) for h in hs])
    tiers = TieredKVStore(HostKVCache(max_bytes=6 * bn), store)
    for h in hs[:4]:
        tiers.host.insert(h, payload(h))
    assert tiers.lookup(hs) == (4, 6)
    assert tiers.lookup(hs, start=2) == (2, 6)
    got = tiers.load(hs)
    assert [bytes(p) for p in got] == [payload(h) for h in hs]
    # promoted store blocks filled host memory tail first: the chain's head stayed
    assert tiers.host.lookup(hs) == 6 and tiers.lookup(hs) == (6, 4)
    st = tiers.stats()
    assert st["loaded_host_blocks"] == 4 and st["loaded_store_blocks"] == 6
    assert st["host_hit_blocks"] == 4 + 2 + 6 and st["store_hit_blocks"] == 6 + 6 + 4


def test_tier_offload_write_through_and_spill_on_evict(tmp_path):
    bn = LAYOUT.block_nbytes
    hs = chain(list(range(40)))
    wt = TieredKVStore(HostKVCache(4 * bn), make_store(tmp_path / "wt"))
    wt.offload(hs, [payload(h) for h in hs], "agent")
    assert wt.store.lookup(hs) == 10 and wt.lookup(hs) == (4, 6)

    spill = TieredKVStore(HostKVCache(4 * bn), make_store(tmp_path / "spill"), write_through=False)
    spill.offload(hs[:8], [payload(h) for h in hs[:8]])
    # host memory kept the head (0..3); the evicted tail (4..7) was spilled as one segment
    assert spill.lookup(hs) == (4, 4) and spill.store.lookup(hs) == 0
    assert spill.stats()["spilled_blocks"] == 4 and len(segments(tmp_path / "spill")) == 1
    spill.offload(hs, [payload(h) for h in hs[8:]], start=8)  # evicts 2, 3 -> spilled
    assert spill.stats()["spilled_blocks"] == 6
    spill.flush()  # 0, 1, 8, 9: everything is in the store now
    assert spill.store.lookup(hs) == 10
    assert [bytes(p) for p in TieredKVStore(None, spill.store).load(hs)] == [payload(h) for h in hs]


def test_gather_scatter_block_through_store(tmp_path):
    from deepinfer.kvcache.blocks import gather_block, layout_of, scatter_block

    caches = [(torch.randn(5, 4, 2, 8).to(torch.bfloat16), torch.randn(5, 4, 2, 8).to(torch.bfloat16))
              for _ in range(3)]
    layout = layout_of(caches)
    assert layout.key == "bfloat16|bs4|L3|kvh2|hd8"
    hs = chain(list(range(8)), layout)
    store = KVBlockStore(tmp_path, MODEL, layout, 10**7)
    store.put(hs, [gather_block(caches, 1), gather_block(caches, 3)])
    target = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches]
    for block, p in zip((0, 2), store.load(hs), strict=True):
        scatter_block(target, block, p)
    for (k, v), (tk, tv) in zip(caches, target, strict=True):
        assert torch.equal(tk[0], k[1]) and torch.equal(tv[2], v[3]) and not tk[1].any()


# ---------------------------------------------------------------- CLI


def test_cli_cache_stats_gc_clear(tmp_path, capsys):
    from deepinfer.cli import build_parser, main

    hs = chain(list(range(40)))
    store = make_store(tmp_path)
    store.put(hs, [payload(h) for h in hs], "agent")
    _truncate(segments(tmp_path)[0])
    assert main(["cache", "stats", "--store", str(tmp_path), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert (st["objects"], st["corrupt"], list(st["by_class"])) == (2, 1, ["agent"])
    assert main(["cache", "gc", "--store", str(tmp_path), "--max-bytes", "1500", "--json"]) == 0
    gc = json.loads(capsys.readouterr().out)
    assert gc["corrupt"] == 1 and gc["evicted"] == 1 and gc["bytes"] <= 1500
    assert main(["cache", "clear", "--store", str(tmp_path)]) == 0
    assert "removed_objects: 1" in capsys.readouterr().out and segments(tmp_path) == []
    assert main(["cache", "stats", "--store", str(tmp_path / "missing")]) == 2
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in ("--host-cache-memory", "--kv-store", "--kv-store-max-bytes", "--kv-retention"):
        assert flag in help_text
