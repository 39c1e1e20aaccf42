"""Steps of any size with the work between the matmuls in C: four C calls per decoder layer.

The per-layer torch path (models/llama.py) runs ~15 ops per layer: module calls, the QKV split and
views, rotary, two KV-cache `index_copy_`, the query copy the attention kernel needs, norms, SiLU*mul,
each with Python and dispatch cost, and at 64 rows they took ~12 ms CPU of a ~90 ms step (issue #22).
Here a layer is

    C rms_norm (+ residual add) -> qkv matmul -> C rope_kv_write (rotary on q and k, k and v into
    their cache slots, q into a contiguous buffer) -> C attention kernel -> o matmul ->
    C rms_norm (+ residual add) -> gate_up matmul -> C silu_mul -> down matmul

with the matmuls left to `Linear` (oneDNN's packed weights or panels) and the step's buffers allocated
once; on panels the gate_up matmul applies silu_mul in its tiles (`Linear.silu_mul_into`).
The kernels are the ones the torch path calls (elementwise.c, paged_attention.c), with the same
rounding points, so the output is bit-identical to it. Used for every step whose new tokens are all
rows of the C attention kernel (decodes, and prefill chunks where the kernel serves them, see
layers/torch_attention.py); the whole-layer `FusedDecoder` keeps the few-row GGUF steps, and
sliding-window or q/k-norm models stay on the per-layer path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.layers import cpu_kernels
from deepinfer.layers.linear import Linear
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.torch_attention import TorchAttentionBackend


@dataclass(frozen=True)
class _LayerRefs:
    """One layer's pieces the step loop reads: projections, norm weight pointers, attention scale."""

    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    norm1: int
    norm2: int
    eps1: float
    eps2: float
    scale: float | None


class BatchedDecoder:
    """The batched C-glue path of one Llama-layout model whose feed-forward blocks are all dense gated
    SiLU MLPs (the caller checks that); `supported()` says whether the rest qualifies."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.lib = cpu_kernels.load_library()
        self._layers: list[_LayerRefs] = []

    def supported(self) -> bool:
        m = self.model
        a0 = m.layers[0].self_attn
        dtype = m.embed_tokens.weight.dtype
        if self.lib is None or cpu_kernels.kernels_for(m.embed_tokens.weight) is None:
            return False
        if (a0.head_dim % 16 or m.config.hidden_size % 8 or m.rotary.cos.dtype != dtype
                or m.rotary.cos.shape[-1] != a0.head_dim):
            return False
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            if (a.q_norm is not None or not isinstance(a.backend, TorchAttentionBackend)
                    or a.backend.kernels is None or mlp.intermediate % 8
                    or a.head_dim != a0.head_dim or a.num_heads != a0.num_heads or a.num_kv_heads != a0.num_kv_heads
                    or mlp.intermediate != m.layers[0].mlp.intermediate):
                return False
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(type(n) is not RMSNorm or n.weight.dtype != dtype for n in norms):
                return False
        self._layers = [_LayerRefs(
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
            layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
            float(layer.input_layernorm.eps), float(layer.post_attention_layernorm.eps), layer.self_attn.scale)
            for layer in m.layers]
        return True

    @staticmethod
    def accepts(x: torch.Tensor, meta: Any) -> bool:
        """A step whose every new token is a row of the C attention kernel (any number of rows)."""
        return (getattr(meta, "decode_context_lens", None) is not None and not meta.prefills
                and meta.num_decodes == x.shape[0] and x.is_contiguous())

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list[Any], meta: Any
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """All layers for rows x [M, hidden] (the embedding output, which becomes the residual
        stream and is updated in place); returns (last MLP output, residual) like the layer loop."""
        lib = self.lib
        a0 = self.model.layers[0].self_attn
        backend = a0.backend
        heads, kv_heads, d = a0.num_heads, a0.num_kv_heads, a0.head_dim
        inter = self.model.layers[0].mlp.intermediate
        rows, hidden = x.shape
        code = cpu_kernels.dtype_code(x.dtype)
        cos, sin = cos.contiguous(), sin.contiguous()
        slots = meta.slot_mapping.contiguous()
        residual = x
        h = torch.empty_like(x)
        q = x.new_empty((rows, heads, d))
        act = x.new_empty((rows, inter))
        res_p, h_p, q_p, act_p = residual.data_ptr(), h.data_ptr(), q.data_ptr(), act.data_ptr()
        cos_p, sin_p, slots_p = cos.data_ptr(), sin.data_ptr(), slots.data_ptr()
        q_size = heads * d
        for i, (refs, cache) in enumerate(zip(self._layers, caches, strict=True)):
            lib.rms_norm(x.data_ptr(), None if i == 0 else res_p, refs.norm1, h_p, rows, hidden, refs.eps1, code)
            qkv = refs.qkv.forward(h)
            if not qkv.is_contiguous():
                qkv = qkv.contiguous()
            k_cache, v_cache = cache
            lib.rope_kv_write(qkv.data_ptr(), rows, heads, kv_heads, d, cos_p, sin_p, slots_p,
                              k_cache.data_ptr(), v_cache.data_ptr(), q_p, code)
            attn = backend.attend_cached_rows(q, cache, meta, refs.scale)
            o = refs.o.forward(attn.view(rows, q_size))
            if not o.is_contiguous():
                o = o.contiguous()
            lib.rms_norm(o.data_ptr(), res_p, refs.norm2, h_p, rows, hidden, refs.eps2, code)
            if not refs.gate_up.silu_mul_into(h, act):
                gu = refs.gate_up.forward(h)
                if not gu.is_contiguous():
                    gu = gu.contiguous()
                lib.silu_mul(gu.data_ptr(), act_p, rows, inter, code)
            x = refs.down.forward(act)
            if not x.is_contiguous():
                x = x.contiguous()
        return x, residual
