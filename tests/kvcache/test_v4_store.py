"""DeepSeek-V4's compact persistent KV: the host tier and store keep the compressed entries (and CSA's
indexer keys) only; a hit whose sliding window and compressor rows are gone replays the last
`swa_replay_tokens` of it against the held entries. Tiny random V4, fp32, a real store in tmp_path."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.kvcache import KVBlockStore
from deepinfer.kvcache.exchange import export_blocks, import_blocks, prompt_block_hashes
from deepinfer.kvcache.format import PositionLayout, SegmentHeader
from deepinfer.kvcache.space import iter_files, read_header, verify_payload
from tests.engine.test_deepseek_v4_engine import SPEC, assert_full_forward_argmax
from tests.kvcache.test_kv_exchange import _run
from tests.models.v4_tiny import build_v4

BS = 4
PREFIX = 40  # 10 token blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def v4(tmp_path_factory, default_model_dir):
    """Window 6, CSA ratio 4 (overlapping), HCA ratio 8: with 4-token blocks an HCA block spans two
    token blocks, so odd chain positions carry CSA and HCA entries, even ones CSA entries only."""
    path = tmp_path_factory.mktemp("v4s") / "tiny-v4"
    hf = build_v4(path, seed=11, tokenizer_dir=default_model_dir, **SPEC)
    return path, hf


def _prompts(vocab: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(5)
    prefix = [rng.randrange(3, vocab) for _ in range(PREFIX)]
    return prefix, [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in (3, 9)]


def _llm(path, store, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "4MiB")
    kw.setdefault("kv_store_admit", "always")
    return LLM(str(path), dtype="float32", block_size=BS, kv_store=str(store) if store else "none",
               profile_cost_model=False, **kw)


def _store_then_hit(path, tmp_path, prompts, prefix, **kw):
    """Engine A computes the prefix (its compressed entries go to the store); engine B, empty device
    cache, runs prompts extending it one after the other. Returns B's outputs and stats."""
    with _llm(path, tmp_path / "store", **kw) as a:
        a.generate([{"prompt_token_ids": prefix}], GREEDY)
    with _llm(path, tmp_path / "store", **kw) as b:
        outs = [b.generate([{"prompt_token_ids": p}], GREEDY)[0] for p in prompts]
        stats = b.engine.stats()
        assert all(g.pool.num_used == 0 for g in b.engine.core.kv.groups)  # nothing leaked
    return outs, stats


def test_store_holds_compressed_entries_only(v4, tmp_path):
    """Segments are version 2 (a size per position): odd positions carry both groups' entries, even ones
    CSA's only; every payload verifies, and the layout key names exactly those tensors."""
    path, hf = v4
    prefix, _ = _prompts(hf.config.vocab_size)
    with _llm(path, tmp_path / "store") as llm:
        llm.generate([{"prompt_token_ids": prefix}], GREEDY)
        core = llm.engine.core
        layout = core.tiers.layout
        assert isinstance(layout, PositionLayout)
        # CSA layers 1, 3: entry (16) + indexer key (8) per entry, one entry per 4-token block; HCA layer 2:
        # one 16-wide entry per 8 tokens, stored at odd positions
        assert layout.key == "float32|bs4|x1:2*(1x16+1x8)|x2:1x16"
        assert [layout.nbytes(p) for p in range(4)] == [4 * 48, 4 * 64, 4 * 48, 4 * 64]
        assert core.kv.kv_layout == layout.key  # it seeds the block hashes
        llm.engine.core.flush_kv_store()
    sizes = {}
    for e in iter_files(tmp_path / "store"):
        with open(e.path, "rb") as f:
            hdr = read_header(f)
            verify_payload(f, hdr)
        assert hdr.sizes is not None and hdr.block_nbytes == 0
        sizes.update({hdr.first_pos + i: hdr.size(i) for i in range(hdr.nblocks)})
    # 40 prompt + 8 generated tokens: 48 computed at most, the last token's KV never; 11 full blocks
    assert sorted(sizes) == list(range(11)) and all(sizes[p] == layout.nbytes(p) for p in sizes)


