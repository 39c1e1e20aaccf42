"""Gemma 3 (tiny random configs built here) against transformers' Gemma3ForCausalLM, float32: local layers
with a window of 8 tokens and blocks of 4 (smaller still), a soft-capped config, and what is refused.

The shared tiny-arch suite (test_models_vs_hf.py, arch "gemma3") covers blocks of 16 over a window of 10."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.kvcache.spec import FullAttention, SlidingWindow
from tests.conftest import hf_greedy

WINDOW = 8
BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def _prompts(seed: int, lengths: list[int], vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _build(root: Path, tokenizer_dir: Path, name: str, **overrides) -> tuple[Path, torch.nn.Module]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    spec = dict(vocab_size=len(tok), hidden_size=48, intermediate_size=80, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, num_hidden_layers=len(TYPES), layer_types=TYPES,
                sliding_window=WINDOW, query_pre_attn_scalar=20, max_position_embeddings=512, rms_norm_eps=1e-6,
                initializer_range=0.1, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                tie_word_embeddings=True)
    spec.update(overrides)
    torch.manual_seed(7)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**spec)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(0, 0.3)
    path = root / name
    model.save_pretrained(path)
    tok.save_pretrained(path)
    model.generation_config.eos_token_id = None
    return path, model


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("gemma3")
    return {
        "plain": _build(root, tokenizer_dir, "plain"),
        # the final logits soft-capped at 2: argmax is unchanged (tanh is monotonic), the logprobs are not
        "capped": _build(root, tokenizer_dir, "capped", final_logit_softcapping=2.0, tie_word_embeddings=False),
    }


def _llm(path: Path, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "16MiB")
    kw.setdefault("block_size", BLOCK)
    return LLM(str(path), dtype="float32", **kw)


def _assert_all_free(llm: LLM) -> None:
    for group in llm.engine.core.kv.groups:
        assert group.pool.num_free == group.pool.num_blocks
    assert not llm.engine.core.kv.block_tables


def test_layer_groups_and_rope_per_layer_type(gemma):
    path, hf = gemma["plain"]
    with _llm(path) as llm:
        model = llm.engine.core.runner.model
        # the full-attention group first (the manager's group 0), though layer 0 is a sliding one
        assert [(g.layers, g.spec) for g in model.kv_groups] == [((2, 4), FullAttention()),
                                                                  ((0, 1, 3), SlidingWindow(WINDOW))]
        assert model.layer_group == [1, 1, 0, 1, 0]
        local, full = model.rotary["sliding_attention"], model.rotary["full_attention"]
        ref = hf.model.rotary_emb
        pos = torch.arange(40)[None]
        for kind, ours in (("sliding_attention", local), ("full_attention", full)):
            cos, sin = ref(torch.zeros(1, dtype=torch.float32), pos, kind)
            assert torch.equal(ours.cos[:40], cos[0]) and torch.equal(ours.sin[:40], sin[0])
        assert not torch.equal(local.cos[:40], full.cos[:40])
        assert model.fused is None  # the whole-layer C decode path is Llama's


def test_mixed_lengths_small_blocks_match_hf(gemma):
    path, hf = gemma["plain"]
    prompts = _prompts(1, [1, 3, 8, 9, 23, 50])
    with _llm(path) as llm:
        outs = llm.generate(prompts, GREEDY)
        for p, o in zip(prompts, outs, strict=True):
            assert o.outputs[0].token_ids == hf_greedy(hf, p, 16)
        _assert_all_free(llm)


def test_chunked_prefill_with_small_token_budget(gemma):
    path, hf = gemma["plain"]
    prompts = _prompts(2, [45, 19, 2])
    with _llm(path, max_num_batched_tokens=8, scheduler="tokens", enable_prefix_caching=False) as llm:
        outs = llm.generate(prompts, GREEDY)
        for p, o in zip(prompts, outs, strict=True):
            assert o.outputs[0].token_ids == hf_greedy(hf, p, 16)
        assert llm.engine.core.num_steps > 45 // 8
        _assert_all_free(llm)


def test_prefix_cache_hits_match_hf(gemma):
    path, hf = gemma["plain"]
    prefix = _prompts(3, [30])[0]
    prompts = [prefix + t for t in _prompts(4, [2, 7, 13])]
    with _llm(path) as llm:
        first = llm.generate([prompts[0]], GREEDY)[0]
        assert first.num_cached_tokens == 0
        outs = llm.generate(prompts, GREEDY)
        for p, o in zip(prompts, outs, strict=True):
            assert o.outputs[0].token_ids == hf_greedy(hf, p, 16)
        # the 30-token prefix is 7 full blocks of 4 (the first prompt's own tail blocks are cached too)
        assert outs[0].num_cached_tokens == (len(prompts[0]) - 1) // BLOCK * BLOCK
        assert outs[1].num_cached_tokens == 28 and outs[2].num_cached_tokens == 28
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == \
            [o.outputs[0].token_ids for o in outs]
        _assert_all_free(llm)


def test_soft_capped_logits_and_logprobs_match_hf(gemma):
    path, hf = gemma["capped"]
    prompts = _prompts(5, [4, 17, 33])
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5)
    with _llm(path) as llm:
        for p, o in zip(prompts, llm.generate(prompts, params), strict=True):
            comp = o.outputs[0]
            assert comp.token_ids == hf_greedy(hf, p, 10)
            with torch.no_grad():
                logits = hf(torch.tensor([p + comp.token_ids])).logits[0].float()
            assert logits.abs().max() <= 2.0  # the cap is in force
            ref = torch.log_softmax(logits, dim=-1)
            for i, tok in enumerate(comp.token_ids):
                row = ref[len(p) - 1 + i]
                assert abs(comp.logprobs[i][tok].logprob - row[tok].item()) < 1e-4
                top = row.topk(5)
                for tid, val in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                    assert tid in comp.logprobs[i] and abs(comp.logprobs[i][tid].logprob - val) < 1e-4


def test_deterministic_mode_is_refused_with_the_reason(gemma):
    with pytest.raises(ValueError, match="deterministic mode cannot serve Gemma3ForCausalLM"):
        _llm(gemma["plain"][0], deterministic=True)


@pytest.mark.parametrize(("override", "message"), [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(hidden_activation="silu"), "activation"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                           "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}),
     "dynamic"),
])
def test_unsupported_configs_are_refused_by_name(override, message):
    from transformers import Gemma3TextConfig

    from deepinfer.layers.torch_attention import TorchAttentionBackend
    from deepinfer.models import build_model

    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16, num_hidden_layers=2, sliding_window=8, **override)
    cfg.architectures = ["Gemma3ForCausalLM"]
    with pytest.raises(ValueError, match=message):
        build_model(cfg, TorchAttentionBackend(torch.device("cpu")), 64, torch.float32, torch.device("cpu"))
