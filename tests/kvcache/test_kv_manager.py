"""Block pool, block hashing and prefix-cache invariants (no model needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deepinfer.engine.request import Request
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.kvcache.hashing import extend_block_hashes, hash_block, root_hash
from deepinfer.kvcache.manager import KVCacheManager
from deepinfer.kvcache.pool import BlockPool, NoFreeBlocksError


def _req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), cache_salt=salt)


def test_pool_allocate_release_refcounts():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1 and all(pool.ref_counts[b] == 1 for b in a)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    pool.release(a)
    assert pool.num_free == 4 and pool.ref_counts == [0, 0, 0, 0]
    with pytest.raises(RuntimeError):
        pool.release([a[0]])


def test_lru_eviction_order_and_hash_drop():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.register(b, bytes([i]) * 16)
    pool.release([blocks[2], blocks[1], blocks[0]])  # tail first: block 2 is the least valuable
    assert pool.lookup(bytes([2]) * 16) == blocks[2]
    got = pool.allocate(1)
    assert got == [blocks[2]]  # least recently freed goes first
    assert pool.lookup(bytes([2]) * 16) is None and pool.num_evictions == 1
    assert pool.lookup(bytes([0]) * 16) == blocks[0]
    # a cache hit takes the block out of the free queue; releasing puts it back at the tail
    pool.acquire([blocks[0]])
    assert pool.num_free == 1 and pool.ref_counts[blocks[0]] == 1
    pool.release([blocks[0]])
    assert pool.allocate(1) == [blocks[1]]


def test_empty_blocks_reused_before_cached_ones():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.register(a, b"x" * 16)
    pool.release([a])
    pool.release([b])  # unhashed: goes to the head
    assert pool.allocate(1) == [b]
    assert pool.lookup(b"x" * 16) == a


def test_block_hash_is_chained_and_salted():
    root = root_hash("m", "fp32")
    tokens = list(range(40))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, 16, root)
    assert len(hashes) == 2  # 8 tokens of the third block are not a full block
    assert hashes[1] == hash_block(hash_block(root, tokens[:16]), tokens[16:32])
    other = []
    extend_block_hashes(other, [99] + tokens[1:], 16, root)
    assert other[0] != hashes[0] and other[1] != hashes[1]  # a change early changes every later name
    salted = []
    extend_block_hashes(salted, tokens, 16, root_hash("m", "fp32", "tenant-a"))
    assert salted[0] != hashes[0]
    assert root_hash("m", "bf16") != root


def test_block_hash_stable_across_processes():
    code = ("from deepinfer.kvcache.hashing import root_hash, hash_block;"
            "print(hash_block(root_hash('m', 'fp32', 's'), list(range(16))).hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout.strip() for seed in (1, 2)}
    assert outs == {hash_block(root_hash("m", "fp32", "s"), list(range(16))).hex()}


def test_prefix_lookup_refcount_and_free():
    kv = KVCacheManager(num_blocks=10, block_size=4, model_identity="m", kv_layout="l")
    a = _req("a", list(range(10)))
    assert kv.lookup_prefix(a).blocks == []
    assert kv.allocate(a, 10)
    a.num_computed_tokens = 10
    kv.register_computed(a)
    table_a = list(kv.block_tables["a"])
    b = _req("b", list(range(9)) + [77, 78])
    hit = kv.lookup_prefix(b)
    assert hit.blocks == table_a[:2]  # 2 full blocks shared (the 3rd differs at token 9)
    assert kv.allocate(b, 11 - 8, hit)
    assert kv.pool.ref_counts[table_a[0]] == 2
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_free == 10 and all(c == 0 for c in kv.pool.ref_counts)
    # the cached prefix survives its owners
    c = _req("c", list(range(10)))
    assert kv.lookup_prefix(c).blocks == table_a[:2]  # last token always recomputed: (10-1)//4 = 2 blocks


def test_cache_salt_isolates_tenants():
    kv = KVCacheManager(num_blocks=8, block_size=4, model_identity="m", kv_layout="l")
    a = _req("a", list(range(12)), salt="alice")
    kv.allocate(a, 12)
    a.num_computed_tokens = 12
    kv.register_computed(a)
    assert kv.lookup_prefix(_req("b", list(range(12)), salt="bob")).blocks == []
    assert len(kv.lookup_prefix(_req("c", list(range(12)), salt="alice")).blocks) == 2


def test_allocate_counts_reclaimed_cached_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=4, model_identity="m", kv_layout="l")
    a = _req("a", list(range(8)) + [1])
    kv.allocate(a, 9)
    a.num_computed_tokens = 9
    kv.register_computed(a)
    kv.free(a)  # 3 free blocks, 2 of them cached
    b = _req("b", list(range(8)) + [5, 6, 7, 8, 9])
    hit = kv.lookup_prefix(b)
    assert len(hit.blocks) == 2
    # needs 2 new blocks (13 tokens = 4 blocks) but only 1 free block remains besides the hit
    assert not kv.allocate(b, 5, hit)
    assert kv.pool.num_free == 3 and "b" not in kv.block_tables


def test_allocate_all_takes_every_request_s_blocks_or_none():
    """Two running requests whose next blocks each fit alone but not together: nothing changes (one by one,
    the first would have kept its blocks); with room for both, both get theirs. A request not running yet
    is refused too (its cached blocks count against the free ones differently)."""
    kv = KVCacheManager(num_blocks=6, block_size=4, model_identity="m", kv_layout="l")
    a, b = _req("a", list(range(4))), _req("b", list(range(100, 104)))
    for r in (a, b):
        assert kv.allocate(r, 4)
        r.num_computed_tokens = 4
    assert kv.pool.num_free == 4
    before = {rid: list(t) for rid, t in kv.block_tables.items()}
    assert not kv.allocate_all([(a, 9), (b, 9)])  # 3 blocks each: 6 > 4 free
    assert kv.pool.num_free == 4 and {rid: list(t) for rid, t in kv.block_tables.items()} == before
    assert not kv.allocate_all([(a, 4), (_req("c", [7, 7, 7]), 3)])
    assert kv.pool.num_free == 4 and len(kv.block_tables["a"]) == 1
    assert kv.allocate_all([(a, 8), (b, 4)])  # 2 + 1 blocks
    assert len(kv.block_tables["a"]) == 3 and len(kv.block_tables["b"]) == 2 and kv.pool.num_free == 1
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_free == 6 and all(c == 0 for c in kv.pool.ref_counts)
