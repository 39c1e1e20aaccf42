"""KV layer groups: a model whose layers mix full attention and a sliding window (tiny random Qwen2,
layer 0 full, layers 1-2 a window of 12 tokens), against transformers and against itself without the
prefix cache (float32); and the manager's group rules without a model."""

from __future__ import annotations

import math
import random

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine.request import Request
from deepinfer.kvcache.manager import NO_BLOCK, KVCacheManager
from deepinfer.kvcache.spec import FullAttention, SlidingWindow
from tests.conftest import hf_greedy

WINDOW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


def _held(table: list[int]) -> int:
    return sum(b != NO_BLOCK for b in table)


def test_config_declares_two_groups_and_sliding_layers_get_fewer_blocks(tiny_models):
    with LLM(str(tiny_models["qwen2_swa"]), dtype="float32", kv_cache_memory="16MiB", max_num_seqs=4) as llm:
        runner = llm.engine.core.runner
        assert [(g.layers, g.spec) for g in runner.kv_groups] == [((0,), FullAttention()),
                                                                   ((1, 2), SlidingWindow(WINDOW))]
        assert llm.engine.core.kv.supports_tiers and llm.engine.core.kv.replay_tokens == WINDOW
        full, sliding = runner.group_num_blocks
        # 4 sequences x (ceil(12 / 16) + 1) blocks + one 2048-token step, twice: 2 * (8 + 128)
        assert sliding == 272 and full > 3 * sliding
        assert [len(g.pool.ref_counts) for g in llm.engine.core.kv.groups] == [full, sliding]
        # the full group's caches have one spare block: where replayed positions' writes go
        assert [runner.kv_caches[i][0].shape[0] for i in range(3)] == [full + 1, sliding, sliding]
        spare = runner.kv_caches[0][0][0].numel() * 4 * 2
        assert 15 * 2**20 < runner.kv_cache_bytes - spare <= 16 * 2**20  # the budget is spent, not exceeded


@pytest.mark.parametrize("block_size", [4, 16])
def test_sliding_group_holds_only_the_window_and_matches_hf(block_size, tiny_models, hf_models):
    """While a long sequence decodes, the sliding group holds at most ceil(W / block) + 1 blocks while the
    full group grows; the tokens equal transformers'."""
    prompt = _prompts(1, [45])[0]
    with LLM(str(tiny_models["qwen2_swa"]), dtype="float32", kv_cache_memory="16MiB",
             block_size=block_size) as llm:
        engine = llm.engine
        kv = engine.core.kv
        held_at_decode, full_sizes = [], []
        prepare = engine.core.runner.prepare

        def observe(step, group_tables):  # what each step's attention reads, as the runner gets it
            full, sliding = (t["r"] for t in group_tables)
            full_sizes.append(len(full))
            assert len(sliding) == len(full)
            if step.scheduled[0].num_new_tokens == 1:
                held_at_decode.append(_held(sliding))
            return prepare(step, group_tables)

        engine.core.runner.prepare = observe
        engine.add_request(prompt, GREEDY, request_id="r", prompt_token_ids=prompt)
        tokens = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens = out.outputs[0].token_ids
        assert len(held_at_decode) == GREEDY.max_tokens - 1
        assert max(held_at_decode) <= math.ceil(WINDOW / block_size) + 1
        assert full_sizes[-1] == math.ceil((len(prompt) + GREEDY.max_tokens - 1) / block_size)
        assert tokens == hf_greedy(hf_models["qwen2_swa"], prompt, GREEDY.max_tokens)
        assert all(g.pool.num_free == g.pool.num_blocks for g in kv.groups)


