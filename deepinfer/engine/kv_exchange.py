"""Copying named KV blocks out of one engine and into another (prefill/decode disaggregation).

    prefill engine: export_blocks(prompt)  ─▶ [(block hash, payload)]  ─▶ KV transfer ─▶
    decode engine:  import_blocks(blocks)  ─▶ free-but-cached device blocks (prefix index) or host tier

Blocks are named by the chained block hash (`block_hash.py`), so an imported block is
found by the decode engine's ordinary prefix-cache lookup when the continued request
arrives: no new scheduling path. Both functions touch engine state and must run on
the engine's own thread (`EngineClient.call("export_kv_blocks" | "import_kv_blocks")` sees to it).

Export is best effort: it walks the prompt's full blocks in chain order and stops at
the first block neither the device pool nor the host tier holds (evicted meanwhile).
The receiver recomputes whatever it did not get, so a short export costs time, never
correctness.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from deepinfer.engine.block_hash import extend_block_hashes
from deepinfer.kvstore.blocks import gather_block, scatter_block

if TYPE_CHECKING:
    from deepinfer.engine.core import EngineCore


def prompt_block_hashes(core: EngineCore, token_ids: Sequence[int], cache_salt: str | None) -> list[bytes]:
    """The chained hashes of every full block of `token_ids` as this engine names them."""
    kv = core.kv
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(token_ids), kv.block_size, kv._root(cache_salt))
    return hashes


def export_blocks(core: EngineCore, token_ids: Sequence[int], cache_salt: str | None) -> list[tuple[bytes, Any]]:
    """(hash, payload) of the longest run of `token_ids`' full blocks still held on the device or in the
    host tier, from the first block on. Payloads are CPU uint8 tensors (`gather_block` layout)."""
    pool = core.kv.pool
    host = core.tiers.host if core.tiers is not None else None
    out: list[tuple[bytes, Any]] = []
    for h in prompt_block_hashes(core, token_ids, cache_salt):
        block = pool.lookup(h)
        if block is not None:
            out.append((h, gather_block(core.runner.kv_caches, block)))
            continue
        payload = host.get(h) if host is not None else None
        if payload is None:
            break
        out.append((h, payload))
    return out


def import_blocks(core: EngineCore, blocks: Sequence[tuple[bytes, Any]]) -> int:
    """Make `blocks` findable by this engine's prefix cache: into free device blocks (registered, then
    released, so they sit in the free queue as cached blocks), the rest into the host tier if there is one.
    Returns how many of them are now held (already-held ones count). Prefix caching off: 0."""
    kv = core.kv
    if not kv.enable_prefix_caching:
        return 0
    pool = kv.pool
    missing = [(h, p) for h, p in blocks if pool.lookup(h) is None]
    held = len(blocks) - len(missing)
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
        # release the prefix's first block last, so the LRU evicts the tail of the run first
        pool.release(list(reversed(ids)))
    held += len(placed)
    host = core.tiers.host if core.tiers is not None else None
    if host is not None and len(placed) == len(ids):
        for h, payload in missing[len(ids):]:
            host.put(h, payload)
            held += 1
    return held
