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

Models with sliding-window layer groups export nothing (the receiver recomputes): a payload is one
block id's K/V in every layer, and their groups keep different blocks.

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


def export_hashes(core: EngineCore, hashes: Sequence[bytes]) -> list[tuple[bytes, Any]]:
    """(hash, payload) of the longest leading run of `hashes` held on the device or in the host tier.
    Nothing for a model with sliding-window layers: its payloads are not one block id per position."""
    if not core.kv.supports_export:
        return []
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
    return export_hashes(core, req.block_hashes[start:done])


def import_blocks(core: EngineCore, blocks: Sequence[tuple[bytes, Any]], hold: list[int] | None = None) -> int:
    """Make `blocks` findable by this engine's prefix cache: into free device blocks (registered, then
    released, so they sit in the free queue as cached blocks), the rest into the host tier if there is one.
    Returns how many of them are now held (already-held ones count). Prefix caching off: 0.
    `hold`: keep a reference on every device block of `blocks` instead (appended to `hold`), so none is
    evicted before the request that needs them arrives; `release_blocks(core, hold)` drops them."""
    kv = core.kv
    if not kv.enable_prefix_caching or not kv.supports_export:
        return 0
    pool = kv.pool
    found = [pool.lookup(h) for h, _ in blocks]
    missing = [blk for blk, b in zip(blocks, found, strict=True) if b is None]
    held = len(blocks) - len(missing)
    if hold is not None:
        present = [b for b in found if b is not None]
        pool.acquire(present)
        hold.extend(present)
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
            hold.extend(placed)
        # release the prefix's first block last, so the LRU evicts the tail of the run first
        pool.release([b for b in reversed(ids) if b not in kept])
    held += len(placed)
    host = core.tiers.host if core.tiers is not None else None
    if host is not None and len(placed) == len(ids):
        for h, payload in missing[len(ids):]:
            host.insert(h, payload)
            held += 1
    return held


def release_blocks(core: EngineCore, hold: list[int]) -> None:
    """Drop the references `import_blocks(..., hold)` took, the chain's first block last."""
    core.kv.pool.release(list(reversed(hold)))
    hold.clear()
