"""Paged attention for CPU (and a portable fallback on CUDA).

Decodes: on x86 CPUs the C kernel in `paged_attention.c` reads K/V from the blocks in
place. Elsewhere the blocks of all decoding sequences are gathered block-wise into one
padded [B, blocks * block_size] view and attended in a single SDPA call (grouped query
heads folded into the query dimension, so no K/V repeat). Prefill chunks: one SDPA call
each over the chunk's gathered context, causal with the chunk's offset. Only blocks the
batch references are read.

Row-invariant mode (`--deterministic`): every new token, prefill or decode, is one row of the
C decode kernel, attending to its own context in the same order whatever else is in the step,
so a token's attention output never depends on chunking or batching.
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
    decode_context_lens: torch.Tensor | None  # [B] int64 (C kernel only)
    prefills: list[_PrefillChunk]
    shared_blocks: torch.Tensor | None = None  # block ids every decode starts with (C kernel only)


def _kernel_supports(dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    """The limits compiled into paged_attention.c (query heads per kv head <= 64 is checked per call)."""
    return cpu_kernels.dtype_code(dtype) is not None and block_size <= 64 and head_dim % 8 == 0 and head_dim <= 256


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
        if self.row_invariant:
            return self._prepare_rows(batch)
        bs, dev = batch.block_size, self.device
        nd = batch.num_decodes
        decode_tables = decode_mask = decode_lens = shared = None
        if nd:
            lens = batch.context_lens[:nd]
            max_blocks = (max(lens) + bs - 1) // bs
            # each decode's blocks, padded with block 0 (masked out, or never read by the kernel)
            decode_tables = torch.tensor([t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks]))
                                          for t in batch.block_tables[:nd]], dtype=torch.long)
            if self.kernels is not None:
                decode_lens = torch.tensor(lens, dtype=torch.long)
                shared = _shared_prefix_blocks(batch.block_tables[:nd], lens, bs)
            else:
                decode_tables = decode_tables.to(dev)
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
            if ctx != q:  # chunk after cached/computed context: query j sees keys <= offset + j
                offset = ctx - q
                mask = (torch.arange(ctx)[None, :] <= (offset + torch.arange(q))[:, None]).to(dev)
            prefills.append(_PrefillChunk(start, start + q, table, ctx, mask))
            start += q
        return TorchAttentionMetadata(batch.slot_mapping, nd, decode_tables, decode_mask, decode_lens, prefills,
                                      shared)

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
            mask = ((keys[None, :] <= qpos) & (keys[None, :] > qpos - w) & (keys[None, :] >= floor)).to(dev)
            chunks.append(_PrefillChunk(start, start + q, torch.tensor(table[lo:n], dtype=torch.long, device=dev),
                                        ctx - lo * bs, mask))
            start += q
        return TorchAttentionMetadata(batch.slot_mapping, 0, None, None, None, chunks, None)

    def _prepare_rows(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        """Every new token as a decode row: its sequence's block table, context up to its own position."""
        bs = batch.block_size
        max_blocks = (max(batch.context_lens) + bs - 1) // bs
        tables, lens = [], []
        for q, ctx, table in zip(batch.query_lens, batch.context_lens, batch.block_tables, strict=True):
            row = table[:max_blocks] + [0] * (max_blocks - len(table[:max_blocks]))  # padding is never read
            tables.append(torch.tensor(row, dtype=torch.long).expand(q, -1))
            lens.append(torch.arange(ctx - q + 1, ctx + 1, dtype=torch.long))
        decode_tables = torch.cat(tables).contiguous()
        return TorchAttentionMetadata(batch.slot_mapping, decode_tables.shape[0], decode_tables, None,
                                      torch.cat(lens), [], None)

    def forward(self, q, k, v, cache, meta: TorchAttentionMetadata, scale: float | None = None):
        k_cache, v_cache = cache
        num_blocks, bs, kvh, d = k_cache.shape
        # gathering whole blocks as rows of a 2-D view is ~7x faster than index_select on the 4-D cache
        k_rows, v_rows = k_cache.view(num_blocks, -1), v_cache.view(num_blocks, -1)
        k_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, v)
        heads = q.shape[1]
        group = heads // kvh
        nd = meta.num_decodes
        out = q.new_empty(q.shape) if meta.prefills else None
        if nd and meta.decode_context_lens is not None:
            o = self._kernel_decode(q[:nd].contiguous(), k_rows, v_rows, k_cache, v_cache, meta, scale)
            if out is None:
                return o
            out[:nd] = o
        elif nd:
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

    def attend_cached_decodes(self, q: torch.Tensor, cache, meta: TorchAttentionMetadata,
                              scale: float | None = None) -> torch.Tensor:
        """Attention of a step's decode rows whose new K/V the caller already wrote to their slots
        (layers/batched_decode.py does it in the pass that rotates them): q [nd, heads, D] contiguous;
        the C kernel path only (`meta.decode_context_lens` set), cascade prefix included."""
        k_cache, v_cache = cache
        num_blocks = k_cache.shape[0]
        return self._kernel_decode(q, k_cache.view(num_blocks, -1), v_cache.view(num_blocks, -1), k_cache, v_cache,
                                   meta, scale)

    def _kernel_decode(self, q, k_rows, v_rows, k_cache, v_cache, meta: TorchAttentionMetadata,
                       scale: float | None = None) -> torch.Tensor:
        """Decode attention with the C kernel; a prefix shared by every decode (a system prompt) is
        attended once for all of them in one flash-attention call, then merged by log-sum-exp with
        the kernel's result over each sequence's own tokens (cascade attention)."""
        nd, heads, d = q.shape
        _, bs, kvh, _ = k_cache.shape
        scale = d ** -0.5 if scale is None else scale
        out = torch.empty_like(q)
        skip, lse = 0, None
        if meta.shared_blocks is not None:
            skip = meta.shared_blocks.numel() * bs
            lse = torch.empty((nd, heads), dtype=torch.float32)
        rc = self.kernels.paged_decode_attention(
            q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            meta.decode_block_tables.data_ptr(), meta.decode_block_tables.shape[1],
            meta.decode_context_lens.data_ptr(), nd, heads, kvh, d, bs, scale,
            cpu_kernels.dtype_code(q.dtype), skip, None if lse is None else lse.data_ptr())
        if rc != 0:
            raise RuntimeError("paged_decode_attention rejected its arguments")
        if lse is None:
            return out
        group = heads // kvh
        keys = k_rows.index_select(0, meta.shared_blocks).view(1, skip, kvh, d).transpose(1, 2)  # [1, kvh, P, d]
        values = v_rows.index_select(0, meta.shared_blocks).view(1, skip, kvh, d).transpose(1, 2)
        qh = q.view(nd, kvh, group, d).transpose(0, 1).reshape(1, kvh, nd * group, d)
        # every decode's queries against the shared keys in one flash-attention call, which also
        # returns the log-sum-exp needed to merge with the kernel's part
        shared_out, shared_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qh, keys, values, 0.0, False, scale=scale)[:2]
        shared_lse = shared_lse.view(kvh, nd, group).transpose(0, 1).reshape(nd, heads)
        shared_out = shared_out.view(kvh, nd, group, d).transpose(0, 1).reshape(nd, heads, d).float()
        top = torch.maximum(shared_lse, lse)
        w_shared, w_own = (shared_lse - top).exp_(), (lse - top).exp_()
        merged = shared_out * w_shared.unsqueeze(-1) + out.float() * w_own.unsqueeze(-1)
        return merged.div_((w_shared + w_own).unsqueeze(-1)).to(q.dtype)


MIN_CASCADE_DECODES = 8  # below this, attending the shared prefix per sequence costs no more
MIN_CASCADE_BLOCKS = 4


def _shared_prefix_blocks(tables: list[list[int]], lens: list[int], block_size: int) -> torch.Tensor | None:
    """The leading block ids all decodes share (full blocks before each one's new token), if
    there are enough decodes and blocks for cascade attention to pay off."""
    if len(tables) < MIN_CASCADE_DECODES:
        return None
    limit = min((n - 1) // block_size for n in lens)
    first = tables[0]
    n = 0
    while n < limit and all(t[n] == first[n] for t in tables):
        n += 1
    return torch.tensor(first[:n], dtype=torch.long) if n >= MIN_CASCADE_BLOCKS else None
