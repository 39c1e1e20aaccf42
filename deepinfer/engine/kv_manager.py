"""KV block accounting: the block pool, refcounts, the prefix-cache index, per-request block tables.

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

from deepinfer.engine.block_hash import extend_block_hashes, root_hash
from deepinfer.engine.request import Request


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

    def register(self, block: int, block_hash: bytes) -> None:
        """Make a full, computed block findable by its hash (first writer wins)."""
        if self.block_hash[block] is not None or block_hash in self.cached:
            return
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for b in list(self.cached.values()):
            self.block_hash[b] = None
        self.cached.clear()


class KVCacheManager:
    """Owns each request's block table; answers prefix-cache lookups; registers computed blocks."""

    def __init__(self, num_blocks: int, block_size: int, model_identity: str, kv_layout: str,
                 enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.model_identity = model_identity
        self.kv_layout = kv_layout
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}
        self._roots: dict[str | None, bytes] = {}
        # counters (tokens) for metrics
        self.prefix_queries = 0
        self.prefix_hits = 0

    def _root(self, salt: str | None) -> bytes:
        r = self._roots.get(salt)
        if r is None:
            r = self._roots[salt] = root_hash(self.model_identity, self.kv_layout, salt)
        return r

    def update_hashes(self, req: Request) -> None:
        extend_block_hashes(req.block_hashes, req.token_ids, self.block_size, self._root(req.cache_salt))

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Blocks holding the longest cached prefix of `req` (at most num_tokens - 1 tokens:
        the last token is always recomputed to produce logits). Takes no reference."""
        if not self.enable_prefix_caching:
            return []
        self.update_hashes(req)
        limit = (req.num_tokens - 1) // self.block_size
        blocks = []
        for h in req.block_hashes[:limit]:
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def allocate(self, req: Request, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Give `req` blocks for `num_new_tokens` more tokens (after `cached_blocks`, if a new request).
        Returns False, changing nothing, if the pool cannot supply them."""
        table = self.block_tables.get(req.request_id)
        cached_blocks = cached_blocks or []
        have = len(table) if table is not None else len(cached_blocks)
        computed = req.num_computed_tokens if table is not None else len(cached_blocks) * self.block_size
        need = self.blocks_needed(computed + num_new_tokens) - have
        # cached blocks with no other user sit in the free queue: acquiring them uses up free blocks
        reclaim = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        if need > self.pool.num_free - reclaim:
            return False
        if table is None:
            self.pool.acquire(cached_blocks)
            table = self.block_tables[req.request_id] = list(cached_blocks)
        if need > 0:
            table.extend(self.pool.allocate(need))
        return True

    def record_prefix_query(self, req: Request, num_cached_tokens: int) -> None:
        self.prefix_queries += req.num_prompt_tokens
        self.prefix_hits += num_cached_tokens

    def register_computed(self, req: Request) -> None:
        """Publish full blocks whose KV is now computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(req.request_id)
        if not table:
            return
        self.update_hashes(req)
        full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        for i in range(self._num_registered.get(req.request_id, 0), full):
            self.pool.register(table[i], req.block_hashes[i])
        self._num_registered[req.request_id] = full

    def free(self, req: Request) -> None:
        table = self.block_tables.pop(req.request_id, None)
        self._num_registered.pop(req.request_id, None)
        if table:
            self.pool.release(list(reversed(table)))

    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks
