"""Paged attention for CPU (and a portable fallback on CUDA).

On x86 CPUs every new token of a full-attention layer, prefill or decode, is one row of the
C kernel in `paged_attention.c`, which reads K/V from the blocks in place and attends to the
row's own context (its sequence's positions up to its own). Prefill runs there too because
torch's CPU flash attention reaches ~30-40 GFLOP/s on prompt-sized problems, where the kernel
spends 15-20% less CPU on a whole prefill step (BENCHMARKS.md, "Prefill attention on the decode
kernel"); and a token's attention output then never depends on chunking or batching, which
`--deterministic` relies on.

Elsewhere (no kernel: CUDA, other CPUs, unsupported shapes) the blocks of all decoding
sequences are gathered block-wise into one padded [B, blocks * block_size] view and attended
in a single SDPA call (grouped query heads folded into the query dimension, so no K/V repeat),
and each prefill chunk is one SDPA call over its gathered context, causal with the chunk's
offset. Sliding-window layers always take the SDPA path (`_prepare_window`). Only blocks the
batch references are read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.layers import cpu_kernels
from deepinfer.layers.attention import AttentionBackend, AttentionBatch


@dataclass
class _PrefillChunk:
    start: int  # token range in the flattened batch
    end: int
    block_table: torch.Tensor  # [num_blocks]
    context_len: int
    mask: torch.Tensor | None  # [q, context] bool, None when the chunk starts at position 0 (plain causal)


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [B, max_blocks]
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool, None if no padding
    decode_context_lens: torch.Tensor | None  # [B] int64: set for the C kernel's rows (then no prefills)
    prefills: list[_PrefillChunk]


def _kernel_supports(dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    """The limits compiled into paged_attention.c (query heads per kv head <= 64 is checked per call)."""
    return cpu_kernels.dtype_code(dtype) is not None and block_size <= 64 and head_dim % 8 == 0 and head_dim <= 256


def _last_keys(batch: AttentionBatch, row: int, first_pos: int, q: int) -> torch.Tensor:
    """The last key position each of the `q` queries of a sequence (flattened rows row.., positions
    first_pos..) attends to: its own, or its horizon (`AttentionBatch.horizons`)."""
    if batch.horizons is None:
        return torch.arange(first_pos, first_pos + q)
    return torch.tensor(batch.horizons[row:row + q])


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, device: torch.device, use_cpu_kernel: bool = True, row_invariant: bool = False) -> None:
        """`use_cpu_kernel=False` keeps decodes on the gather + SDPA path (tests compare the two);
        `row_invariant` runs every token as a decode row (ValueError where the C kernel is unavailable)."""
        self.device = device
        self.kernels = cpu_kernels.load_library() if device.type == "cpu" and use_cpu_kernel else None
        self.row_invariant = row_invariant
        if row_invariant and self.kernels is None:
            raise ValueError("deterministic mode needs the C attention kernel (an x86-64 CPU with AVX2 and gcc)")

    def allocate_cache(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        if self.kernels is not None and not _kernel_supports(dtype, block_size, head_dim):
            if self.row_invariant:
                raise ValueError("deterministic mode needs float32/bfloat16, block_size <= 64 and a head_dim "
                                 "that is a multiple of 8 (the C attention kernel's limits)")
            self.kernels = None
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(num_layers)]

    def prepare(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        if batch.window is not None:
            if self.row_invariant:
                raise ValueError("deterministic mode does not serve sliding-window layers yet")
            return self._prepare_window(batch)
        if self.kernels is not None:
            return self._prepare_rows(batch)
        bs, dev = batch.block_size, self.device
        nd = batch.num_decodes
        decode_tables = decode_mask = None
        if nd:
            lens = batch.context_lens[:nd]
            max_blocks = (max(lens) + bs - 1) // bs
            # each decode's blocks, padded with block 0 (masked out)
            decode_tables = torch.tensor([t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks]))
                                          for t in batch.block_tables[:nd]], dtype=torch.long).to(dev)
            if min(lens) != max_blocks * bs:
                pos = torch.arange(max_blocks * bs)
                decode_mask = (pos[None, :] < torch.tensor(lens)[:, None]).view(nd, 1, 1, -1).to(dev)
        prefills = []
        start = nd
        for i in range(nd, len(batch.query_lens)):
            q, ctx = batch.query_lens[i], batch.context_lens[i]
            n = (ctx + bs - 1) // bs
            table = torch.tensor(batch.block_tables[i][:n], dtype=torch.long, device=dev)
            mask = None
            if ctx != q or batch.horizons is not None:  # query j sees keys <= its horizon (offset + j: causal)
                mask = (torch.arange(ctx)[None, :] <= _last_keys(batch, start, ctx - q, q)[:, None]).to(dev)
            prefills.append(_PrefillChunk(start, start + q, table, ctx, mask))
            start += q
        return TorchAttentionMetadata(batch.slot_mapping, nd, decode_tables, decode_mask, None, prefills)

    def _prepare_window(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        """Sliding window: every sequence, decodes included, as one SDPA chunk over the blocks from the
        one holding its first query's earliest key, masked to each query's window."""
        bs, dev, w = batch.block_size, self.device, batch.window
        floors = batch.key_floors or [0] * len(batch.query_lens)
        chunks = []
        start = 0
        for q, ctx, table, floor in zip(batch.query_lens, batch.context_lens, batch.block_tables, floors, strict=True):
            first_pos = ctx - q
            lo = max(0, first_pos - w + 1, floor) // bs
            n = (ctx + bs - 1) // bs
            keys = torch.arange(lo * bs, ctx)
            qpos = torch.arange(first_pos, ctx)[:, None]
            last = _last_keys(batch, start, first_pos, q)[:, None]
            mask = ((keys[None, :] <= last) & (keys[None, :] > qpos - w) & (keys[None, :] >= floor)).to(dev)
            chunks.append(_PrefillChunk(start, start + q, torch.tensor(table[lo:n], dtype=torch.long, device=dev),
                                        ctx - lo * bs, mask))
            start += q
        return TorchAttentionMetadata(batch.slot_mapping, 0, None, None, None, chunks)

    def _prepare_rows(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        """Every new token as a decode row: its sequence's block table, context up to its own position."""
        bs = batch.block_size
        max_blocks = (max(batch.context_lens) + batch.lookahead + bs - 1) // bs
        # plain lists and one tensor each: torch calls per sequence cost ~10 us each hot, several times that
        # between model steps (the weights leave the host's caches cold), and a batch has up to max_num_seqs
        tables: list[list[int]] = []
        lens: list[int] = []
        for q, ctx, table in zip(batch.query_lens, batch.context_lens, batch.block_tables, strict=True):
            tables.append(table[:max_blocks] + [0] * (max_blocks - len(table[:max_blocks])))  # padding never read
            lens.extend(range(ctx - q + 1, ctx + 1))
        if batch.horizons is not None:
            lens = [h + 1 for h in batch.horizons]
        decode_tables = torch.tensor(tables, dtype=torch.long)
        if len(lens) != len(tables):  # a sequence with several rows (drafts, prefill tokens): its table per row
            decode_tables = decode_tables.repeat_interleave(torch.tensor(batch.query_lens), dim=0)
        return TorchAttentionMetadata(batch.slot_mapping, decode_tables.shape[0], decode_tables, None,
                                      torch.tensor(lens, dtype=torch.long), [])

    def forward(self, q, k, v, cache, meta: TorchAttentionMetadata, scale: float | None = None):
        k_cache, v_cache = cache
        num_blocks, bs, kvh, d = k_cache.shape
        k_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, v)
        if meta.decode_context_lens is not None:
            return self._kernel_rows(q.contiguous(), k_cache, v_cache, meta, scale)
        # gathering whole blocks as rows of a 2-D view is ~7x faster than index_select on the 4-D cache
        k_rows, v_rows = k_cache.view(num_blocks, -1), v_cache.view(num_blocks, -1)
        heads = q.shape[1]
        group = heads // kvh
        nd = meta.num_decodes
        out = q.new_empty(q.shape) if meta.prefills else None
        if nd:
            tables = meta.decode_block_tables
            keys = k_rows.index_select(0, tables.view(-1)).view(nd, -1, kvh, d).transpose(1, 2)
            values = v_rows.index_select(0, tables.view(-1)).view(nd, -1, kvh, d).transpose(1, 2)
            qd = q[:nd].view(nd, kvh, group, d)
            o = F.scaled_dot_product_attention(qd, keys, values, attn_mask=meta.decode_mask, scale=scale)
            if out is None:
                return o.reshape(nd, heads, d)
            out[:nd] = o.reshape(nd, heads, d)
        for chunk in meta.prefills:
            ctx = chunk.context_len
            keys = k_rows.index_select(0, chunk.block_table).view(-1, kvh, d)[:ctx].transpose(0, 1)
            values = v_rows.index_select(0, chunk.block_table).view(-1, kvh, d)[:ctx].transpose(0, 1)
            qp = q[chunk.start:chunk.end].transpose(0, 1)  # [heads, q, d]
            o = F.scaled_dot_product_attention(
                qp.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                attn_mask=chunk.mask, is_causal=chunk.mask is None, enable_gqa=group > 1, scale=scale,
            )
            out[chunk.start:chunk.end] = o[0].transpose(0, 1)
        return out

    def attend_cached_rows(self, q: torch.Tensor, cache, meta: TorchAttentionMetadata,
                           scale: float | None = None) -> torch.Tensor:
        """Attention of a step's rows whose new K/V the caller already wrote to their slots
        (layers/batched_decode.py does it in the pass that rotates them): q [rows, heads, D] contiguous;
        the C kernel path only (`meta.decode_context_lens` set)."""
        k_cache, v_cache = cache
        return self._kernel_rows(q, k_cache, v_cache, meta, scale)

    def _kernel_rows(self, q, k_cache, v_cache, meta: TorchAttentionMetadata,
                     scale: float | None = None) -> torch.Tensor:
        """Every row of `q` attends to its own context through the C kernel."""
        rows, heads, d = q.shape
        _, bs, kvh, _ = k_cache.shape
        scale = d ** -0.5 if scale is None else scale
        out = torch.empty_like(q)
        rc = self.kernels.paged_decode_attention(
            q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            meta.decode_block_tables.data_ptr(), meta.decode_block_tables.shape[1],
            meta.decode_context_lens.data_ptr(), rows, heads, kvh, d, bs, scale,
            cpu_kernels.dtype_code(q.dtype), 0, None)
        if rc != 0:
            raise RuntimeError("paged_decode_attention rejected its arguments")
        return out
