"""KV block accounting: the block pool, refcounts, the prefix-cache index, per-request block tables.

A block is in exactly one of three states:
- in use: ref_count > 0 (one per request whose block table holds it);
- free and cached: ref_count == 0, still holds a full block's KV and is findable by its hash;
  it sits in the LRU free queue and is evicted (its hash dropped) only when reallocated;
- free and empty: ref_count == 0, no hash.
Allocation takes blocks from the LRU head; freeing appends to the tail (a request's last
blocks first, so the shared prefix outlives its tails). All operations are O(1) per block.

With KV tiers attached (`attach_tiers`, see `kv_tiers.py`) the prefix cache continues below
the device: a lookup extends the device match through host memory and the store. A waiting
request whose match reaches into the store is first prefetched (`kv_prefetch.py`): the lookup
starts the background read and reports `PrefixHit.prefetching` until its blocks are staged in
host memory, then reports them as memory hits. Admission gives the tier hits fresh device blocks
and records them as the request's pending load (`load_pending`, run before its first step); an
evicted cached block is copied to the host tier; newly computed blocks are written to the store,
in segment-aligned runs while the request runs and the rest when it leaves the device.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer.engine.block_hash import extend_block_hashes, root_hash
from deepinfer.engine.request import PendingLoad, Request

if TYPE_CHECKING:
    from deepinfer.engine.kv_prefetch import Staged
    from deepinfer.engine.kv_tiers import KVTiers

TIERS = ("device", "host", "store")


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


@dataclass
class PrefixHit:
    """The longest cached prefix of a request: `blocks` on the device, then `num_host` chain positions
    in host memory, then `num_store` in the persistent store."""

    blocks: list[int] = field(default_factory=list)
    num_host: int = 0
    num_store: int = 0
    # the store part is still being read in the background: the request is not ready to admit
    prefetching: bool = False
    staged: Staged | None = None  # the prefetch's payloads, once done (num_store of them from the store)

    @property
    def num_load(self) -> int:
        return self.num_host + self.num_store

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) + self.num_load


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
        self._roots: dict[tuple[str | None, str | None], bytes] = {}
        self.tiers: KVTiers | None = None
        # chain positions each request computed and registered first, not yet handed to the store
        self._unwritten: dict[str, list[int]] = {}
        # counters (tokens) for metrics
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.tier_hits = dict.fromkeys(TIERS, 0)

    def attach_tiers(self, tiers: KVTiers | None) -> None:
        """Continue prefix lookups through `tiers` and move blocks to and from them (None: detach)."""
        self.tiers = tiers if self.enable_prefix_caching else None
        self.pool.on_evict = tiers.evicted if self.tiers is not None and tiers.host is not None else None

    def _root(self, salt: str | None, tenant: str | None = None) -> bytes:
        r = self._roots.get((tenant, salt))
        if r is None:
            r = self._roots[(tenant, salt)] = root_hash(self.model_identity, self.kv_layout, salt, tenant)
        return r

    def update_hashes(self, req: Request) -> None:
        extend_block_hashes(req.block_hashes, req.token_ids, self.block_size,
                            self._root(req.cache_salt, req.cache_tenant))

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Device blocks holding the longest cached prefix of `req` (at most num_tokens - 1 tokens:
        the last token is always recomputed to produce logits). Takes no reference. None for a request
        that wants prompt logprobs: every prompt position's logits must be computed."""
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
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

    def lookup_prefix(self, req: Request) -> PrefixHit:
        """The device prefix, continued through the tiers. The tier answer is kept on the request while
        the device part and the request's length stay the same: a waiting request is looked up every
        step, and a store lookup reads files. A stale answer only costs a recompute (loads verify).
        With a prefetcher, store hits start a background read and the hit says `prefetching` until
        they are staged; then they are memory hits, and whatever the read did not stage is a miss."""
        hit = PrefixHit(self.find_cached_prefix(req))
        if self.tiers is None or req.params.prompt_logprobs is not None:
            return hit
        limit = (req.num_tokens - 1) // self.block_size
        start = len(hit.blocks)
        if start >= limit:
            return hit
        prefetcher = self.tiers.prefetcher
        staged = prefetcher.staged(req.request_id) if prefetcher is not None else None
        if isinstance(staged, dict):
            if start >= prefetcher.first_position(req.request_id):
                return self._staged_hit(req, hit, start, limit, staged)
            # device blocks before the staged chain were evicted meanwhile: stage again from here (each
            # retry starts lower, so this ends), rather than recompute what the store still holds
            prefetcher.release(req.request_id)
            staged = None
        memo = req.tier_lookup
        if memo is None or memo[:2] != (start, limit):
            memo = req.tier_lookup = (start, limit, *self.tiers.lookup(req.block_hashes[:limit], start))
        hit.num_host, hit.num_store = memo[2], memo[3]
        if prefetcher is not None and hit.num_store:
            # not admitted with blocks still on disk: read them off this thread first (a refused start,
            # staging memory full, is retried at the next lookup); a fast read may be staged at once
            if staged is None and prefetcher.start(req.request_id, req.block_hashes, start, hit.num_host,
                                                   hit.num_store):
                staged = prefetcher.staged(req.request_id)
            if isinstance(staged, dict):
                return self._staged_hit(req, hit, start, limit, staged)
            hit.prefetching = True
        return hit

    def _staged_hit(self, req: Request, hit: PrefixHit, start: int, limit: int, staged: Staged) -> PrefixHit:
        """`hit` continued from `start` by what is in host memory: staged by a prefetch or in the host tier."""
        hit.staged = staged
        num, hit.num_store = self.tiers.memory_prefix(req.block_hashes[:limit], start, staged)
        hit.num_host = num - hit.num_store
        return hit

    def allocate(self, req: Request, num_new_tokens: int, cached_blocks: list[int] | None = None,
                 num_load_blocks: int = 0) -> bool:
        """Give `req` blocks for `num_new_tokens` more tokens (after `cached_blocks` and `num_load_blocks`
        blocks to be loaded from the tiers, if a new request). Returns False, changing nothing, if the
        pool cannot supply them."""
        table = self.block_tables.get(req.request_id)
        cached_blocks = cached_blocks or []
        have = len(table) if table is not None else len(cached_blocks)
        if table is not None:
            computed = req.num_computed_tokens
        else:
            computed = (len(cached_blocks) + num_load_blocks) * self.block_size
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

    def admit(self, req: Request, hit: PrefixHit) -> None:
        """`req` was allocated with `hit`: on its first admission, count its cached prompt tokens (tier
        hits provisionally, until `load_pending` knows what loaded); queue the load of its tier hits."""
        first = req.num_cached_tokens < 0
        bs = self.block_size
        if first:
            req.num_cached_device = len(hit.blocks) * bs
            req.num_cached_host = hit.num_host * bs
            req.num_cached_store = hit.num_store * bs
            req.num_cached_tokens = min(hit.num_blocks * bs, req.num_prompt_tokens)
            self.prefix_queries += req.num_prompt_tokens
            # tier hits are counted once loaded: a counter must not go back down
            self.prefix_hits += req.num_cached_device
            self.tier_hits["device"] += req.num_cached_device
        req.pending_load = PendingLoad(len(hit.blocks), hit.num_load, first, hit.staged) if hit.num_load else None
        req.tier_lookup = None
        self._release_prefetch(req)  # the staged payloads, if any, now live on in pending_load

    def load_pending(self, req: Request) -> int:
        """Bring `req`'s pending tier hits into its device blocks (call before the step that first reads
        them) and make them findable. Returns how many tokens did not load: the caller lowers the step's
        start by that much, so they are recomputed; the request's computed and cached counts are already
        lowered here."""
        pending, req.pending_load = req.pending_load, None
        if pending is None or self.tiers is None:
            return 0
        table = self.block_tables[req.request_id]
        first, count = pending.first_block, pending.num_blocks
        from_host, from_store = self.tiers.load(req.block_hashes, table[first:first + count], first, pending.staged)
        loaded = from_host + from_store
        for i in range(first, first + loaded):
            self.pool.register(table[i], req.block_hashes[i])
        bs = self.block_size
        if pending.first_admission:
            req.num_cached_host, req.num_cached_store = from_host * bs, from_store * bs
            req.num_cached_tokens = req.num_cached_device + (loaded * bs)
            self.prefix_hits += loaded * bs
            self.tier_hits["host"] += from_host * bs
            self.tier_hits["store"] += from_store * bs
        missing = (count - loaded) * bs
        req.num_computed_tokens -= missing
        return missing

    def register_computed(self, req: Request) -> None:
        """Publish full blocks whose KV is now computed, so later requests can share them; queue the
        ones this request computed first for the store, cut at segment boundaries."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(req.request_id)
        if not table:
            return
        self.update_hashes(req)
        full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        new = [i for i in range(self._num_registered.get(req.request_id, 0), full)
               if self.pool.register(table[i], req.block_hashes[i])]
        self._num_registered[req.request_id] = full
        if self.tiers is not None and self.tiers.writer is not None:
            unwritten = self._unwritten.setdefault(req.request_id, [])
            unwritten.extend(new)
            self._write(req, table, full - full % self.tiers.group_blocks)

    def _write(self, req: Request, table: list[int], upto: int) -> None:
        """Hand `req`'s unwritten positions below `upto` to the store, one call per consecutive run."""
        unwritten = self._unwritten.get(req.request_id)
        if not unwritten or self.tiers is None:
            return
        ready = [i for i in unwritten if i < upto]
        if not ready:
            return
        self._unwritten[req.request_id] = [i for i in unwritten if i >= upto]
        run_start = prev = ready[0]
        for i in [*ready[1:], None]:
            if i is not None and i == prev + 1:
                prev = i
                continue
            self.tiers.write(req.block_hashes, table[run_start:prev + 1], run_start, req.retention_class)
            if i is not None:
                run_start = prev = i

    def _release_prefetch(self, req: Request) -> None:
        if self.tiers is not None and self.tiers.prefetcher is not None:
            self.tiers.prefetcher.release(req.request_id)

    def free(self, req: Request) -> None:
        """Release everything `req` holds: its blocks (written to the store first), a pending load, a
        prefetch (also for a request that was never admitted)."""
        table = self.block_tables.pop(req.request_id, None)
        self._num_registered.pop(req.request_id, None)
        req.pending_load = None
        self._release_prefetch(req)
        if table:
            # the blocks still hold their KV until reallocated: copy the rest out for the store first
            self._write(req, table, len(table))
            self.pool.release(list(reversed(table)))
        self._unwritten.pop(req.request_id, None)

    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks
