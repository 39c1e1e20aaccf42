"""Gemma 3 (text): the Llama layout with Gemma's differences, and local + global attention layers.

What differs from `llama.py`:
- every RMSNorm scales by (1 + w) in float32 (`GemmaRMSNorm`), and there are four per layer: the attention
  and MLP outputs are normed (post-attention, post-feedforward) before they join the residual stream, the
  MLP input has its own (pre-feedforward) norm; queries and keys get per-head norms too;
- the embedding is multiplied by sqrt(hidden_size), rounded to the model dtype first;
- the MLP is GELU (tanh approximation) gated;
- attention scores are scaled by `query_pre_attn_scalar ** -0.5` instead of head_dim ** -0.5;
- `layer_types` mixes "sliding_attention" layers (a window of `sliding_window` tokens, RoPE from
  `rope_parameters["sliding_attention"]`, base 10k) with "full_attention" layers (RoPE from
  `rope_parameters["full_attention"]`, base 1M, with rope scaling where configured); the two kinds are two
  KV layer groups (`kv_groups`: `SlidingWindow(w)` and `FullAttention`);
- the final logits are soft-capped (cap * tanh(logits / cap)) when `final_logit_softcapping` is set.

The whole-layer C decode path (`layers/fused_decode.py`) is Llama's layer and never runs here; small decode
steps take the per-layer path, with projections from GGUF blocks where the file has Q4_1 / Q8_0 ones.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepinfer.layers.activation import gelu_tanh_and_mul
from deepinfer.layers.attention import AttentionBackend
from deepinfer.layers.linear import Linear
from deepinfer.layers.norm import GemmaRMSNorm
from deepinfer.layers.rotary import RotaryEmbedding
from deepinfer.models.llama import DecoderAttention, LlamaForCausalLM

LAYER_TYPES = ("sliding_attention", "full_attention")
GELU_TANH = ("gelu_pytorch_tanh", "gelu_python_tanh")


def check_config(cfg) -> None:
    """Refuse, by name, what this implementation does not compute."""
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"attn_logit_softcapping={cfg.attn_logit_softcapping} is not supported: the paged attention "
            "(SDPA and the C decode kernel) has no score soft-cap (Gemma 3 checkpoints do not set it; Gemma 2's do)")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True (an embedding model) is not supported: deepinfer "
                         "serves causal language models")
    if getattr(cfg, "attention_bias", False):
        raise ValueError("attention_bias=True is not supported for Gemma 3 (its checkpoints have no biases)")
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
    if act not in GELU_TANH:
        raise ValueError(f"unsupported Gemma 3 activation {act!r} (expected one of {', '.join(GELU_TANH)})")
    bad = sorted(set(cfg.layer_types) - set(LAYER_TYPES))
    if bad:
        raise ValueError(f"unsupported Gemma 3 layer types {bad}")
    for kind in LAYER_TYPES:
        rope = (getattr(cfg, "rope_parameters", None) or {}).get(kind) or {}
        if rope.get("rope_type", "default") in ("dynamic", "longrope"):
            raise ValueError(f"rope_type {rope['rope_type']!r} ({kind}) rescales with the sequence length at run "
                             "time, which the precomputed rotary tables here do not do")


class GeluGatedMLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = DecoderAttention(cfg, backend, bias=False, qk_norm=True, norm_cls=GemmaRMSNorm,
                                          scale=cfg.query_pre_attn_scalar ** -0.5)
        self.mlp = GeluGatedMLP(cfg)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any, meta: Any) -> torch.Tensor:
        """x: the residual stream [T, hidden]; returns it after this layer."""
        h = self.self_attn(self.input_layernorm(x), cos, sin, cache, meta)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text models (`Gemma3ForCausalLM`, model_type "gemma3_text"): 270M, 1B, and the text tower's
    layout of the larger ones. Weight loading and GGUF block attachment are Llama's (same HF names)."""

    # read by the runner: --deterministic needs every op of a step to be row-invariant; its whole-layer C
    # path is Llama's layer and its attention kernel has no sliding window
    deterministic_unsupported = ("the row-invariant C kernels compute Llama's decoder layer (not Gemma's four "
                                 "norms and GELU MLP) and have no sliding-window attention")

    def __init__(self, cfg, backend: AttentionBackend, max_positions: int, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        check_config(cfg)
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # HF keeps sqrt(hidden) as a float32 tensor and rounds it to the weights' dtype when it multiplies
        # (bf16: sqrt(640) = 25.298 becomes 25.25); `build_model`'s .to(dtype) does that rounding here
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32),
                             persistent=False)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, backend) for _ in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        # one rotary table per layer type (local: base 10k; global: base 1M, scaled where configured)
        self.layer_types = list(cfg.layer_types)
        self.rotary = nn.ModuleDict({t: RotaryEmbedding(cfg, max_positions, dtype, layer_type=t)
                                     for t in sorted(set(self.layer_types))})
        self.fused = None
        self.batched = None
        self._set_kv_groups(cfg, max_positions)

    def enable_fused_decode(self) -> bool:
        """Off: the whole-layer C decode kernel computes Llama's layer (one norm before attention and one
        before the MLP, SiLU, one KV group), not Gemma's; small decodes run the per-layer path."""
        self.fused = None
        return False

    def enable_batched_decode(self) -> bool:
        """Off, for the same reason as `enable_fused_decode` (its hidden_states never consults it)."""
        self.batched = None
        return False

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float() if float32 else logits

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[Any], metas: list[Any],
                      logits_indices: torch.Tensor,
                      input_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """As Llama's; `input_embeds` rows (an image's vectors) replace the scaled token embeddings unscaled."""
        x = self.embed_tokens(input_ids) * self.embed_scale
        if input_embeds is not None:
            x[input_embeds[0]] = input_embeds[1].to(x.dtype)
        rope = {t: r.lookup(positions) for t, r in self.rotary.items()}
        for layer, kind, cache, gi in zip(self.layers, self.layer_types, caches, self.layer_group, strict=True):
            cos, sin = rope[kind]
            x = layer(x, cos, sin, cache, metas[gi])
        return self.norm(x[logits_indices])
