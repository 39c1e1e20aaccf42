"""Moving one KV block between the paged device cache and a flat byte payload.

Owns the payload byte order: for every layer, that block's K then its V, each a
contiguous [block_size, kv_heads, head_dim] slab of the cache dtype. The store
and host tier only see bytes; the runner gathers a block into a payload when it
offloads it and scatters a payload back before the step that reads it
(`scatter_blocks` for many at once: one copy per layer and K/V instead of one per
block, layer and K/V).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from deepinfer.kvcache.format import KVLayout

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v): [num_blocks, block_size, kv_heads, head_dim]


def layout_of(kv_caches: KVCaches) -> KVLayout:
    k = kv_caches[0][0]
    _, block_size, kv_heads, head_dim = k.shape
    return KVLayout(str(k.dtype), block_size, len(kv_caches), kv_heads, head_dim)


def gather_block(kv_caches: KVCaches, block_id: int) -> torch.Tensor:
    """One block of every layer as a flat uint8 CPU tensor (a copy)."""
    parts = [t[block_id].reshape(-1).view(torch.uint8) for k, v in kv_caches for t in (k, v)]
    return torch.cat(parts).cpu()


def scatter_block(kv_caches: KVCaches, block_id: int, payload: Any) -> None:
    """Write a payload made by `gather_block` (bytes, memoryview or uint8 tensor) into `block_id`."""
    flat = payload if isinstance(payload, torch.Tensor) else torch.frombuffer(payload, dtype=torch.uint8)
    off = 0
    for k, v in kv_caches:
        for t in (k, v):
            dst = t[block_id]
            n = dst.numel() * dst.element_size()
            if off + n > flat.numel():
                raise ValueError(f"payload of {flat.numel()} bytes is too short for this KV layout")
            dst.copy_(flat[off:off + n].view(t.dtype).view(dst.shape), non_blocking=True)
            off += n
    if off != flat.numel():
        raise ValueError(f"payload of {flat.numel()} bytes does not match this KV layout ({off} bytes)")


def _as_uint8(payload: Any) -> torch.Tensor:
    return payload if isinstance(payload, torch.Tensor) else torch.frombuffer(payload, dtype=torch.uint8)


def scatter_blocks(kv_caches: KVCaches, block_ids: Sequence[int], payloads: Sequence[Any]) -> None:
    """`scatter_block` for each (block, payload) pair, batched: the payloads are stacked once, then each
    layer's K and V take all blocks in one indexed copy. Every payload must have the block's size."""
    if not block_ids:
        return
    flat = torch.stack([_as_uint8(p) for p in payloads])  # [n, block bytes], one copy
    sizes = [t[0].numel() * t.element_size() for kv in kv_caches for t in kv]
    if flat.shape[1] != sum(sizes):
        raise ValueError(f"payloads of {flat.shape[1]} bytes do not match this KV layout ({sum(sizes)} bytes)")
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=kv_caches[0][0].device)
    off = 0
    for t, n in zip((t for kv in kv_caches for t in kv), sizes, strict=True):
        src = flat[:, off:off + n].contiguous().view(t.dtype).view(len(block_ids), *t.shape[1:])
        t.index_copy_(0, idx, src.to(t.device, non_blocking=True))
        off += n
