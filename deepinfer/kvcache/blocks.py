"""Moving KV blocks between the paged device cache and flat byte payloads: one module owns the byte order.

A tier payload is one chain position (token block) of one request's KV. `TierBlocks` says what it holds
and where those bytes live on the device: the blocks of the *tier groups* (the layer groups kept for the
whole sequence, `FullAttention` and `Compressed`; window-like groups are rebuilt by bounded replay) that
are named by that position. A group whose block covers `stride` token blocks (a `Compressed(ratio)` with
ratio > block_size) names it by the last of them, so position p carries its block (p + 1) // stride - 1
iff (p + 1) % stride == 0 and nothing otherwise; a token-aligned group carries block p at every position.

Byte order of a payload: the tier groups in order, each present group's block as its tensors list it
(per layer K then V for attention caches, `[block_size, kv_heads, head_dim]` each; DeepSeek-V4's compressed
entries then CSA's indexer keys, per layer), each tensor's block a contiguous slab of the cache dtype. A
dense model (one full group, stride 1) keeps exactly the old layout (`KVLayout`); a model whose positions
differ in size (V4) gets a `PositionLayout`. The store and host tier only see bytes.

`gather_block` / `scatter_block(s)` are the single-group (dense) forms, used by KV export and tests.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import torch

from deepinfer.kvcache.format import KVLayout, PositionLayout

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v): [num_blocks, block_size, kv_heads, head_dim]
NO_BLOCK = -1
# a KV export payload of a model with several kinds of groups: magic, chain position, bit k set when window
# group k's block follows the tier payload
_EXCHANGE = struct.Struct("<4sII")
_EXCHANGE_MAGIC = b"DIKX"


def layout_of(kv_caches: KVCaches) -> KVLayout:
    k = kv_caches[0][0]
    _, block_size, kv_heads, head_dim = k.shape
    return KVLayout(str(k.dtype), block_size, len(kv_caches), kv_heads, head_dim)


def gather_block(kv_caches: KVCaches, block_id: int) -> torch.Tensor:
    """One block of every layer as a flat uint8 CPU tensor (a copy)."""
    parts = [t[block_id].reshape(-1).view(torch.uint8) for k, v in kv_caches for t in (k, v)]
    return torch.cat(parts).cpu()


def _as_uint8(payload: Any) -> torch.Tensor:
    return payload if isinstance(payload, torch.Tensor) else torch.frombuffer(payload, dtype=torch.uint8)


def _scatter(tensors: Sequence[torch.Tensor], block_id: int, flat: torch.Tensor, off: int) -> int:
    for t in tensors:
        dst = t[block_id]
        n = dst.numel() * dst.element_size()
        if off + n > flat.numel():
            raise ValueError(f"payload of {flat.numel()} bytes is too short for this KV layout")
        dst.copy_(flat[off:off + n].view(t.dtype).view(dst.shape), non_blocking=True)
        off += n
    return off


def scatter_block(kv_caches: KVCaches, block_id: int, payload: Any) -> None:
    """Write a payload made by `gather_block` (bytes, memoryview or uint8 tensor) into `block_id`."""
    flat = _as_uint8(payload)
    off = _scatter([t for kv in kv_caches for t in kv], block_id, flat, 0)
    if off != flat.numel():
        raise ValueError(f"payload of {flat.numel()} bytes does not match this KV layout ({off} bytes)")


def _scatter_many(tensors: Sequence[torch.Tensor], block_ids: Sequence[int], flat: torch.Tensor) -> None:
    """Payloads stacked in `flat` [n, bytes] into `block_ids` of `tensors`: one indexed copy per tensor."""
    sizes = [t[0].numel() * t.element_size() for t in tensors]
    if flat.shape[1] != sum(sizes):
        raise ValueError(f"payloads of {flat.shape[1]} bytes do not match this KV layout ({sum(sizes)} bytes)")
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=tensors[0].device)
    off = 0
    for t, n in zip(tensors, sizes, strict=True):
        src = flat[:, off:off + n].contiguous().view(t.dtype).view(len(block_ids), *t.shape[1:])
        t.index_copy_(0, idx, src.to(t.device, non_blocking=True))
        off += n


def scatter_blocks(kv_caches: KVCaches, block_ids: Sequence[int], payloads: Sequence[Any]) -> None:
    """`scatter_block` for each (block, payload) pair, batched: the payloads are stacked once, then each
    layer's K and V take all blocks in one indexed copy. Every payload must have the block's size."""
    if not block_ids:
        return
    _scatter_many([t for kv in kv_caches for t in kv], block_ids, torch.stack([_as_uint8(p) for p in payloads]))


def _describe(shapes: list[str]) -> str:
    """Block shapes as "n*(unit)" when they repeat a unit n times (one unit per layer), else all of them."""
    for p in range(1, len(shapes)):
        if len(shapes) % p == 0 and shapes == shapes[:p] * (len(shapes) // p):
            return f"{len(shapes) // p}*({'+'.join(shapes[:p])})"
    return "+".join(shapes)


class TierBlocks:
    """What a chain position's tier payload holds and how it maps to one request's device blocks.

    `groups`: the manager's indices of the tier groups; `strides`: token blocks one of each group's blocks
    covers; `tensors`: per tier group, the cache tensors of its layers (block index first) in payload
    order; `layout`: the matching store layout (its key seeds the block hashes)."""

    def __init__(self, groups: Sequence[int], strides: Sequence[int], tensors: Sequence[Sequence[torch.Tensor]],
                 layout: KVLayout | PositionLayout) -> None:
        if not (len(groups) == len(strides) == len(tensors)) or not groups:
            raise ValueError("one stride and one tensor list per tier group, at least one group")
        self.groups = list(groups)
        self.strides = list(strides)
        self.tensors = [list(t) for t in tensors]
        self.layout = layout
        # the token-aligned window groups (not in the tiers; KV export ships them): manager index, tensors
        self.window_groups: list[int] = []
        self.window_tensors: list[list[torch.Tensor]] = []

    def with_windows(self, groups: Sequence[int], tensors: Sequence[Sequence[torch.Tensor]]) -> TierBlocks:
        """Also describe the window groups' blocks (one block per token block), for KV export."""
        self.window_groups = list(groups)
        self.window_tensors = [list(t) for t in tensors]
        return self

    @classmethod
    def dense(cls, group: int, kv_caches: KVCaches) -> TierBlocks:
        """One token-aligned group of attention caches (per layer K, V): the `KVLayout` payload."""
        return cls([group], [1], [[t for kv in kv_caches for t in kv]], layout_of(kv_caches))

    @classmethod
    def positional(cls, groups: Sequence[int], strides: Sequence[int], tensors: Sequence[Sequence[torch.Tensor]],
                   block_size: int) -> TierBlocks:
        """Groups of any stride over tensors of one dtype: a `PositionLayout` described by the shapes."""
        dtype = tensors[0][0].dtype
        described = []
        for stride, ts in zip(strides, tensors, strict=True):
            if any(t.dtype != dtype for t in ts):
                raise ValueError("tier tensors of one dtype only")
            nbytes = sum(t[0].numel() * t.element_size() for t in ts)
            described.append((stride, nbytes, _describe(["x".join(map(str, t.shape[1:])) for t in ts])))
        return cls(groups, strides, tensors, PositionLayout(str(dtype), block_size, tuple(described)))

    def carried(self, pos: int) -> list[tuple[int, int]]:
        """(tier group k, block index in that group's table) of every block position `pos` carries."""
        return [(k, (pos + 1) // s - 1) for k, s in enumerate(self.strides) if (pos + 1) % s == 0]

    def device_blocks(self, pos: int, tables: Sequence[Sequence[int]]) -> list[int] | None:
        """The device blocks of position `pos` in a request's `tables` (one per manager group, in
        `carried` order), or None where a table does not reach one or holds NO_BLOCK there."""
        out = []
        for k, j in self.carried(pos):
            table = tables[self.groups[k]]
            if j >= len(table) or table[j] == NO_BLOCK:
                return None
            out.append(table[j])
        return out

    def gather(self, pos: int, blocks: Sequence[int]) -> torch.Tensor:
        """Position `pos`'s payload from its device `blocks` (`carried` order) as a flat uint8 CPU tensor."""
        parts = [t[b].reshape(-1).view(torch.uint8)
                 for (k, _), b in zip(self.carried(pos), blocks, strict=True) for t in self.tensors[k]]
        return torch.cat(parts).cpu() if parts else torch.zeros(0, dtype=torch.uint8)

    def scatter(self, positions: Sequence[int], blocks: Sequence[Sequence[int]], payloads: Sequence[Any]) -> None:
        """Write payloads of `positions` into their device `blocks` (per position, `carried` order): per
        tier group, its blocks' bytes stacked once and copied with one indexed copy per tensor. Raises
        ValueError for a payload of the wrong size."""
        per_group: list[tuple[list[int], list[torch.Tensor]]] = [([], []) for _ in self.groups]
        for pos, blks, payload in zip(positions, blocks, payloads, strict=True):
            want = self.layout.nbytes(pos)
            flat = _as_uint8(payload) if want else torch.zeros(0, dtype=torch.uint8)
            if flat.numel() != want:
                raise ValueError(f"payload of {flat.numel()} bytes at position {pos}, not {want}")
            off = 0
            for (k, _), b in zip(self.carried(pos), blks, strict=True):
                n = sum(t[0].numel() * t.element_size() for t in self.tensors[k])
                per_group[k][0].append(b)
                per_group[k][1].append(flat[off:off + n])
                off += n
        for k, (ids, parts) in enumerate(per_group):
            if ids:
                _scatter_many(self.tensors[k], ids, torch.stack(parts))

    # ------------------------------------------------------------------ KV export (every group)

    def _part_nbytes(self, tensors: Sequence[torch.Tensor]) -> int:
        return sum(t[0].numel() * t.element_size() for t in tensors)

    def pack_exchange(self, pos: int, tier_payload: Any, window_blocks: Sequence[int | None]) -> torch.Tensor:
        """A KV export payload: position `pos`'s tier payload, then the window groups' blocks that are
        given (None: not held), behind a header naming the position and which window blocks follow."""
        mask = sum(1 << k for k, b in enumerate(window_blocks) if b is not None)
        parts = [torch.frombuffer(bytearray(_EXCHANGE.pack(_EXCHANGE_MAGIC, pos, mask)), dtype=torch.uint8)]
        if self.layout.nbytes(pos):
            parts.append(_as_uint8(tier_payload).reshape(-1).cpu())
        for k, b in enumerate(window_blocks):
            if b is not None:
                parts += [t[b].reshape(-1).view(torch.uint8).cpu() for t in self.window_tensors[k]]
        return torch.cat(parts)

    def unpack_exchange(self, payload: Any) -> tuple[int, torch.Tensor, list[torch.Tensor | None]]:
        """(position, tier payload, per window group its block bytes or None) of a `pack_exchange`
        payload; ValueError if it does not fit this model's groups."""
        flat = _as_uint8(payload).reshape(-1)
        if flat.numel() < _EXCHANGE.size:
            raise ValueError("KV export payload shorter than its header")
        magic, pos, mask = _EXCHANGE.unpack(bytes(flat[:_EXCHANGE.size].numpy()))
        if magic != _EXCHANGE_MAGIC or mask >> len(self.window_groups):
            raise ValueError("not a KV export payload of this model's groups")
        off = _EXCHANGE.size
        n = self.layout.nbytes(pos)
        tier = flat[off:off + n]
        off += n
        wins: list[torch.Tensor | None] = []
        for k, ts in enumerate(self.window_tensors):
            if mask >> k & 1:
                n = self._part_nbytes(ts)
                wins.append(flat[off:off + n])
                off += n
            else:
                wins.append(None)
        if off != flat.numel() or tier.numel() != self.layout.nbytes(pos):
            raise ValueError(f"KV export payload of {flat.numel()} bytes does not fit position {pos}")
        return pos, tier, wins

    def tier_parts(self, pos: int, tier_payload: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """(tier group k, its block's bytes) of position `pos`'s tier payload, in `carried` order."""
        out, off = [], 0
        for k, _ in self.carried(pos):
            n = self._part_nbytes(self.tensors[k])
            out.append((k, tier_payload[off:off + n]))
            off += n
        return out

    def scatter_part(self, tensors: Sequence[torch.Tensor], block: int, part: torch.Tensor) -> None:
        """One group's block bytes (`tier_parts`, `unpack_exchange`) into `block` of its `tensors`."""
        if _scatter(tensors, block, part, 0) != part.numel():
            raise ValueError("block bytes do not match this group's tensors")
