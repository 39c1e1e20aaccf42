"""A tiny random Qwen3-MoE written as a real GGUF file (llama.cpp's `qwen3moe` layout) with the `gguf`
package, its projections and stacked routed experts quantized by `gguf.quants` (Q8_0 or Q4_1), norms and
the router float32, and the default model's tokenizer copied in. Used by the MoE GGUF tests and
`benchmarks/moe_gguf.py`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# every layer sparse (a GGUF has no mlp_only_layers); widths multiples of 32 (GGUF blocks)
TINY_QWEN3_MOE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=96, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, num_hidden_layers=2)
_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                   "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                   "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template")


def write_qwen3_moe_gguf(path: Path, quant: str, seed: int = 0, tokenizer: bool = True, skew: bool = False,
                         **overrides) -> Path:
    """A random Qwen3-MoE (TINY_QWEN3_MOE with `overrides`) as a GGUF file at `path`; `quant`: "q8_0" or
    "q4_1" for the attention projections, the experts and the LM head. `tokenizer`: copy the default model's
    (49152 tokens; reading that file takes seconds), else a 256-token vocabulary and no tokenizer (enough
    for `gguf_kernels`' reader, not for loading the model). `skew`: each router biased so that experts 0
    and 2 (or 1 and 3: the sign of x . u decides) are every token's top two, all on rank 0 under EP=2."""
    import gguf
    from gguf.quants import quantize

    from deepinfer.weights import default_model_path

    spec = {**TINY_QWEN3_MOE, **overrides}
    src = gguf.GGUFReader(str(default_model_path())) if tokenizer else None
    vocab = len(src.fields["tokenizer.ggml.tokens"].data) if src is not None else 256
    h, i_moe, e = spec["hidden_size"], spec["moe_intermediate_size"], spec["num_experts"]
    heads, kv, hd = spec["num_attention_heads"], spec["num_key_value_heads"], spec["head_dim"]
    rng = np.random.default_rng(seed)
    qtype = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_1": gguf.GGMLQuantizationType.Q4_1}[quant]

    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name("tiny-qwen3-moe")
    w.add_context_length(1024)
    w.add_embedding_length(h)
    w.add_block_count(spec["num_hidden_layers"])
    w.add_feed_forward_length(spec["intermediate_size"])
    w.add_expert_feed_forward_length(i_moe)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(e)
    w.add_expert_used_count(spec["num_experts_per_tok"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quant == "q8_0" else gguf.LlamaFileType.MOSTLY_Q4_1)
    for key in _TOKENIZER_KEYS if src is not None else ():
        f = src.fields.get(key)
        if f is None:
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_array(key, f.contents())
        else:
            w.add_key_value(key, f.contents(), vt)

    def normal(*shape: int, std: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def q(name: str, a: np.ndarray) -> None:
        w.add_tensor(name, quantize(a, qtype), raw_dtype=qtype)

    def f32(name: str, a: np.ndarray) -> None:
        w.add_tensor(name, a)

    f32("token_embd.weight", normal(vocab, h))
    for b in range(spec["num_hidden_layers"]):
        p = f"blk.{b}."
        f32(p + "attn_norm.weight", 1 + normal(h, std=0.3))
        f32(p + "ffn_norm.weight", 1 + normal(h, std=0.3))
        f32(p + "attn_q_norm.weight", 1 + normal(hd, std=0.3))
        f32(p + "attn_k_norm.weight", 1 + normal(hd, std=0.3))
        q(p + "attn_q.weight", normal(heads * hd, h))
        q(p + "attn_k.weight", normal(kv * hd, h))
        q(p + "attn_v.weight", normal(kv * hd, h))
        q(p + "attn_output.weight", normal(h, heads * hd))
        router = normal(e, h, std=0.3)
        if skew:
            u = rng.standard_normal(h).astype(np.float32)
            u = 6 * u / np.linalg.norm(u)
            router *= 0.1
            router[0] += u
            router[2] += 0.9 * u
            router[1] -= u
            router[3] -= 0.9 * u
        f32(p + "ffn_gate_inp.weight", router)
        q(p + "ffn_gate_exps.weight", normal(e, i_moe, h))
        q(p + "ffn_up_exps.weight", normal(e, i_moe, h))
        q(p + "ffn_down_exps.weight", normal(e, h, i_moe))
    f32("output_norm.weight", 1 + normal(h, std=0.3))
    q("output.weight", normal(vocab, h))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_from_gguf(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' own reading of the file (its GGUF reader ignores `expert_feed_forward_length`: the
    expert width is passed as the config override a user would give)."""
    import gguf
    from transformers import AutoModelForCausalLM

    width = gguf.GGUFReader(str(path)).fields["qwen3moe.expert_feed_forward_length"].contents()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype,
                                                 moe_intermediate_size=int(width))
    model.generation_config.eos_token_id = None
    return model.eval()
