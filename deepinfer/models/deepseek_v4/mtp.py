"""DeepSeek-V4's multi-token-prediction (MTP) layer: from the target's last residual streams at position i
and the embedding of token i + 1, the logits of token i + 2.

Structure (DeepSeek's published V4 inference code, `inference/model.py`, class `MTPBlock(Block)`; the
same as V3's MTP module with V4's hyper-connections):

    e = enorm(embed(token[i + 1]))                 # embedding and LM head shared with the target
    x = e_proj(e) + h_proj(hnorm(streams[i]))      # per residual stream: streams [T, hc_mult, D]
    x = Block(x)                                   # one full V4 layer: hyper-connected attention + MoE
    logits = head(norm(hc_head(x)))                # its own hc_head_fn / base / scale and norm

The block is layer number `num_hidden_layers` of the stack (the MTP layers follow the main ones), a
top-k routed MoE (hash routing is for the first layers only) with sliding-window attention and no
compressor (the published checkpoints hold no compressor or indexer tensors under `mtp.*`). Its window
K=V is the layer's own KV, owned by whoever runs it (the MTP proposer's pool). Drafting more than one
token chains the layer: its output streams stand in for the target's at the next position.

Checkpoint names: `mtp.{k}.e_proj.weight`, `mtp.{k}.h_proj.weight`, `mtp.{k}.enorm.weight`,
`mtp.{k}.hnorm.weight`, `mtp.{k}.norm.weight`, `mtp.{k}.hc_head_{fn,base,scale}`, and the block's tensors
under the main layers' names (`mtp.{k}.attn.wq_a.weight`, `mtp.{k}.ffn.experts.E.w1.weight`,
`mtp.{k}.hc_attn_fn`, ...). transformers' DeepseekV4 ignores `mtp.*` on load, so there is no external
implementation of the MTP logits to compare with: the block and head are deepinfer's V4 modules (checked
against transformers in tests/models/test_deepseek_v4.py); the wiring here follows the reference code.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from deepinfer.kvcache.spec import SlidingWindow
from deepinfer.layers.attention import AttentionBatch
from deepinfer.layers.linear import Linear
from deepinfer.models.deepseek_v4.compressor import rms_norm
from deepinfer.models.deepseek_v4.hyper import HyperHead
from deepinfer.models.deepseek_v4.kv import build_step_meta
from deepinfer.models.deepseek_v4.model import V4Layer, _our_name

MTP_LAYER_TYPE = "sliding_attention"
_OWN = {"e_proj.weight": "e_proj.weight", "h_proj.weight": "h_proj.weight", "enorm.weight": "enorm",
        "hnorm.weight": "hnorm", "norm.weight": "norm", "hc_head_fn": "hc_head.hc_fn",
        "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}


def num_mtp_layers(cfg) -> int:
    return int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)


class V4MTPLayer(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.block = V4Layer(cfg, MTP_LAYER_TYPE, "moe")
        self.e_proj = Linear(d, d, bias=False)
        self.h_proj = Linear(d, d, bias=False)
        self.enorm = nn.Parameter(torch.ones(d))
        self.hnorm = nn.Parameter(torch.ones(d))
        self.norm = nn.Parameter(torch.ones(d))
        self.hc_head = HyperHead(cfg.hc_mult, d, cfg.hc_eps, cfg.rms_norm_eps)
        self.eps = cfg.rms_norm_eps
        self.window = int(cfg.sliding_window)
        self.kv_spec = SlidingWindow(self.window)

    def allocate_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> dict:
        return {"window": torch.zeros(num_blocks, block_size, self.block.attn.head_dim, dtype=dtype, device=device)}

    def prepare(self, batch: AttentionBatch, device: torch.device):
        """The step metadata of the MTP layer's one KV group (its window) from an `AttentionBatch`."""
        return build_step_meta([self.kv_spec], [batch], device)

    def forward(self, streams: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, target,
                cache: dict, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [T, hc, D]: the target's (or the previous MTP step's) last streams at `positions`;
        next_ids [T]: the token after each position. Returns (logits [T, vocab] of the token after
        next_ids, the layer's output streams [T, hc, D]). `target`: the DeepseekV4ForCausalLM whose
        embedding, LM head and RoPE tables the layer shares."""
        e = rms_norm(target.embed_tokens(next_ids), self.enorm, self.eps)
        h = rms_norm(streams, self.hnorm, self.eps)
        x = self.e_proj(e).unsqueeze(1) + self.h_proj(h)
        step_rope = {label: rope(positions) for label, rope in target.ropes.items()}
        x = self.block(x, next_ids, step_rope, target.ropes, cache, meta)
        logits = target.compute_logits(rms_norm(self.hc_head(x), self.norm, self.eps))
        return logits, x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], index: int = 0) -> int:
        """Copy the `mtp.{index}.*` tensors of a checkpoint in (others are skipped); raises on a missing or
        unknown one. Returns how many were loaded (0: the checkpoint has no such MTP layer)."""
        params = dict(self.named_parameters())
        persistent = set(self.state_dict())
        params.update((n, b) for n, b in self.named_buffers() if n in persistent)
        prefix = f"mtp.{index}."
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            name = ckpt_name.removeprefix("model.")
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            part = None
            if rest in _OWN:
                ours = _OWN[rest]
            else:
                mapped = _our_name(f"layers.0.{rest}")
                if mapped is None:
                    continue
                ours, part = mapped
                ours = "block." + ours.removeprefix("layers.0.")
            if ours not in params:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has no matching MTP parameter")
            dst = params[ours]
            if part is not None:
                expert, proj = part
                dst = self.get_submodule(ours.removesuffix(".w13").removesuffix(".w2")).expert_weight(expert, proj)
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"{ckpt_name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
            with torch.no_grad():
                dst.copy_(tensor)
            loaded.add(ours if part is None else f"{ours}#{part}")
        if not loaded:
            return 0
        missing = [n for n in params if n not in loaded and not any(k.startswith(n + "#") for k in loaded)]
        if missing:
            raise ValueError(f"checkpoint's MTP layer {index} is missing {len(missing)} tensors, e.g. "
                             f"{sorted(missing)[:3]}")
        return len(loaded)
