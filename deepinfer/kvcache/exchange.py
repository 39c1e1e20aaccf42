"""Copying named KV blocks out of one engine and into another (prefill/decode disaggregation).

    prefill engine: export_blocks(prompt)  ─▶ [(block hash, payload)]  ─▶ KV transfer ─▶
    decode engine:  import_blocks(blocks)  ─▶ free-but-cached device blocks (prefix index) or host tier

Blocks are named by the chained block hash (`hashing.py`), so an imported block is
found by the decode engine's ordinary prefix-cache lookup when the continued request
arrives: no new scheduling path. Both functions touch engine state and must run on
the engine's own thread (`EngineClient.call("export_kv_blocks" | "import_kv_blocks")` sees to it).

Streaming export (`export_computed`): after each engine step, the prompt blocks a request's finished
steps computed since the last call, so a prefill worker can ship them while the next chunk computes.
Import can `hold` the blocks (keep a reference) until the continued request has taken its own.

A dense model's payload is one block id's K/V in every layer (`blocks.gather_block`). A model with
several kinds of groups (full and sliding layers; DeepSeek-V4's window, compressor rows and compressed
entries) ships every group: a payload is the chain position's tier payload (`blocks.TierBlocks`) plus
the window groups' blocks of that position still held (the last window's), behind a header naming the
position (`TierBlocks.pack_exchange`). The receiver then has the windows too, so its hit is exact, with
no replay; a position whose window blocks are gone still ships its tier part (the receiver replays).
Block references under `hold` are (group, block) pairs.

Export is best effort: it walks the prompt's full blocks in chain order and stops at
the first block neither the device pool nor the host tier holds (evicted meanwhile).
The receiver recomputes whatever it did not get, so a short export costs time, never
correctness.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from deepinfer.kvcache.blocks import gather_block, scatter_block
from deepinfer.kvcache.hashing import extend_block_hashes

if TYPE_CHECKING:
    from deepinfer.engine.core import EngineCore
    from deepinfer.engine.request import Request


def prompt_block_hashes(core: EngineCore, token_ids: Sequence[int], cache_salt: str | None,
                        cache_tenant: str | None = None) -> list[bytes]:
    """The chained hashes of every full block of `token_ids` as this engine names them (for the tenant)."""
    kv = core.kv
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(token_ids), kv.block_size, kv.root(cache_salt, cache_tenant))
    return hashes


def export_blocks(core: EngineCore, token_ids: Sequence[int], cache_salt: str | None,
                  cache_tenant: str | None = None) -> list[tuple[bytes, Any]]:
    """(hash, payload) of the longest run of `token_ids`' full blocks still held on the device or in the
    host tier, from the first block on. Payloads are CPU uint8 tensors (`gather_block` layout)."""
    return export_hashes(core, prompt_block_hashes(core, token_ids, cache_salt, cache_tenant))


def export_hashes(core: EngineCore, hashes: Sequence[bytes], start: int = 0) -> list[tuple[bytes, Any]]:
    """(hash, payload) of the longest leading run of `hashes` (chain positions start ..) held on the device
    or in the host tier."""
    if not core.kv.supports_export:
        return _export_grouped(core, hashes, start) if _grouped(core) else []
    pool = core.kv.pool
    host = core.tiers.host if core.tiers is not None else None
    out: list[tuple[bytes, Any]] = []
    for h in hashes:
        block = pool.lookup(h)
        if block is not None:
            out.append((h, gather_block(core.runner.kv_caches, block)))
            continue
        payload = host.get(h) if host is not None else None
        if payload is None:
            break
        out.append((h, payload))
    return out


def export_computed(core: EngineCore, req: Request, start: int) -> list[tuple[bytes, Any]]:
    """The prompt blocks of `req` from chain position `start` on whose KV finished steps computed (a
    streaming export: call after each step, with `start` = how many were exported before). Reads them
    by hash, so it also works right after the request finished and freed its blocks (they stay cached
    until reallocated, and nothing allocates before the next step)."""
    kv = core.kv
    done = min(req.num_kv_done_tokens, req.num_computed_tokens, req.num_prompt_tokens) // kv.block_size
    if done <= start:
        return []
    kv.update_hashes(req)
    return export_hashes(core, req.block_hashes[start:done], start)


def import_blocks(core: EngineCore, blocks: Sequence[tuple[bytes, Any]], hold: list[int] | None = None) -> int:
    """Make `blocks` findable by this engine's prefix cache: into free device blocks (registered, then
    released, so they sit in the free queue as cached blocks), the rest into the host tier if there is one.
    Returns how many of them are now held (already-held ones count). Prefix caching off: 0.
    `hold`: keep a reference on every device block of `blocks` instead (appended to `hold`), so none is
    evicted before the request that needs them arrives; `release_blocks(core, hold)` drops them."""
    kv = core.kv
    if not kv.enable_prefix_caching:
        return 0
    if not kv.supports_export:
        return _import_grouped(core, blocks, hold) if _grouped(core) else 0
    pool = kv.pool
    found = [pool.lookup(h) for h, _ in blocks]
    missing = [blk for blk, b in zip(blocks, found, strict=True) if b is None]
    held = len(blocks) - len(missing)
    if hold is not None:
        present = [b for b in found if b is not None]
        pool.acquire(present)
        hold.extend((0, b) for b in present)
    # never take the last free blocks: a running request may need them next step
    room = max(0, min(len(missing), pool.num_free - kv.blocks_needed(kv.block_size * 2)))
    ids = pool.allocate(room) if room else []
    placed: list[int] = []
    try:
        for block, (h, payload) in zip(ids, missing, strict=False):
            scatter_block(core.runner.kv_caches, block, payload)
            if pool.register(block, h):
                placed.append(block)
    except ValueError:  # a payload of another layout: keep what came before it
        pass
    finally:
        kept = set(placed) if hold is not None else set()
        if hold is not None:
            hold.extend((0, b) for b in placed)
        # release the prefix's first block last, so the LRU evicts the tail of the run first
        pool.release([b for b in reversed(ids) if b not in kept])
    held += len(placed)
    host = core.tiers.host if core.tiers is not None else None
    if host is not None and len(placed) == len(ids):
        for h, payload in missing[len(ids):]:
            host.insert(h, payload)
            held += 1
    return held


def release_blocks(core: EngineCore, hold: list[tuple[int, int]]) -> None:
    """Drop the references `import_blocks(..., hold)` took, the chain's first block last."""
    for group, block in reversed(hold):
        core.kv.groups[group].pool.release([block])
    hold.clear()


def _grouped(core: EngineCore) -> bool:
    """Whether `core`'s model exports every group (`TierBlocks.pack_exchange`): groups kept whole beside
    window groups (its tier payloads alone would leave the windows out)."""
    return core.runner.tier_blocks is not None and core.kv.supports_tiers


def _export_grouped(core: EngineCore, hashes: Sequence[bytes], start: int) -> list[tuple[bytes, Any]]:
    kv, tb = core.kv, core.runner.tier_blocks
    host = core.tiers.host if core.tiers is not None else None
    out: list[tuple[bytes, Any]] = []
    for i, h in enumerate(hashes):
        pos = start + i
        blocks = [kv.groups[tb.groups[k]].pool.lookup(h) for k, _ in tb.carried(pos)]
        if None in blocks:
            tier = host.get(h) if host is not None else None
            if tier is None:
                break
        else:
            tier = tb.gather(pos, blocks)
        windows = [kv.groups[g].pool.lookup(h) for g in tb.window_groups]
        out.append((h, tb.pack_exchange(pos, tier, windows)))
    return out


def _take(core: EngineCore, group: int, block_hash: bytes, pos: int, part: Any, tensors: Sequence[Any],
          hold: list[tuple[int, int]] | None, placed: list[tuple[int, int]]) -> bool:
    """Make `part` findable as `group`'s block named `block_hash`: already held (referenced if holding),
    or written into a free block (kept in `placed`). False when the group has no block to spare."""
    kv = core.kv
    pool = kv.groups[group].pool
    b = pool.lookup(block_hash)
    if b is not None:
        if hold is not None:
            pool.acquire([b])
            hold.append((group, b))
        return True
    if pool.num_free <= 2:  # never take the last free blocks: a running request may need them next step
        return False
    b = pool.allocate(1)[0]
    try:
        core.runner.tier_blocks.scatter_part(tensors, b, part)
    except ValueError:
        pool.release([b])
        return False
    kv._register(group, b, block_hash, pos)
    placed.append((group, b))
    return True


def _import_grouped(core: EngineCore, blocks: Sequence[tuple[bytes, Any]], hold: list[tuple[int, int]] | None) -> int:
    """`import_blocks` for `pack_exchange` payloads: each group's part into that group's pool; the run
    stops at the first position whose tier part does not fit (a bad payload, no free block)."""
    tb = core.runner.tier_blocks
    held = 0
    placed: list[tuple[int, int]] = []
    try:
        for h, payload in blocks:
            try:
                pos, tier, windows = tb.unpack_exchange(payload)
            except ValueError:
                break
            if not all(_take(core, tb.groups[k], h, pos, part, tb.tensors[k], hold, placed)
                       for k, part in tb.tier_parts(pos, tier)):
                break
            held += 1
            for k, part in enumerate(windows):
                if part is not None:
                    _take(core, tb.window_groups[k], h, pos, part, tb.window_tensors[k], hold, placed)
    finally:
        if hold is not None:
            hold.extend(placed)
        else:  # cached, free: the LRU evicts the run's tail first
            for group, b in reversed(placed):
                core.kv.groups[group].pool.release([b])
    return held
