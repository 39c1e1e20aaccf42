"""DeepSeek-V4 in the engine: every generated token must be the argmax of transformers' uncached full
forward given deepinfer's own prefix (fp32, within 1e-4 of the top logit), whatever the batching, chunking,
prefix hits or preemption (docs/deepseek_v4.md says why the full forward is the reference); and the
manager's rules for the V4 KV specs without a model."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.request import Request
from deepinfer.kvcache.manager import NO_BLOCK, KVCacheManager
from deepinfer.kvcache.spec import Compressed, CompressorWindow, SlidingWindow
from tests.kvcache.test_hybrid_kv import _computed
from tests.models.v4_tiny import CSA, HCA, SWA, build_v4, hf_full_logits

TOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# window 6, CSA ratio 4 (overlapping), HCA ratio 8: with 4-token blocks an HCA block covers two token blocks
SPEC = dict(layer_types=[SWA, CSA, HCA, CSA], mlp_layer_types=["hash_moe", "moe", "moe", "moe"], num_hidden_layers=4)


@pytest.fixture(scope="module")
def v4(tmp_path_factory, tokenizer_dir):
    path = tmp_path_factory.mktemp("v4") / "tiny-v4"
    hf = build_v4(path, seed=11, tokenizer_dir=tokenizer_dir, **SPEC)
    return path, hf


def _prompts(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def assert_full_forward_argmax(hf, prompt: list[int], tokens: list[int]) -> None:
    logits = hf_full_logits(hf, prompt + tokens)
    rows = logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]
    chosen = rows.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    gaps = rows.max(dim=1).values - chosen
    assert gaps.max().item() <= TOL, f"tokens below the full forward's argmax by {gaps.tolist()}"


def _generate(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_groups_and_what_stays_off(v4):
    path, _ = v4
    with LLM(str(path), dtype="float32", kv_cache_memory="4MiB", block_size=4) as llm:
        core = llm.engine.core
        assert [(g.layers, g.spec) for g in core.runner.kv_groups] == [
            ((0, 1, 2, 3), SlidingWindow(6)), ((1, 3), CompressorWindow(4, True)), ((1, 3), Compressed(4)),
            ((2,), CompressorWindow(8, False)), ((2,), Compressed(8))]
        # the tiers would hold the compressed groups (the LLM class has no store by default); bounded replay
        # defaults to the window, at least the open compression groups' rows (4 for both ratios here)
        assert core.tiers is None and core.kv.supports_tiers and core.kv.tier_groups == [2, 4]
        assert (core.kv.replay_tokens, core.kv.min_replay_tokens) == (6, 4)
        assert core.runner.kv_cache_bytes <= 4 * 2**20
    with pytest.raises(ValueError, match="deterministic mode does not serve DeepseekV4ForCausalLM"):
        LLM(str(path), dtype="float32", kv_cache_memory="4MiB", deterministic=True)


@pytest.mark.parametrize("block_size,budget", [(4, 8), (16, 2048)])
def test_mixed_batch_and_chunked_prefill_follow_the_full_forward(v4, block_size, budget):
    """Four prompts of mixed lengths in one batch; with an 8-token budget every prompt is prefilled in
    chunks that end inside compression groups and windows."""
    path, hf = v4
    prompts = _prompts(1, [3, 17, 42, 29], hf.config.vocab_size)
    with LLM(str(path), dtype="float32", kv_cache_memory="4MiB", block_size=block_size,
             max_num_batched_tokens=budget, enable_prefix_caching=False) as llm:
        outs = _generate(llm, prompts)
    for p, toks in zip(prompts, outs, strict=True):
        assert len(toks) == GREEDY.max_tokens
        assert_full_forward_argmax(hf, p, toks)


def test_prefix_hits_restore_window_rows_and_entries(v4):
    """Prompts sharing a 38-token prefix (not a multiple of either ratio's block span) hit the cache; the
    tokens are the full forward's and the same as without the prefix cache."""
    path, hf = v4
    prefix = _prompts(2, [38], hf.config.vocab_size)[0]
    prompts = [prefix + t for t in _prompts(3, [1, 6, 13], hf.config.vocab_size)] + [prefix[:21]]
    with LLM(str(path), dtype="float32", kv_cache_memory="4MiB", block_size=4, max_num_batched_tokens=16) as llm:
        assert llm.generate([{"prompt_token_ids": prefix}], GREEDY)[0].num_cached_tokens == 0
        kv = llm.engine.core.kv
        hit = kv.lookup_prefix(Request("probe", prompts[1], GREEDY))
        window, rows4, comp4, rows8, comp8 = [hit.blocks, *hit.other_groups]
        assert len(window) == 9 and NO_BLOCK not in window[-2:] and window[0] == NO_BLOCK
        # compressor rows of positions 29..35 (2 * 4 for CSA, 8 for HCA): the last two token blocks
        assert rows4[:7] == rows8[:7] == [NO_BLOCK] * 7 and NO_BLOCK not in rows4[7:] + rows8[7:]
        assert len(comp4) == 9 and NO_BLOCK not in comp4  # one CSA block per token block
        assert len(comp8) == 4 and NO_BLOCK not in comp8  # an HCA block spans two token blocks
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.num_cached_tokens for o in outs] == [36, 36, 36, 20]
        hot = [o.outputs[0].token_ids for o in outs]
    for p, toks in zip(prompts, hot, strict=True):
        assert_full_forward_argmax(hf, p, toks)
    with LLM(str(path), dtype="float32", kv_cache_memory="4MiB", block_size=4, enable_prefix_caching=False) as cold:
        assert _generate(cold, prompts) == hot


