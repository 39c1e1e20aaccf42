"""The device block pool: refcounted KV blocks, an LRU queue of free blocks, a hash -> block index.

A block is in exactly one of three states:
- in use: ref_count > 0 (one per request whose block table holds it);
- free and cached: ref_count == 0, still holds a full block's KV and is findable by its hash;
  it sits in the LRU free queue and is evicted (its hash dropped) only when reallocated;
- free and empty: ref_count == 0, no hash.
Allocation takes blocks from the LRU head; freeing appends to the tail (a request's last
blocks first, so the shared prefix outlives its tails). All operations are O(1) per block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """Refcounted blocks with an LRU queue of free blocks and a hash -> block index."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.num_evictions = 0
        # called with (block, hash) just before a cached block is reused, while it still holds that KV
        self.on_evict: Callable[[int, bytes], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[block]
            if h is not None:  # evict: its content is about to be overwritten
                if self.on_evict is not None:
                    self.on_evict(block, h)
                del self.cached[h]
                self.block_hash[block] = None
                self.num_evictions += 1
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def acquire(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks found by `lookup`."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference per block; blocks reaching zero join the LRU tail in the given order."""
        for b in blocks:
            self.ref_counts[b] -= 1
            if self.ref_counts[b] < 0:
                raise RuntimeError(f"block {b} released more often than acquired")
            if self.ref_counts[b] == 0:
                if self.block_hash[b] is None:
                    # an empty block is worth nothing: reuse it before any cached one
                    self.free_queue[b] = None
                    self.free_queue.move_to_end(b, last=False)
                else:
                    self.free_queue[b] = None

    def register(self, block: int, block_hash: bytes) -> bool:
        """Make a full, computed block findable by its hash (first writer wins). True if it now is."""
        if self.block_hash[block] is not None or block_hash in self.cached:
            return False
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> None:
        for b in list(self.cached.values()):
            self.block_hash[b] = None
        self.cached.clear()


__all__ = ["BlockPool", "NoFreeBlocksError"]
