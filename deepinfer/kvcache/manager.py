"""KV block accounting: per-request block tables of every layer group, prefix lookup, admission.

Each layer group (`spec.py`) has its own `BlockPool` (`pool.py`) and its own block table per
request; block i of every group covers the same token positions and carries the same chained
hash. A full-attention group keeps every block. A sliding-window group drops (releases, still
cached by hash) the blocks that fall out of the window of the next position to compute, and its
table holds `NO_BLOCK` there, so it holds at most ceil(window / block_size) + 1 blocks per decoding
sequence. A prefix hit of L blocks needs all L blocks of every full group and only the window's
blocks of every sliding group. A dense model is one full-attention group: `pool` and `block_tables`
are that group's.

SWA bounded replay (`replay_tokens`, models with full and sliding groups): a sliding group's blocks
churn much faster than the full groups' (its pool is small, and the tiers do not hold them), so a
prefix whose full-group blocks are cached (device, host tier or store) often lacks the window. Rather
than recompute the whole prefix, the hit keeps the full groups' L blocks and recomputes only the last
`replay_tokens` of it (from a block boundary, `PrefixHit.replay_from`): in those positions the full
groups read their cached KV and write nothing (`Request.replay_end`), the sliding groups write fresh
blocks, and their attention sees keys from `replay_from` on only (`Request.kv_floor`). With stacked
sliding layers that is an approximation (a replayed token's window is cut at `replay_from`); it is
exact when the replay covers every dependency (from position 0, or a single sliding layer). A hit is
replayed when that computes no more tokens than the longest exact hit.

DeepSeek-V4's groups follow the same rules through their spec's `num_blocks`, `first_needed_block`
and `tokens_per_block`: a `CompressorWindow` group (the open compression groups' rows) is kept and
restored like a sliding window; a `Compressed` group like a full one, except that its block j covers
`tokens_per_block // block_size` token blocks, is registered once the last of them is computed and
is named by that token block's hash, and a hit of L token blocks needs its complete blocks only
(`spec.py` sizes them so no hit ever needs a partly filled one). Group 0 must be token-aligned.

Tier groups and window groups. The groups kept for the whole sequence (`FullAttention`, `Compressed`)
are what the tiers hold (`blocks.TierBlocks`: chain position p's payload is their blocks named by p's
hash); the window-like groups (`SlidingWindow`, `CompressorWindow`) are rebuilt by bounded replay, as
above. For V4 a replay also rebuilds the compressor rows of the open compression groups, so it must
start at or before the first row they pool: ratio m (2m rows with overlap) needs m * overlap +
max(0, m - block_size) tokens before a hit's end (`min_replay_tokens`; `replay_tokens` below it is
refused). During a V4 replay the compressed groups read their held entries and write none (the model
skips entries that complete before `Request.replay_end`); windows and rows are written, and window
attention sees no key before `kv_floor`.

With KV tiers attached (`attach_tiers`, see `engine_tiers.py`) the prefix cache continues below
the device: a lookup extends the device match through host memory and the store. A waiting
request whose match reaches into the store is first prefetched (`prefetch.py`): the lookup
starts the background read and reports `PrefixHit.prefetching` until its blocks are staged in
host memory, then reports them as memory hits. Admission gives the tier hits fresh device blocks
and records them as the request's pending load (`load_pending`, run before its first step); an
evicted cached block is copied to the host tier; newly computed blocks are written to the store,
in segment-aligned runs while the request runs and the rest when it leaves the device.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

from deepinfer.engine.request import PendingLoad, Request
from deepinfer.kvcache.hashing import extend_block_hashes, root_hash
from deepinfer.kvcache.pool import BlockPool
from deepinfer.kvcache.spec import Compressed, CompressorWindow, FullAttention, KVSpec, SlidingWindow

if TYPE_CHECKING:
    from deepinfer.kvcache.engine_tiers import KVTiers
    from deepinfer.kvcache.prefetch import Staged

TIERS = ("device", "host", "store")
MAX_CACHED_ROOTS = 1024
NO_BLOCK = -1  # a sliding-window table entry whose block left the window (never read by attention)


def whole_sequence(spec: KVSpec) -> bool:
    """A group kept for the whole sequence (what the tiers hold), not a window rebuilt by replay."""
    return isinstance(spec, FullAttention | Compressed)


def min_replay_tokens(specs: Sequence[KVSpec], block_size: int) -> int:
    """The fewest tokens a replay must recompute before a hit's end (a multiple of `block_size`): a
    compressor's open group starts up to m - block_size tokens back (m > block_size) and, with
    overlap, pools the m rows before it too. 0 without compressors."""
    return max((s.ratio * s.overlap + max(0, s.ratio - block_size) for s in specs
                if isinstance(s, CompressorWindow)), default=0)


@dataclass
class PrefixHit:
    """The longest cached prefix of a request: `blocks` on the device, then `num_host` chain positions
    in host memory, then `num_store` in the persistent store. `blocks` is the first layer group's;
    `other_groups` the rest's (NO_BLOCK where a window does not need one); `num_device`: the chain
    positions the device part covers."""

    blocks: list[int] = field(default_factory=list)
    num_device: int = 0
    other_groups: list[list[int]] = field(default_factory=list)
    num_host: int = 0
    num_store: int = 0
    # the store part is still being read in the background: the request is not ready to admit
    prefetching: bool = False
    staged: Staged | None = None  # the prefetch's payloads, once done (num_store of them from the store)
    # bounded replay: the sliding groups recompute positions replay_from .. num_blocks * block_size - 1
    replay_from: int | None = None

    @property
    def num_load(self) -> int:
        return self.num_host + self.num_store

    @property
    def num_blocks(self) -> int:
        return self.num_device + self.num_load

    def start(self, block_size: int) -> int:
        """The first position the request computes: after the hit, or where its replay begins."""
        return self.replay_from if self.replay_from is not None else self.num_blocks * block_size


@dataclass
class _Group:
    """One layer group's device blocks: its spec, pool and per-request tables."""

    spec: KVSpec
    pool: BlockPool
    tables: dict[str, list[int]] = field(default_factory=dict)


class _GroupPlan(NamedTuple):
    """One group's part of an allocation (`KVCacheManager._plan`): the request's table (a new request's: its
    cached blocks), the indexes of the blocks it no longer reads, the blocks to take, and how many of the
    dropped ones go back to the pool (those it alone holds)."""

    group: _Group
    table: list[int]
    drop: list[int]
    need: int
    freed: int


class KVCacheManager:
    """Owns each request's block tables; answers prefix-cache lookups; registers computed blocks.

    `specs` (default: one full-attention group) and `num_blocks` (one count, or one per group) describe
    the layer groups; `replay_tokens` (None: the largest sliding window, at least `min_replay_tokens`;
    0: off) bounds a hit's replay (see the module docstring). The host tier and store hold the tier
    groups' blocks (`supports_tiers`: models whose groups are all kept whole, or with window groups when
    replay is on); KV export ships every group (`exchange.py`)."""

    def __init__(self, num_blocks: int | Sequence[int], block_size: int, model_identity: str, kv_layout: str,
                 enable_prefix_caching: bool = True, specs: Sequence[KVSpec] = (FullAttention(),),
                 replay_tokens: int | None = None) -> None:
        if not specs:
            raise ValueError("a model needs at least one KV layer group")
        counts = [num_blocks] * len(specs) if isinstance(num_blocks, int) else list(num_blocks)
        if len(counts) != len(specs):
            raise ValueError(f"{len(counts)} block counts for {len(specs)} layer groups")
        self.groups = [_Group(spec, BlockPool(n)) for spec, n in zip(specs, counts, strict=True)]
        if self.groups[0].spec.tokens_per_block(block_size) != block_size:
            raise ValueError("KV layer group 0 must hold one block per token block")
        self.pool = self.groups[0].pool
        self.block_tables = self.groups[0].tables
        # the groups the tiers hold, with the token blocks one of their blocks covers
        self.tier_groups = [i for i, g in enumerate(self.groups) if whole_sequence(g.spec)]
        self._strides = [g.spec.tokens_per_block(block_size) // block_size for g in self.groups]
        windows = [g.spec.window for g in self.groups if isinstance(g.spec, SlidingWindow)]
        replayable = bool(self.tier_groups) and len(self.tier_groups) < len(self.groups)
        if replay_tokens is not None and replay_tokens < 0:
            raise ValueError(f"replay_tokens must be >= 0, got {replay_tokens}")
        self.min_replay_tokens = min_replay_tokens(specs, block_size)
        if replayable and replay_tokens and replay_tokens < self.min_replay_tokens:
            raise ValueError(f"swa_replay_tokens={replay_tokens} is below {self.min_replay_tokens}: a replay must "
                             "rebuild the compressor rows of the open compression groups (ratio m: up to "
                             "m - block_size tokens of a group not yet complete, plus m earlier rows with overlap)")
        # bounded replay needs a group kept whole to hold the prefix
        default = max([*windows, self.min_replay_tokens])
        self.replay_tokens = (default if replay_tokens is None else replay_tokens) if replayable else 0
        self.supports_export = all(isinstance(g.spec, FullAttention) for g in self.groups)
        # the tiers hold the whole-sequence groups' blocks; the window groups' then come back by replay
        self.supports_tiers = bool(self.tier_groups) and (not replayable or self.replay_tokens > 0)
        # chain position of each registered block of a tier group (the host tier copies a position whole)
        self._block_pos = {i: [0] * self.groups[i].pool.num_blocks for i in self.tier_groups}
        self.block_size = block_size
        self.model_identity = model_identity
        self.kv_layout = kv_layout
        self.enable_prefix_caching = enable_prefix_caching
        self._num_registered: dict[str, int] = {}
        # (tenant, salt) -> root hash; bounded, since every client-chosen salt adds one
        self._roots: OrderedDict[tuple[str | None, str | None], bytes] = OrderedDict()
        self.tiers: KVTiers | None = None
        # chain positions each request computed and registered first, not yet handed to the store
        self._unwritten: dict[str, list[int]] = {}
        # counters (tokens) for metrics
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.tier_hits = dict.fromkeys(TIERS, 0)
        self.replayed_tokens = 0  # prompt tokens recomputed for the sliding groups of replayed hits

    @property
    def group_tables(self) -> list[dict[str, list[int]]]:
        """Per layer group, request id -> block table (what the runner reads to build a step)."""
        return [g.tables for g in self.groups]

    def attach_tiers(self, tiers: KVTiers | None) -> None:
        """Continue prefix lookups through `tiers` and move blocks to and from them (None: detach)."""
        if tiers is not None and not self.supports_tiers:
            raise ValueError("KV tiers (host cache, store) hold models of full-attention (or compressed) layers, "
                             "or such layers beside window ones with bounded replay on")
        self.tiers = tiers if self.enable_prefix_caching else None
        hook = self.tiers is not None and tiers.host is not None
        for i in self.tier_groups:
            self.groups[i].pool.on_evict = partial(self._evicted, i) if hook else None

    def _evicted(self, group: int, block: int, block_hash: bytes) -> None:
        """A tier group's pool reuses `block`: give the host tier its chain position whole, from every
        tier group's block of that position while they all still hold it."""
        assert self.tiers is not None
        pos = self._block_pos[group][block]
        blocks: list[int] | None = []
        for k, _ in self.tiers.blocks.carried(pos):
            b = self.groups[self.tier_groups[k]].pool.lookup(block_hash)
            if b is None:
                blocks = None
                break
            blocks.append(b)
        self.tiers.evicted(block_hash, pos, blocks)

    def _register(self, group: int, block: int, block_hash: bytes, pos: int) -> bool:
        """Make `block` of `group` findable by `block_hash`, the hash of chain position `pos`."""
        if not self.groups[group].pool.register(block, block_hash):
            return False
        positions = self._block_pos.get(group)
        if positions is not None:
            positions[block] = pos
        return True

    def root(self, salt: str | None, tenant: str | None = None, adapter: str | None = None) -> bytes:
        """The hash chain's seed for this model, KV layout, tenant, cache salt and LoRA adapter digest."""
        key = (tenant, salt, adapter)
        r = self._roots.get(key)
        if r is None:
            r = self._roots[key] = root_hash(self.model_identity, self.kv_layout, salt, tenant, adapter)
            if len(self._roots) > MAX_CACHED_ROOTS:
                self._roots.popitem(last=False)
        else:
            self._roots.move_to_end(key)
        return r

    def update_hashes(self, req: Request) -> None:
        extra = None
        if req.multi_modal is not None:  # the images' tiles name the blocks their tokens start in
            if req.mm_block_keys is None:
                req.mm_block_keys = req.multi_modal.block_keys(self.block_size)
            extra = req.mm_block_keys
        extend_block_hashes(req.block_hashes, req.token_ids, self.block_size,
                            self.root(req.cache_salt, req.cache_tenant,
                                      req.lora.digest if req.lora is not None else None), extra)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, req: Request) -> list[list[int]]:
        """Per layer group, the device blocks holding the longest exactly cached prefix of `req` (at most
        num_tokens - 1 tokens: the last token is always recomputed to produce logits), NO_BLOCK where a
        sliding window does not need the block. Takes no reference. Empty for a request that wants
        prompt logprobs: every prompt position's logits must be computed."""
        found, _, exact = self._device_prefix(req)
        return self._tables(found, exact)

    def _device_prefix(self, req: Request) -> tuple[list[list[int | None]], int, int]:
        """Per group, the device blocks of `req`'s chain positions (None where missing); how many leading
        positions every full group holds; and the longest prefix every group serves (<= the former)."""
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return [[] for _ in self.groups], 0, 0
        self.update_hashes(req)
        bs = self.block_size
        limit = (req.num_tokens - 1) // bs
        hashes = req.block_hashes[:limit]
        found: list[list[int | None]] = []
        for g in self.groups:
            per = g.spec.tokens_per_block(bs) // bs  # token blocks one of this group's blocks covers
            if isinstance(g.spec, FullAttention | Compressed):
                # every block from the first is needed: the run of hits ends the prefix. A block covering
                # several token blocks is named by the last of them (it is complete only then).
                run: list[int | None] = []
                for j in range(len(hashes) // per):
                    b = g.pool.lookup(hashes[(j + 1) * per - 1])
                    if b is None:
                        break
                    run.append(b)
                hashes = hashes[:len(run) * per + per - 1]  # no group can hit past a missing needed block
                found.append(run)
            else:
                found.append([g.pool.lookup(h) for h in hashes])
        full = length = len(hashes)
        while length and not all(self._covers(g.spec, f, length) for g, f in zip(self.groups, found, strict=True)):
            length -= 1
        return found, full, length

    def _tables(self, found: list[list[int | None]], length: int, replay_from: int | None = None) -> list[list[int]]:
        """The hit's block table per group for a prefix of `length` chain positions; with `replay_from`,
        the window groups get no cached block (they recompute from there) and the others `length`."""
        if length == 0 and replay_from is None:
            return [[] for _ in self.groups]
        bs = self.block_size
        out = []
        for g, f in zip(self.groups, found, strict=True):
            if replay_from is not None and not whole_sequence(g.spec):
                out.append([NO_BLOCK] * (replay_from // bs))  # no key before the replay is ever read
                continue
            n = g.spec.num_blocks(length * bs, bs)
            first = g.spec.first_needed_block(length * bs, bs)
            out.append([NO_BLOCK] * first + f[first:n])  # type: ignore[operator]
        return out

    def _covers(self, spec: KVSpec, found: list[int | None], length: int) -> bool:
        """Whether a group's cached blocks `found` serve a hit of `length` token blocks."""
        bs = self.block_size
        n = spec.num_blocks(length * bs, bs)
        first = spec.first_needed_block(length * bs, bs)
        return len(found) >= n and all(b is not None for b in found[first:n])

    def lookup_prefix(self, req: Request) -> PrefixHit:
        """The device prefix, continued through the tiers, replayed if that computes less (module
        docstring). The tier answer is kept on the request while the device part and the request's
        length stay the same: a waiting request is looked up every step, and a store lookup reads files.
        A stale answer only costs a recompute (loads verify). With a prefetcher, store hits start a
        background read and the hit says `prefetching` until they are staged; then they are memory hits,
        and whatever the read did not stage is a miss."""
        found, full, exact = self._device_prefix(req)
        hit = self._tier_hit(req, full)
        bs = self.block_size
        total = full + hit.num_load
        if self.replay_tokens and total > exact:
            replay_from = self._replay_start(total * bs)
            if replay_from >= exact * bs:  # no more tokens to compute than the exact hit
                hit.blocks, *hit.other_groups = self._tables(found, full, replay_from)
                hit.num_device = full
                hit.replay_from = replay_from
                return hit
        if exact < full:  # the tier part continues the whole groups only: without replay it serves nothing
            hit = PrefixHit()
        hit.blocks, *hit.other_groups = self._tables(found, exact)
        hit.num_device = exact
        return hit

    def _rows_start(self, end: int) -> int:
        """The first compressor row the open compression groups at token `end` pool (`end` without compressors)."""
        return min([end, *(max(0, end // s.ratio * s.ratio - s.ratio * s.overlap) for g in self.groups
                           if isinstance(s := g.spec, CompressorWindow))])

    def _replay_start(self, end: int) -> int:
        """Where a replay of a hit ending at token `end` starts: `replay_tokens` back, never after the rows
        the open compression groups pool, at a block boundary."""
        return min(max(0, end - self.replay_tokens), self._rows_start(end)) // self.block_size * self.block_size

    def _tier_hit(self, req: Request, start: int) -> PrefixHit:
        """What the tiers hold of `req`'s chain from position `start` on (blocks not filled in)."""
        hit = PrefixHit()
        if self.tiers is None or req.params.prompt_logprobs is not None:
            return hit
        limit = (req.num_tokens - 1) // self.block_size
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

    def allocate(self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Give `req` blocks for `num_new_tokens` more tokens in every layer group (after `hit`'s cached
        blocks and blocks to be loaded from the tiers, if a new request); sliding-window groups first drop
        the blocks the step no longer reads. Returns False, changing nothing, if a pool cannot supply them."""
        plans = self._plan(req, num_new_tokens, hit)
        if plans is None:
            return False
        self._apply(req, plans)
        return True

    def allocate_all(self, requests: list[tuple[Request, int]]) -> bool:
        """`allocate` for several running requests (request, new tokens) at once: all of them, or, where the
        pools cannot supply them together or one is not running yet, none (returns False, changing nothing).
        A multi-step call for
        several requests is made only if every one of them fits; allocating them one by one would leave the
        first ones' blocks taken when a later one does not fit."""
        plans = []
        for req, n in requests:
            if req.request_id not in self.groups[0].tables:
                return False  # a new request's cached blocks count against the free ones differently
            plan = self._plan(req, n)
            if plan is None:
                return False
            plans.append(plan)
        for gi, g in enumerate(self.groups):  # each plan fitted alone: check them together
            if sum(p[gi].need - p[gi].freed for p in plans) > g.pool.num_free:
                return False
        for (req, _), plan in zip(requests, plans, strict=True):
            self._apply(req, plan)
        return True

    def _plan(self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> list[_GroupPlan] | None:
        """What `allocate` would do, per group, or None if a pool cannot supply it; nothing changed."""
        bs = self.block_size
        new = req.request_id not in self.groups[0].tables
        if new:
            hit = hit or PrefixHit()
            computed = hit.start(bs)
            starts = [hit.blocks, *hit.other_groups] if hit.other_groups else [hit.blocks] * len(self.groups)
            # tier hits get fresh blocks (loaded before the step runs): count them as new blocks
            starts = [list(b) for b in starts]
        else:
            computed = req.num_computed_tokens
            starts = [g.tables[req.request_id] for g in self.groups]
        plans = []
        for g, table in zip(self.groups, starts, strict=True):
            end_blocks = g.spec.num_blocks(computed + num_new_tokens, bs)
            if new and whole_sequence(g.spec):  # its tier hits get blocks now, even past a replay chunk
                end_blocks = max(end_blocks, g.spec.num_blocks(hit.num_blocks * bs, bs))
            first = g.spec.first_needed_block(computed, bs)
            drop = [i for i in range(min(first, len(table))) if table[i] != NO_BLOCK]
            if new:  # cached blocks with no other user sit in the free queue: acquiring them uses up free blocks
                cached = [b for b in table if b != NO_BLOCK]
                room = g.pool.num_free - sum(1 for b in cached if g.pool.ref_counts[b] == 0)
                freed = 0
            else:  # dropped blocks this request alone holds come back before the new ones are taken
                freed = sum(1 for i in drop if g.pool.ref_counts[table[i]] == 1)
                room = g.pool.num_free + freed
            need = end_blocks - len(table)
            if need > room:
                return None
            plans.append(_GroupPlan(g, table, drop, need, freed))
        return plans

    def _apply(self, req: Request, plans: list[_GroupPlan]) -> None:
        new = req.request_id not in self.groups[0].tables
        for g, table, drop, need, _ in plans:
            if new:
                g.pool.acquire([b for b in table if b != NO_BLOCK])
                g.tables[req.request_id] = table
            if drop:
                g.pool.release([table[i] for i in reversed(drop)])
                for i in drop:
                    table[i] = NO_BLOCK
            if need > 0:
                table.extend(g.pool.allocate(need))

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` positions of every group (speculative decoding:
        positions allocated for draft tokens the target rejected). Blocks below stay as they are, so a
        sliding window keeps every entry its next query needs; registered (cached) blocks are never past
        the computed tokens, so none is released here while still named."""
        bs = self.block_size
        for g in self.groups:
            table = g.tables.get(req.request_id)
            if table is None:
                continue
            keep = g.spec.num_blocks(num_tokens, bs)
            if len(table) > keep:
                g.pool.release([b for b in reversed(table[keep:]) if b != NO_BLOCK])
                del table[keep:]

    def admit(self, req: Request, hit: PrefixHit) -> None:
        """`req` was allocated with `hit`: on its first admission, count its cached prompt tokens (tier
        hits provisionally, until `load_pending` knows what loaded); queue the load of its tier hits."""
        first = req.num_cached_tokens < 0
        bs = self.block_size
        if first:
            req.num_cached_device = hit.num_device * bs
            req.num_cached_host = hit.num_host * bs
            req.num_cached_store = hit.num_store * bs
            req.num_cached_tokens = min(hit.num_blocks * bs, req.num_prompt_tokens)
            req.num_replayed_tokens = 0
            self.prefix_queries += req.num_prompt_tokens
            # tier hits are counted once loaded: a counter must not go back down
            self.prefix_hits += req.num_cached_device
            self.tier_hits["device"] += req.num_cached_device
            if self.tiers is not None and hit.num_device:
                self.tiers.reused(req.block_hashes, [g.tables[req.request_id] for g in self.groups], 0,
                                  hit.num_device, req.retention_class)
        if hit.replay_from is not None:
            req.replay_end, req.kv_floor = hit.num_blocks * bs, hit.replay_from
            req.num_replayed_tokens += req.replay_end - hit.replay_from
            self.replayed_tokens += req.replay_end - hit.replay_from
        req.pending_load = PendingLoad(hit.num_device, hit.num_load, first, hit.staged) if hit.num_load else None
        req.tier_lookup = None
        self._release_prefetch(req)  # the staged payloads, if any, now live on in pending_load

    def load_pending(self, req: Request) -> int | None:
        """Bring `req`'s pending tier hits into its device blocks (call before the step that first reads
        them) and make them findable. Returns how many tokens did not load: the caller lowers the step's
        start by that much, so they are recomputed; the request's computed and cached counts are already
        lowered here. A replayed hit keeps its start while what loaded still reaches it (the positions
        past the loaded blocks compute normally); else None: the caller frees the request and queues it
        again (the next lookup no longer finds the blocks that failed)."""
        pending, req.pending_load = req.pending_load, None
        if pending is None or self.tiers is None:
            return 0
        tables = [g.tables[req.request_id] for g in self.groups]
        first, count = pending.first_block, pending.num_blocks
        from_host, from_store = self.tiers.load(req.block_hashes, tables, first, count, pending.staged)
        loaded = from_host + from_store
        if from_host:
            self.tiers.reused(req.block_hashes, tables, first, loaded, req.retention_class)
        for i in range(first, first + loaded):
            for gi in self.tier_groups:
                per = self._strides[gi]
                if (i + 1) % per == 0:
                    self._register(gi, tables[gi][(i + 1) // per - 1], req.block_hashes[i], i)
        bs = self.block_size
        if pending.first_admission:
            req.num_cached_host, req.num_cached_store = from_host * bs, from_store * bs
            req.num_cached_tokens = req.num_cached_device + (loaded * bs)
            self.prefix_hits += loaded * bs
            self.tier_hits["host"] += from_host * bs
            self.tier_hits["store"] += from_store * bs
        missing = (count - loaded) * bs
        if req.replay_end and missing:
            end = (first + loaded) * bs
            if end < req.kv_floor or self._rows_start(end) < req.kv_floor:  # the replay no longer reaches it
                return None
            self.replayed_tokens -= req.replay_end - end
            req.num_replayed_tokens -= req.replay_end - end
            req.replay_end = end
            return 0
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
        done = self._num_registered.get(req.request_id, 0)
        hashes = req.block_hashes
        fresh: set[int] = set()  # positions whose tier blocks this request registered first
        registered0: set[int] = set()
        for gi, g in enumerate(self.groups):
            t = table if gi == 0 else g.tables[req.request_id]
            per = self._strides[gi]
            # a block covering `per` token blocks is complete, and named, with the last of them. NO_BLOCK
            # where a window dropped the block or a prefix hit skipped it: registering -1 would name the
            # pool's last block by this hash
            for j in range(done // per, full // per):
                pos = (j + 1) * per - 1
                if j < len(t) and t[j] != NO_BLOCK and self._register(gi, t[j], hashes[pos], pos):
                    if gi in self._block_pos:
                        fresh.add(pos)
                    elif gi == 0:
                        registered0.add(pos)
        # a position carrying no tier block (between a compressed group's blocks) is written when group 0's
        # block there is new: the tiers must hold every position of a chain
        fresh.update(p for p in registered0 if not any((p + 1) % self._strides[gi] == 0 for gi in self.tier_groups))
        self._num_registered[req.request_id] = full
        if self.tiers is not None and self.tiers.writer is not None:
            unwritten = self._unwritten.setdefault(req.request_id, [])
            unwritten.extend(sorted(fresh))
            self._write(req, full - full % self.tiers.group_blocks)

    def _write(self, req: Request, upto: int) -> None:
        """Hand `req`'s unwritten positions below `upto` to the store, one call per consecutive run."""
        unwritten = self._unwritten.get(req.request_id)
        if not unwritten or self.tiers is None:
            return
        ready = [i for i in unwritten if i < upto]
        if not ready:
            return
        self._unwritten[req.request_id] = [i for i in unwritten if i >= upto]
        tables = [g.tables.get(req.request_id, []) for g in self.groups]
        for start, count in consecutive_runs(ready):
            self.tiers.write(req.block_hashes, tables, start, count, req.retention_class)

    def _release_prefetch(self, req: Request) -> None:
        if self.tiers is not None and self.tiers.prefetcher is not None:
            self.tiers.prefetcher.release(req.request_id)

    def free(self, req: Request) -> None:
        """Release everything `req` holds: its blocks (written to the store first), a pending load, a
        prefetch (also for a request that was never admitted)."""
        table = self.block_tables.get(req.request_id)
        self._num_registered.pop(req.request_id, None)
        req.pending_load = None
        self._release_prefetch(req)
        if table:
            # the blocks still hold their KV until reallocated: copy the rest out for the store first
            self._write(req, len(table))
        self.block_tables.pop(req.request_id, None)
        for g in self.groups:
            t = table if g is self.groups[0] else g.tables.pop(req.request_id, None)
            if t:
                g.pool.release([b for b in reversed(t) if b != NO_BLOCK])
        self._unwritten.pop(req.request_id, None)

    def usage(self) -> float:
        """The fullest group's share of blocks in use."""
        return max(g.pool.num_used / g.pool.num_blocks for g in self.groups)


def consecutive_runs(positions: list[int]) -> list[tuple[int, int]]:
    """(start, count) of each run of consecutive values in ascending `positions`."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs
