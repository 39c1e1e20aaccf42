"""DeepSeek-V4 attention: one block of any of the three layer types, over the paged V4 caches.

- Queries through a low-rank path (wq_a -> RMSNorm -> wq_b), each head RMS-normalised without weight.
- One shared K=V head (wkv -> RMSNorm), kept for the last `sliding_window` tokens.
- Partial RoPE, interleaved, on the trailing `rope_dim` channels of q and K=V; sliding-only layers use
  the "main" rope, CSA / HCA layers the "compress" one (YaRN where configured). Since V = K carries
  RoPE, the output's rope channels are rotated back by the query's angle.
- CSA / HCA layers add compressed entries (compressor.py) to every query's keys: HCA all visible
  ones, CSA the indexer's top-k of them.
- A learned per-head sink logit joins each softmax (it takes probability mass, contributes no value).
- Grouped output projection: heads split into `o_groups` groups, each projected to `o_lora_rank`
  (wo_a, block-diagonal), then mixed to the hidden size (wo_b).

Per layer the cache is a dict: "window" [blocks, block_size, head_dim]; with a compressor also
"rows" [blocks, block_size, row features] and "comp" [blocks, entries_per_block, head_dim]; CSA adds
"icomp" [blocks, entries_per_block, index_head_dim] (the indexer's compressed keys).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.layers.linear import Linear
from deepinfer.models.deepseek_v4.compressor import Compressor, Indexer, Rope, rms_norm, rope_interleaved
from deepinfer.models.deepseek_v4.kv import V4StepMeta


class V4Attention(nn.Module):
    def __init__(self, cfg, layer_type: str) -> None:
        super().__init__()
        h, d, hidden = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
        self.num_heads, self.head_dim, self.eps = h, d, cfg.rms_norm_eps
        self.o_groups, self.o_rank = cfg.o_groups, cfg.o_lora_rank
        self.layer_type = layer_type
        self.rope = "main" if layer_type == "sliding_attention" else "compress"
        self.wq_a = Linear(hidden, cfg.q_lora_rank, bias=False)
        self.q_norm = nn.Parameter(torch.ones(cfg.q_lora_rank))
        self.wq_b = Linear(cfg.q_lora_rank, h * d, bias=False)
        self.wkv = Linear(hidden, d, bias=False)
        self.norm = nn.Parameter(torch.ones(d))
        self.wo_a = nn.Parameter(torch.zeros(self.o_groups * self.o_rank, h * d // self.o_groups))
        self.wo_b = Linear(self.o_groups * self.o_rank, hidden, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(h))
        self.ratio = cfg.compress_rates[layer_type] if layer_type != "sliding_attention" else None
        csa = layer_type == "compressed_sparse_attention"
        self.compressor = Compressor(hidden, d, self.ratio, csa, cfg.rms_norm_eps) if self.ratio else None
        self.indexer = Indexer(cfg, self.ratio) if csa else None

    @property
    def row_width(self) -> int:
        if self.compressor is None:
            return 0
        return self.compressor.row_width + (self.indexer.compressor.row_width if self.indexer else 0)

    def forward(self, x: torch.Tensor, step_rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
                ropes: dict[str, Rope], cache: dict, meta: V4StepMeta) -> torch.Tensor:
        """x [T, hidden]: the step's new tokens; step_rope: cos / sin of their positions per rope type;
        ropes: the rope types (for compressed entries' own positions)."""
        t = x.shape[0]
        h, d = self.num_heads, self.head_dim
        cos, sin = step_rope[self.rope]
        q_low = rms_norm(self.wq_a(x), self.q_norm, self.eps)
        q = self.wq_b(q_low).view(t, h, d)
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.eps).to(q.dtype)
        q = rope_interleaved(q, cos.unsqueeze(1), sin.unsqueeze(1))
        kv = rope_interleaved(rms_norm(self.wkv(x), self.norm, self.eps), cos, sin)
        window = cache["window"]
        window.view(-1, d).index_copy_(0, meta.window_slots, kv)
        idx_q = idx_w = None
        if self.compressor is not None:
            self._compress(x, cache, meta, ropes["compress"])
            if self.indexer is not None:
                idx_q, idx_w = self.indexer.queries(q_low, x, *step_rope["compress"])
        out = q.new_empty(t, h, d)
        for seg in meta.segments:
            out[seg.rows[seg.valid]] = self._attend(q, seg, cache, idx_q, idx_w)[seg.valid]
        out = rope_interleaved(out, cos.unsqueeze(1), -sin.unsqueeze(1))
        grouped = out.view(t, self.o_groups, -1).transpose(0, 1)  # [g, T, H*d/g]
        w = self.wo_a.view(self.o_groups, self.o_rank, -1)
        low = torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(t, -1)
        return self.wo_b(low)

    def _compress(self, x: torch.Tensor, cache: dict, meta: V4StepMeta, rope: Rope) -> None:
        """Store the new tokens' compressor rows; pool the groups this step completes into entries."""
        rows = self.compressor.project(x)
        if self.indexer is not None:
            rows = torch.cat([rows, self.indexer.compressor.project(x)], dim=-1)
        flat_rows = cache["rows"].view(-1, rows.shape[-1])
        flat_rows.index_copy_(0, meta.row_slots[self.ratio], rows)
        new = meta.new_entries.get(self.ratio)
        if new is None:
            return
        pooled = flat_rows[new.rows]  # [N, span, features]
        cos, sin = rope(new.positions)
        width = self.compressor.row_width
        cache["comp"].view(-1, self.head_dim).index_copy_(
            0, new.dest, self.compressor.pool(pooled[..., :width], new.valid, cos, sin))
        if self.indexer is not None:
            cache["icomp"].view(-1, self.indexer.head_dim).index_copy_(
                0, new.dest, self.indexer.compressor.pool(pooled[..., width:], new.valid, cos, sin))

    def _attend(self, q: torch.Tensor, seg, cache: dict, idx_q, idx_w) -> torch.Tensor:
        """One padded segment's attention output [B, Q, H, d]."""
        d = self.head_dim
        qs = q[seg.rows]  # [B, Q, H, d]
        keys = cache["window"].view(-1, d)[seg.window_keys]  # [B, K, d]
        mask = seg.window_mask
        comp = seg.compressed.get(self.ratio) if self.ratio else None
        if comp is not None and comp.keys.shape[1]:
            visible = comp.mask
            if self.indexer is not None:
                ikeys = cache["icomp"].view(-1, self.indexer.head_dim)[comp.keys]
                visible = self.indexer.select(idx_q[seg.rows], idx_w[seg.rows], ikeys, visible)
            keys = torch.cat([keys, cache["comp"].view(-1, d)[comp.keys]], dim=1)
            mask = torch.cat([mask, visible], dim=-1)
        logits = torch.einsum("bqhd,bkd->bqhk", qs, keys).float() * d ** -0.5
        logits = logits.masked_fill(~mask.unsqueeze(2), float("-inf"))
        sinks = self.attn_sink.float().view(1, 1, -1, 1).expand(*logits.shape[:3], 1)
        probs = torch.cat([logits, sinks], dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("bqhk,bkd->bqhd", probs.to(keys.dtype), keys)
