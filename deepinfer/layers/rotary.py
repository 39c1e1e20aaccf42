"""Rotary position embedding with a precomputed cos/sin table indexed by position.

The inverse frequencies come from transformers' rope initialisers, so every
`rope_type` transformers knows (default, linear, llama3, yarn, ...) is computed
the way the reference computes it.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.layers import cpu_kernels


def rope_inv_freq(hf_config, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling. `layer_type`: configs with RoPE parameters per layer
    type (Gemma 3: `rope_parameters = {"sliding_attention": {...}, "full_attention": {...}}`) pick one."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params.get(layer_type) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        dim = int(dim * params.get("partial_rotary_factor", 1.0))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    # on the CPU whatever device a model is built under (`torch.device(...)` as a context): transformers' functions
    # make some tensors on the default device and move them to `device`, which fails from the meta device
    with torch.device("cpu"):
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **kwargs)
    return inv_freq.float().to(torch.empty(0).device), float(scaling)


class RotaryEmbedding(nn.Module):
    """Holds cos/sin for positions [0, max_positions); `lookup(positions)` returns the rows a step needs."""

    def __init__(self, hf_config, max_positions: int, dtype: torch.dtype, layer_type: str | None = None) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(hf_config, layer_type)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows of the step's positions: [T, D] each, contiguous."""
        return self.cos[positions], self.sin[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] in HF's half-rotation layout; cos, sin: [T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] by cos, sin [T, D]; in place with the CPU kernel
    (q and k may be row-strided views into the fused QKV output), out of place otherwise."""
    kernels = cpu_kernels.kernels_for(q)
    d = q.shape[-1]
    if kernels is not None and d % 16 == 0 and cos.shape[-1] == d and cos.dtype == q.dtype and k.dtype == q.dtype \
            and cos.is_contiguous() and sin.is_contiguous() \
            and q.stride(2) == 1 and q.stride(1) == d and k.stride(2) == 1 and k.stride(1) == d:
        lib, code = kernels
        lib.rotary_qk(q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0), k.shape[1], q.shape[0], d,
                      cos.data_ptr(), sin.data_ptr(), code)
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