def test_position_layout_segments_round_trip(tmp_path):
    """The store with a layout whose positions differ in size (some empty): put, lookup, load, header v2."""
    layout = PositionLayout("float32", 4, ((1, 12, "1x3"), (3, 8, "1x2")))
    assert [layout.nbytes(p) for p in range(6)] == [12, 12, 20, 12, 12, 20]
    sparse = PositionLayout("float32", 4, ((2, 8, "1x2"),))
    assert [sparse.nbytes(p) for p in range(4)] == [0, 8, 0, 8]
    for lay in (layout, sparse):
        store = KVBlockStore(tmp_path / lay.key.replace("|", "_"), "m", lay, 1 << 20, segment_blocks=4)
        hashes = [bytes([i]) * 16 for i in range(10)]
        payloads = [bytes([i]) * lay.nbytes(i) for i in range(10)]
        assert store.put(hashes, payloads) == 10
        assert store.lookup(hashes) == 10
        assert [bytes(p) for p in store.load(hashes, 3, 5)] == payloads[3:8]
        with pytest.raises(ValueError, match="payloads of"):
            store.put_run(hashes[0], 1, hashes[1:3], [payloads[2], payloads[1]])
    hdr = SegmentHeader("m", "k", "float32", "chat", 0.0, 1.0, 3, 0, [b"x" * 16] * 2, [1, 2], sizes=[5, 0])
    data = hdr.encode()
    assert hdr.header_len == SegmentHeader.length_for(2, "m", "k", "float32", "chat", sized=True)
    back = SegmentHeader.decode(data)
    assert (back.sizes, back.payload_len, back.offset(1)) == ([5, 0], 5, 5)


def test_replay_of_the_whole_hit_follows_the_full_forward(v4, tmp_path):
    """swa_replay_tokens >= the hit: the window and compressor rows are recomputed from position 0 while
    the compressed groups read their stored entries (and write none): exact."""
    path, hf = v4
    prefix, prompts = _prompts(hf.config.vocab_size)
    outs, stats = _store_then_hit(path, tmp_path, prompts, prefix, swa_replay_tokens=1000)
    first, second = outs
    assert first.num_cached_tokens == PREFIX and first.num_cached_tokens_by_tier["store"] == PREFIX
    assert first.num_replayed_tokens == PREFIX
    # the second prompt finds the first's blocks on the device, windows included
    assert second.num_cached_tokens >= PREFIX and second.num_replayed_tokens == 0
    assert stats["swa_replayed_tokens"] == PREFIX
    for p, o in zip(prompts, outs, strict=True):
        assert len(o.outputs[0].token_ids) == GREEDY.max_tokens
        assert_full_forward_argmax(hf, p, o.outputs[0].token_ids)


def test_default_replay_recomputes_the_window_only(v4, tmp_path):
    """The default replay (the window, 6, at least the 4 rows the compressors need): 40 - 6 = 34, down to
    the block boundary 32, so 8 of the 40 cached tokens are recomputed and 3 + 8 prompt tokens computed
    instead of 43. An approximation (a replayed token's window is cut at 32): the tokens are not compared,
    but the held compressed entries must come out of the replay untouched (byte-equal to the store's)."""
    path, hf = v4
    prefix, prompts = _prompts(hf.config.vocab_size)
    outs, stats = _store_then_hit(path, tmp_path, prompts, prefix)
    first = outs[0]
    assert (first.num_cached_tokens, first.num_replayed_tokens) == (PREFIX, 8)
    assert first.num_cached_tokens_by_tier["store"] == PREFIX
    assert stats["swa_replayed_tokens"] == 8 and stats["prefix_hits_store"] == PREFIX
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    with _llm(path, tmp_path / "store") as llm:
        # the second prompt's own 48 tokens are stored now (49 - 1 computable): 42, down to 40
        out = llm.generate([{"prompt_token_ids": prompts[1]}], GREEDY)[0]
        assert (out.num_cached_tokens, out.num_replayed_tokens) == (48, 8)
        core = llm.engine.core
        tb = core.runner.tier_blocks
        hashes = prompt_block_hashes(core, prompts[1], None)[:48 // BS]
        stored = core.tiers.store.load(hashes)
        assert len(stored) == len(hashes)
        for p, payload in enumerate(stored):
            blocks = [core.kv.groups[tb.groups[k]].pool.lookup(hashes[p]) for k, _ in tb.carried(p)]
            assert bytes(tb.gather(p, blocks).numpy()) == bytes(payload)


def test_replay_shorter_than_the_open_compression_groups_is_refused(v4):
    path, _ = v4
    with pytest.raises(ValueError, match="swa_replay_tokens=2 is below 4"):
        _llm(path, None, swa_replay_tokens=2)


def test_host_tier_serves_evicted_compressed_entries(v4):
    """No store: a small device cache evicts the prefix's compressed blocks into the host tier (each chain
    position copied whole from both compressed groups); a later hit loads them and replays."""
    path, hf = v4
    prefix, prompts = _prompts(hf.config.vocab_size)
    rng = random.Random(9)
    others = [[rng.randrange(3, hf.config.vocab_size) for _ in range(60)] for _ in range(3)]
    with _llm(path, None, kv_cache_memory="40KiB", host_cache_memory="1MiB", max_num_seqs=1,
              max_num_batched_tokens=16,
              swa_replay_tokens=1000) as llm:
        llm.generate([{"prompt_token_ids": prefix}], GREEDY)
        for o in others:
            llm.generate([{"prompt_token_ids": o}], GREEDY)
        core = llm.engine.core
        assert llm.engine.stats()["kv_host_blocks"] > 0
        out = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY)[0]
        assert out.num_cached_tokens_by_tier["host"] > 0 and out.num_replayed_tokens == out.num_cached_tokens
        assert all(g.pool.num_used == 0 for g in core.kv.groups)
    assert_full_forward_argmax(hf, prompts[0], out.outputs[0].token_ids)