def test_prefix_hit_loads_only_window_blocks_and_output_unchanged(tiny_models, hf_models):
    bs = 4
    prefix = _prompts(2, [40])[0]
    tails = _prompts(3, [3, 9])
    prompts = [prefix + t for t in tails]
    with LLM(str(tiny_models["qwen2_swa"]), dtype="float32", kv_cache_memory="16MiB", block_size=bs) as llm:
        first = llm.generate([prefix], GREEDY)[0]
        assert first.num_cached_tokens == 0
        kv = llm.engine.core.kv
        req = Request("probe", prompts[0], GREEDY)
        hit = kv.lookup_prefix(req)
        assert len(hit.blocks) == 40 // bs and NO_BLOCK not in hit.blocks  # the full group needs every block
        (sliding,) = hit.other_groups
        assert len(sliding) == len(hit.blocks)
        needed = SlidingWindow(WINDOW).first_needed_block(len(hit.blocks) * bs, bs)
        assert sliding[:needed] == [NO_BLOCK] * needed and NO_BLOCK not in sliding[needed:]
        assert _held(sliding) <= math.ceil(WINDOW / bs) + 1
        outs = llm.generate(prompts, GREEDY)
        assert [o.num_cached_tokens for o in outs] == [40, 40]
        for p, o in zip(prompts, outs, strict=True):
            assert o.outputs[0].token_ids == hf_greedy(hf_models["qwen2_swa"], p, GREEDY.max_tokens)
    with LLM(str(tiny_models["qwen2_swa"]), dtype="float32", kv_cache_memory="16MiB", block_size=bs,
             enable_prefix_caching=False) as cold:
        assert [o.outputs[0].token_ids for o in cold.generate(prompts, GREEDY)] == \
            [o.outputs[0].token_ids for o in outs]


