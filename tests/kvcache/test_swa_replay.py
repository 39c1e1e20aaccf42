"""SWA bounded replay end to end: a model with full and sliding-window layers stores only its full layers'
KV (host tier / store); a later engine hits that prefix in the store and recomputes only the sliding layers
over the last `swa_replay_tokens` of it, reading the stored full-layer KV. Tiny random Qwen2 models, fp32,
compared with transformers and with a cold run."""

from __future__ import annotations

import random

import pytest

from deepinfer import LLM, SamplingParams
from tests.conftest import TINY_ARCHS, _build_tiny, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
WINDOW = 12
BS = 4
PREFIX = 40


@pytest.fixture(scope="module")
def one_sliding_layer(tmp_path_factory, tokenizer_dir):
    """Qwen2 with layers 0-1 full and only layer 2 sliding (window 12)."""
    spec = {**TINY_ARCHS["qwen2_swa"], "max_window_layers": 2}
    return _build_tiny("qwen2_swa1", tmp_path_factory.mktemp("swa1"), tokenizer_dir, spec)


def _prompts() -> tuple[list[int], list[list[int]]]:
    rng = random.Random(7)
    prefix = [rng.randrange(3, 49152) for _ in range(PREFIX)]
    return prefix, [prefix + [rng.randrange(3, 49152) for _ in range(n)] for n in (3, 7)]


def _llm(model, store, **kw) -> LLM:
    return LLM(str(model), dtype="float32", kv_cache_memory="16MiB", block_size=BS, kv_store=str(store),
               kv_store_admit="always", profile_cost_model=False, **kw)


def _store_then_hit(model, tmp_path, **kw) -> tuple[list, dict, list[list[int]]]:
    """Engine A computes the prefix (its full-layer blocks go to the store); engine B, empty device cache,
    runs prompts that extend it, one after the other. Returns B's outputs, B's stats and the prompts."""
    prefix, prompts = _prompts()
    with _llm(model, tmp_path / "store", **kw) as a:
        a.generate([prefix], GREEDY)
    with _llm(model, tmp_path / "store", **kw) as b:
        outs = [b.generate([p], GREEDY)[0] for p in prompts]
        stats = b.engine.stats()
        assert all(g.pool.num_used == 0 for g in b.engine.core.kv.groups)  # nothing leaked
    return outs, stats, prompts


def _cold(model, prompts) -> list[list[int]]:
    with LLM(str(model), dtype="float32", kv_cache_memory="16MiB", block_size=BS, kv_store="none",
             enable_prefix_caching=False, profile_cost_model=False) as cold:
        return [o.outputs[0].token_ids for o in cold.generate(prompts, GREEDY)]


@pytest.mark.parametrize("budget", [None, 8])
def test_default_replay_of_a_single_sliding_layer_is_exact(one_sliding_layer, tmp_path, budget):
    """One sliding layer: its K/V at a replayed position depends only on full layers below it, which read
    the stored KV, so replaying the last window (28 .. 39: 40 - 12 = 28, a block boundary) is exact. With a
    token budget of 8 the replay itself spans steps (28-35, then 36-39 with the first new tokens)."""
    kw = {} if budget is None else {"max_num_batched_tokens": budget, "scheduler": "tokens"}
    outs, stats, prompts = _store_then_hit(one_sliding_layer, tmp_path, **kw)
    first, second = outs
    assert first.num_cached_tokens == PREFIX and first.num_cached_tokens_by_tier["store"] == PREFIX
    assert first.num_replayed_tokens == WINDOW  # positions 28 .. 39
    # the second prompt finds the first's blocks on the device, its window's sliding blocks included
    assert second.num_cached_tokens == PREFIX and second.num_replayed_tokens == 0
    assert stats["swa_replayed_tokens"] == WINDOW and stats["prefix_hits_store"] == PREFIX
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(one_sliding_layer), dtype="float32").eval()
    hf.generation_config.eos_token_id = None
    want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == want == _cold(one_sliding_layer, prompts)


def test_replay_from_the_start_is_exact_with_stacked_sliding_layers(tiny_models, hf_models, tmp_path):
    """Layers 1-2 sliding: replaying the whole hit (swa_replay_tokens >= it) recomputes every sliding
    dependency while the full layer reads its stored KV."""
    outs, stats, prompts = _store_then_hit(tiny_models["qwen2_swa"], tmp_path, swa_replay_tokens=1000)
    assert outs[0].num_cached_tokens == PREFIX and outs[0].num_replayed_tokens == PREFIX
    want = [hf_greedy(hf_models["qwen2_swa"], p, GREEDY.max_tokens) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == want


def test_bounded_replay_computes_the_window_only(tiny_models, tmp_path):
    """Stacked sliding layers with the default replay (the window): an approximation, so the tokens are
    not compared; what is checked is the work: 12 of the 40 cached tokens recomputed, the rest read."""
    outs, stats, _ = _store_then_hit(tiny_models["qwen2_swa"], tmp_path)
    assert [(o.num_cached_tokens, o.num_replayed_tokens) for o in outs] == [(PREFIX, WINDOW), (PREFIX, 0)]
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    # replay off: the store holds no sliding-window KV, so a model with such layers uses no tier at all
    prefix, prompts = _prompts()
    with _llm(tiny_models["qwen2_swa"], tmp_path / "store", swa_replay_tokens=0) as off:
        assert off.engine.core.tiers is None
        assert off.generate([prompts[0]], GREEDY)[0].num_cached_tokens == 0