def test_preemption_recomputes_to_the_same_tokens(v4):
    """A KV pool too small for four long sequences at once: the newest are preempted and recomputed. The
    token policy admits all four while the first ones decode (chunks fill each step's 32 tokens); the compute
    policy admits no prompt whose rest exceeds the step's token budget into a step that completes another
    (`_worth_batching`), so with this pool its later prompts wait for room instead of being admitted and then
    preempted."""
    path, hf = v4
    prompts = _prompts(4, [30, 26, 33, 21], hf.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with LLM(str(path), dtype="float32", kv_cache_memory="112KiB", block_size=4, max_num_seqs=4,
             max_num_batched_tokens=32, max_model_len=96, scheduler="tokens") as llm:
        outs = _generate(llm, prompts, params)
        assert llm.engine.core.scheduler.num_preemptions > 0
        assert all(g.pool.num_used == 0 for g in llm.engine.core.kv.groups)
    for p, toks in zip(prompts, outs, strict=True):
        assert_full_forward_argmax(hf, p, toks)


def test_compressed_group_rules_without_a_model():
    """Compressed blocks: sized by complete groups, named by the last token block they cover, needed from
    block 0; compressor rows kept like a window of 2 * ratio (CSA) tokens."""
    bs = 4
    specs = [SlidingWindow(6), CompressorWindow(4, True), Compressed(4), CompressorWindow(8), Compressed(8)]
    kv = KVCacheManager(64, bs, "m", "l", specs=specs)
    a = _computed(kv, "a", list(range(30)))
    tables = [g.tables["a"] for g in kv.groups]
    assert [len(t) for t in tables] == [8, 8, 7, 8, 3]  # 30 tokens: 7 entries of ratio 4, 3 of ratio 8
    assert [sum(b != NO_BLOCK for b in t) for t in tables] == [8, 8, 7, 8, 3]  # nothing dropped in one step
    assert kv.groups[4].pool.block_hash[tables[4][1]] == a.block_hashes[3]  # HCA block 1: token blocks 2-3
    kv.free(a)
    b = Request("b", list(range(30)) + [5, 6], GREEDY)
    hit = kv.lookup_prefix(b)
    assert len(hit.blocks) == 7  # 7 full token blocks of the 30 computed tokens; windows of position 28:
    window, rows4, comp4, rows8, comp8 = [hit.blocks, *hit.other_groups]
    assert window[:5] == [NO_BLOCK] * 5 and rows4[:5] == [NO_BLOCK] * 5 and rows8[:5] == [NO_BLOCK] * 5
    assert comp4 == tables[2][:7] and comp8 == tables[4][:3]
    # an HCA block evicted: the hit ends before the first token block that needed it
    kv.groups[4].pool.allocate(kv.groups[4].pool.num_free)
    assert len(kv.lookup_prefix(b).blocks) == 1