def test_payload_bytes_follow_the_tier_groups(v4):
    """`TierBlocks` gathers a position from the compressed groups' blocks and scatters it back."""
    path, _ = v4
    with _llm(path, None) as llm:
        blocks = llm.engine.core.runner.tier_blocks
        for ts in blocks.tensors:
            for t in ts:
                t.copy_(torch.randn_like(t))
        tables = [[], [], [5, 6], [], [7]]  # group 2: CSA blocks of positions 0, 1; group 4: HCA block 0
        payloads = [blocks.gather(p, blocks.device_blocks(p, tables)) for p in (0, 1)]
        assert [len(p) for p in payloads] == [192, 256]
        fresh = [[], [], [1, 2], [], [3]]
        blocks.scatter([0, 1], [blocks.device_blocks(p, fresh) for p in (0, 1)], payloads)
        for ts, (src, dst) in zip(blocks.tensors, [((5, 6), (1, 2)), ((7,), (3,))], strict=True):
            for t in ts:
                assert torch.equal(t[list(src)], t[list(dst)])


@pytest.mark.parametrize("arch", ["v4", "qwen2_swa"])
def test_export_ships_every_group_and_decode_continues_like_one_engine(arch, v4, tiny_models):
    """Prefill here, decode there: the export carries each position's tier part plus the window groups'
    blocks still held (the last window), so the decode engine's hit is exact (no replay) and its greedy
    tokens are one engine's. V4: windows, compressor rows, compressed entries; qwen2_swa: full + sliding."""
    path = v4[0] if arch == "v4" else tiny_models[arch]
    vocab = v4[1].config.vocab_size if arch == "v4" else 49152
    rng = random.Random(3)
    prompt = [rng.randrange(3, vocab) for _ in range(43)]
    full = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with _llm(path, None, kv_cache_memory="8MiB") as unified, _llm(path, None, kv_cache_memory="8MiB") as prefill, \
            _llm(path, None, kv_cache_memory="8MiB") as decode:
        ref = _run(unified, prompt, full).outputs[0].token_ids
        first = _run(prefill, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        assert first.outputs[0].token_ids == ref[:1]
        blocks = export_blocks(prefill.engine.core, prompt, None)
        assert len(blocks) == 43 // BS
        assert import_blocks(decode.engine.core, blocks) == len(blocks)
        out = _run(decode, prompt, full, output_prefix=first.outputs[0].token_ids)
        assert out.outputs[0].token_ids == ref
        assert out.num_cached_tokens == 40 and out.num_replayed_tokens == 0
        for llm in (unified, prefill, decode):
            assert all(g.pool.num_used == 0 for g in llm.engine.core.kv.groups)
