"""DeepSeek-V4's KV compressors and the Lightning Indexer's scoring (paper sections 2.3.1-2.3.2).

A compressor projects every token to kv and gate rows; each complete group of `ratio` tokens pools
its rows into one compressed entry: softmax over the group's tokens of (gate + position bias),
weighted sum of kv, RMSNorm, then RoPE at the group's first position. HCA pools one group's rows
(width `ratio`); CSA's rows are twice as wide and entry w pools the previous group's first half with
its own group's second half (width 2 * ratio, stride `ratio`); entry 0 has no previous group and
gives those slots zero weight. The indexer has a CSA-style compressor of its own (at
`index_head_dim`) and scores each query against its compressed keys:
sum_h w_{t,h} * relu(q_{t,h} . k_s) / sqrt(index_head_dim).

Here compressors only project and pool: the rows of tokens whose group is still incomplete live in the
`CompressorWindow` cache and the entries in the `Compressed` cache (see kv.py), so a group may be
completed in a later step than the one that projected its first tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.layers.linear import Linear


class Rope:
    """One rope type's inverse frequencies: cos / sin [N, rd / 2] for any positions, computed like the
    reference (positions times inv_freq in float32, times the attention scaling)."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype) -> None:
        self.inv_freq, self.scaling, self.dtype = inv_freq.float(), scaling, dtype

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)
        return (freqs.cos() * self.scaling).to(self.dtype), (freqs.sin() * self.scaling).to(self.dtype)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x in interleaved pairs (2i, 2i + 1) by angle i;
    cos / sin broadcast against x[..., :rd // 2]. The leading (no-position) channels pass through."""
    rd = 2 * cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:].float()
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    cos, sin = cos.float(), sin.float()
    rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference's RMSNorm: normalise in float32, multiply by the (float32) weight, cast once."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


class Compressor(nn.Module):
    """Projects tokens to compressor rows and pools complete groups of them into entries."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.ratio, self.overlap, self.eps = dim, ratio, overlap, eps
        self.wkv = Linear(hidden, width, bias=False)
        self.wgate = Linear(hidden, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, width))  # per-position gate bias within a group
        self.norm = nn.Parameter(torch.ones(dim))

    @property
    def row_width(self) -> int:
        """Features one token stores in the compressor-row cache: kv then gate."""
        return 2 * self.wkv.out_features

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.wkv(x), self.wgate(x)], dim=-1)

    def pool(self, rows: torch.Tensor, valid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """rows [N, span, row_width] of the tokens each entry pools (span = 2 * ratio with overlap),
        valid [N, span]; cos / sin [N, rd / 2] at the entries' positions -> entries [N, dim]."""
        m, d = self.ratio, self.dim
        width = self.wkv.out_features
        kv, gate = rows[..., :width], rows[..., width:]
        bias = self.ape.to(gate.dtype)
        if self.overlap:
            # first half: the previous group's first-series features; second half: this group's second series
            gate = gate + torch.cat([bias, bias], dim=0)
            kv = torch.cat([kv[:, :m, :d], kv[:, m:, d:]], dim=1)
            gate = torch.cat([gate[:, :m, :d], gate[:, m:, d:]], dim=1)
        else:
            gate = gate + bias
        gate = gate.masked_fill(~valid[..., None], float("-inf"))
        kv = kv.masked_fill(~valid[..., None], 0.0)
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
        return rope_interleaved(rms_norm(pooled, self.norm, self.eps), cos, sin)


class Indexer(nn.Module):
    """The Lightning Indexer: its own overlapping compressor, query projection and head weights."""

    def __init__(self, cfg, ratio: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.topk = cfg.index_topk
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, ratio, True, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.weights_proj = Linear(cfg.hidden_size, self.num_heads, bias=False)

    def queries(self, q_low: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per new token: roped index queries [T, heads, dim] and head weights [T, heads] (float32)."""
        q = self.wq_b(q_low).view(x.shape[0], self.num_heads, self.head_dim)
        q = rope_interleaved(q, cos.unsqueeze(1), sin.unsqueeze(1))
        return q, self.weights_proj(x).float() * self.num_heads ** -0.5

    def select(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """q [B, Q, H, I], w [B, Q, H], keys [B, C, I], visible [B, Q, C] -> the entries each query attends
        [B, Q, C] bool: the top `index_topk` visible ones by index score."""
        scores = torch.relu(torch.einsum("bqhi,bci->bqhc", q.float(), keys.float())) * self.head_dim ** -0.5
        total = (scores * w.unsqueeze(-1)).sum(dim=2).masked_fill(~visible, float("-inf"))
        k = min(self.topk, total.shape[-1])
        picked = torch.zeros_like(visible)
        picked.scatter_(-1, total.topk(k, dim=-1).indices, True)
        return picked & visible