def _computed(kv: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    req = Request(rid, tokens, GREEDY)
    assert kv.allocate(req, len(tokens), kv.lookup_prefix(req))
    req.num_computed_tokens = len(tokens)
    kv.register_computed(req)
    return req


def test_hit_shortens_to_where_the_window_is_still_cached():
    """Without replay, a hit of L blocks needs the sliding group's blocks in L's window: when those were
    evicted, the hit falls back to a shorter prefix whose window is cached (here: none), never past a hole."""
    bs, window = 4, 6
    kv = KVCacheManager([32, 6], bs, "m", "l", specs=[FullAttention(), SlidingWindow(window)], replay_tokens=0)
    a = _computed(kv, "a", list(range(24)))  # 6 blocks, all held by both groups (no step dropped any)
    kv.free(a)
    b = Request("b", list(range(24)) + [99], GREEDY)
    hit = kv.lookup_prefix(b)
    assert len(hit.blocks) == 6 and hit.other_groups[0][:4] == [NO_BLOCK] * 4  # window of pos 24: 19..23
    # another prompt takes 4 blocks of the 6-block sliding pool: the LRU evicts a's oldest free blocks
    kv.free(_computed(kv, "c", [7] * 16))
    # the free queue hands out a's last blocks first (a request's tail is evicted before its head)
    held = [kv.groups[1].pool.lookup(h) is not None for h in b.block_hashes[:6]]
    assert held == [True, True, False, False, False, False]
    # L = 6..3 would need a window block that is gone; L = 2 needs blocks 0-1 (window of position 8: 3..7)
    hit = kv.lookup_prefix(b)
    assert len(hit.blocks) == 2 and hit.other_groups[0] == [kv.groups[1].pool.lookup(h) for h in b.block_hashes[:2]]
    assert all(c == 0 for g in kv.groups for c in g.pool.ref_counts)


def test_replayed_hit_keeps_the_full_prefix_and_recomputes_only_the_window():
    """With replay (default: the window), the same evicted case keeps all 6 full blocks and recomputes the
    sliding group from the last block boundary at least `window` tokens back; the sliding blocks before it
    are never allocated, and the request's replay fields say which positions the full group skips."""
    bs, window = 4, 6
    kv = KVCacheManager([32, 6], bs, "m", "l", specs=[FullAttention(), SlidingWindow(window)])
    kv.free(_computed(kv, "a", list(range(24))))
    kv.free(_computed(kv, "c", [7] * 16))  # evicts a's last 4 sliding blocks, as above
    b = Request("b", list(range(24)) + [99], GREEDY)
    hit = kv.lookup_prefix(b)
    assert len(hit.blocks) == 6 and hit.replay_from == 16 and hit.start(bs) == 16  # 24 - 6 = 18, down to 16
    assert hit.other_groups == [[NO_BLOCK] * 4]
    assert kv.allocate(b, 9, hit)
    kv.admit(b, hit)
    assert (b.replay_end, b.kv_floor, b.num_replayed_tokens, kv.replayed_tokens) == (24, 16, 8, 8)
    full, sliding = (g.tables["b"] for g in kv.groups)
    assert full[:6] == hit.blocks and len(full) == 7 and sliding[:4] == [NO_BLOCK] * 4 and len(sliding) == 7
    # a longer exact hit wins over a replay that would compute more: a replay of 20 tokens starts at 4
    kv2 = KVCacheManager([32, 6], bs, "m", "l", specs=[FullAttention(), SlidingWindow(window)], replay_tokens=20)
    kv2.free(_computed(kv2, "a", list(range(24))))
    kv2.free(_computed(kv2, "c", [7] * 16))
    hit = kv2.lookup_prefix(Request("b", list(range(24)) + [99], GREEDY))
    assert hit.replay_from is None and len(hit.blocks) == 2  # 8 exact tokens beat a replay from 4
    kv.free(b)
    assert all(c == 0 for g in kv.groups for c in g.pool.ref_counts)


def test_running_sequence_releases_blocks_that_leave_the_window():
    bs = 4
    kv = KVCacheManager(16, bs, "m", "l", specs=[FullAttention(), SlidingWindow(6)])
    req = Request("r", list(range(10)), GREEDY)
    assert kv.allocate(req, 10, kv.lookup_prefix(req))
    sliding = kv.groups[1]
    assert _held(sliding.tables["r"]) == 3
    for n in range(10, 40):  # decode one token at a time
        req.num_computed_tokens = n
        req.token_ids.append(1)
        assert kv.allocate(req, 1)
        first = SlidingWindow(6).first_needed_block(n, bs)
        table = sliding.tables["r"]
        assert table[:first] == [NO_BLOCK] * first and NO_BLOCK not in table[first:]
        assert _held(table) <= math.ceil(6 / bs) + 1
        assert len(kv.groups[0].tables["r"]) == -(-(n + 1) // bs)
    kv.free(req)
    assert all(g.pool.num_free == g.pool.num_blocks for g in kv.groups)


def test_sliding_only_model_never_registers_a_dropped_block():
    """One sliding group (group 0, as in Mistral): blocks a prefix hit skipped are NO_BLOCK in the table;
    registering the request's computed blocks must skip them, not name pool block -1 (the last one, here
    another request's) by an evicted hash."""
    bs = 4
    kv = KVCacheManager(8, bs, "m", "l", specs=[SlidingWindow(6)])
    kv.free(_computed(kv, "a", list(range(24))))
    b = Request("b", list(range(24)) + [99], GREEDY)
    assert kv.allocate(b, 1, kv.lookup_prefix(b))
    assert kv.block_tables["b"][:4] == [NO_BLOCK] * 4
    c = Request("c", [7] * 10, GREEDY)  # takes the last pool block and evicts two of a's early blocks
    assert kv.allocate(c, 10, kv.lookup_prefix(c))
    assert 7 in kv.block_tables["c"]
    b.num_computed_tokens = 25
    b.token_ids.append(5)
    kv.register_computed(b)
    assert NO_BLOCK not in kv.pool.cached.values()
    assert all(kv.pool.block_hash[blk] == h for h, blk in kv.pool.cached.items())
    assert kv.pool.block_hash[7] is None  # c's block: c has registered nothing
