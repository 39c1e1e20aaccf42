"""Qwen3-MoE and Mixtral beyond the shared tiny-arch suite (which runs `qwen3_moe` and `mixtral`): Mixtral with
a sliding window, Qwen3-MoE with every other layer sparse and unnormalised weights, weight loading, and
the modes MoE models refuse."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from tests.conftest import TINY_ARCHS, _build_tiny, hf_greedy
from tests.models.test_models_vs_hf import _prompts

VARIANTS = {
    # a sliding window of 12 tokens on every layer: one SlidingWindow KV group
    "mixtral_swa": {**TINY_ARCHS["mixtral"], "sliding_window": 12},
    # layers 1 and 3 sparse (decoder_sparse_step=2), top-3 weights not renormalised
    "qwen3_moe_step2": {**TINY_ARCHS["qwen3_moe"], "decoder_sparse_step": 2, "mlp_only_layers": [],
                        "norm_topk_prob": False, "num_experts_per_tok": 3, "num_hidden_layers": 4},
}


@pytest.fixture(scope="module")
def variants(tmp_path_factory, tokenizer_dir):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe")
    out = {}
    for name, spec in VARIANTS.items():
        path = _build_tiny(name, root, tokenizer_dir, spec)
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        out[name] = (path, hf)
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_transformers(name, variants):
    """Prompts longer than the window, chunked (16-token steps), with decodes past the window."""
    path, hf = variants[name]
    prompts = _prompts(11, [3, 30, 45])
    with LLM(str(path), dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=16) as llm:
        if name == "mixtral_swa":
            assert [type(g.spec).__name__ for g in llm.engine.core.runner.kv_groups] == ["SlidingWindow"]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 16)


def _ours(path):
    from transformers import AutoConfig

    from deepinfer.layers.torch_attention import TorchAttentionBackend
    from deepinfer.models import build_model

    cfg = AutoConfig.from_pretrained(str(path))
    return build_model(cfg, TorchAttentionBackend(torch.device("cpu")), 256, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_loads_checkpoint_and_transformers_stacked_names(arch, tiny_models, hf_models):
    """Per-expert checkpoint tensors and transformers' in-memory stacked ones (experts.gate_up_proj /
    down_proj) load the same values; a missing expert tensor is named."""
    from deepinfer.weights import resolve_model

    files = resolve_model(tiny_models[arch])
    a, b = _ours(tiny_models[arch]), _ours(tiny_models[arch])
    a.load_weights(files.iter_weights(torch.float32))
    b.load_weights(hf_models[arch].state_dict().items())
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb), na
    stacked = b.layers[0].mlp.experts
    assert stacked.local_experts == tuple(range(stacked.num_experts))
    hf_experts = hf_models[arch].model.layers[0].mlp.experts
    assert torch.equal(stacked.w13, hf_experts.gate_up_proj) and torch.equal(stacked.w2, hf_experts.down_proj)
    dropped = [(n, t) for n, t in files.iter_weights(torch.float32)
               if not n.endswith("layers.0.mlp.experts.1.up_proj.weight")
               and not n.endswith("layers.0.block_sparse_moe.experts.1.w3.weight")]
    with pytest.raises(ValueError, match="missing layer 0's expert tensors"):
        _ours(tiny_models[arch]).load_weights(dropped)


def test_deterministic_needs_kernel_widths_and_fused_decode_off(tiny_models):
    # --deterministic multiplies every expert with the row-invariant kernel (K a multiple of 32): the tiny
    # Qwen3-MoE's experts are 40 wide (tests/models/test_qwen3_moe_gguf.py runs one that fits)
    with pytest.raises(ValueError, match="deterministic mode cannot serve layers.0.mlp.experts: the row-invariant"):
        LLM(str(tiny_models["qwen3_moe"]), dtype="float32", kv_cache_memory="16MiB", deterministic=True)
    assert _ours(tiny_models["mixtral"]).enable_fused_decode() is False
