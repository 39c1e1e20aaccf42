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

A payload is one chain position's K/V: KV group 0's block (`blocks.gather_block` of the runner's
`group_caches(0)`: every layer of a dense model, the full-attention layers of a model that also has
sliding-window layers), followed, for a position inside the window of the prompt's end, by each
sliding group's block, so the receiver's lookup finds the window too and continues exactly where the
sender stopped (no replay). Positions before that window carry group 0 only: nobody reads their
sliding KV again. Models with other kinds of groups (DeepSeek-V4) export nothing yet.

Export is best effort: it walks the prompt's full blocks in chain order and stops at
the first block neither the device pool nor the host tier holds (evicted meanwhile).
The receiver recomputes whatever it did not get, so a short export costs time, never
correctness.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from deepinfer.kvcache.blocks import gather_block, layout_of, scatter_block
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
    host tier, from the first block on. Payloads are CPU uint8 tensors (module docstring)."""
    hashes = prompt_block_hashes(core, token_ids, cache_salt, cache_tenant)
    return export_hashes(core, hashes, 0, _window_start(core, len(token_ids)))


def _window_start(core: EngineCore, num_prompt_tokens: int) -> int:
    """The first chain position whose sliding-window blocks a request continuing after this prompt (one
    more token: the first generated) reads: that of the hit its lookup can make, num_prompt_tokens //
    block_size blocks."""
    kv = core.kv
    end = num_prompt_tokens // kv.block_size * kv.block_size
    return min((g.spec.first_needed_block(end, kv.block_size) for g in kv.groups[1:]), default=0)


def export_hashes(core: EngineCore, hashes: Sequence[bytes], first_position: int = 0,
                  window_start: int = 0) -> list[tuple[bytes, Any]]:
    """(hash, payload) of the longest leading run of `hashes` (chain positions `first_position` ..) held on
    the device or in the host tier; positions from `window_start` on also carry the sliding groups' blocks
    while every sliding group still holds them. Nothing for a model whose groups the tiers do not take."""
    kv = core.kv
    if not kv.supports_tiers:
        return []
    pool = kv.pool
    runner = core.runner
    caches = runner.group_caches(0)
    sliding = [(g.pool, runner.group_caches(i)) for i, g in enumerate(kv.groups) if i > 0]
    host = core.tiers.host if core.tiers is not None else None
    out: list[tuple[bytes, Any]] = []
    for pos, h in enumerate(hashes, first_position):
        block = pool.lookup(h)
        if block is not None:
            payload = gather_block(caches, block)
        else:
            payload = host.get(h) if host is not None else None
            if payload is None:
                break
        if sliding and pos >= window_start:
            blocks = [p.lookup(h) for p, _ in sliding]
            if all(b is not None for b in blocks):
                parts = [_as_tensor(payload)] + [gather_block(c, b) for (_, c), b in zip(sliding, blocks, strict=True)]
                payload = torch.cat(parts)
        out.append((h, payload))
    return out


def _as_tensor(payload: Any) -> torch.Tensor:
    return payload if isinstance(payload, torch.Tensor) else torch.frombuffer(bytearray(payload), dtype=torch.uint8)


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
    return export_hashes(core, req.block_hashes[start:done], start, _window_start(core, req.num_prompt_tokens))


def import_blocks(core: EngineCore, blocks: Sequence[tuple[bytes, Any]], hold: list | None = None) -> int:
    """Make `blocks` findable by this engine's prefix cache: into free device blocks (registered, then
    released, so they sit in the free queue as cached blocks), the rest into the host tier if there is one.
    Returns how many of them are now held (already-held ones count). Prefix caching off: 0.
    `hold`: keep a reference on every device block of `blocks` instead (appended to `hold` as (group,
    block)), so none is evicted before the request that needs them arrives; `release_blocks(core, hold)`
    drops them. A payload's sliding-window part, if any, goes to the sliding groups' blocks."""
    kv = core.kv
    if not kv.enable_prefix_caching or not kv.supports_tiers:
        return 0
    runner = core.runner
    sizes = [layout_of(runner.group_caches(i)).block_nbytes for i in range(len(kv.groups))]
    main = [(h, _head(payload, sizes[0])) for h, payload in blocks]
    held = _import_group(core, 0, main, hold, allow_host=True)
    for i in range(1, len(kv.groups)):
        off = sum(sizes[:i])
        parts = [(h, _as_tensor(p)[off:off + sizes[i]]) for h, p in blocks if _nbytes(p) == sum(sizes)]
        _import_group(core, i, parts, hold, allow_host=False)
    return held


def _nbytes(payload: Any) -> int:
    return payload.numel() if isinstance(payload, torch.Tensor) else len(payload)


def _head(payload: Any, n: int) -> Any:
    """Group 0's part of a payload (the whole payload of a dense model)."""
    return payload if _nbytes(payload) == n else _as_tensor(payload)[:n]


def _import_group(core: EngineCore, index: int, blocks: Sequence[tuple[bytes, Any]], hold: list | None,
                  allow_host: bool) -> int:
    kv = core.kv
    pool = kv.groups[index].pool
    caches = core.runner.group_caches(index)
    found = [pool.lookup(h) for h, _ in blocks]
    missing = [blk for blk, b in zip(blocks, found, strict=True) if b is None]
    held = len(blocks) - len(missing)
    if hold is not None:
        present = [b for b in found if b is not None]
        pool.acquire(present)
        hold.extend((index, b) for b in present)
    # never take the last free blocks: a running request may need them next step
    room = max(0, min(len(missing), pool.num_free - kv.blocks_needed(kv.block_size * 2)))
    ids = pool.allocate(room) if room else []
    placed: list[int] = []
    try:
        for block, (h, payload) in zip(ids, missing, strict=False):
            scatter_block(caches, block, payload)
            if pool.register(block, h):
                placed.append(block)
    except ValueError:  # a payload of another layout: keep what came before it
        pass
    finally:
        kept = set(placed) if hold is not None else set()
        if hold is not None:
            hold.extend((index, b) for b in placed)
        # release the prefix's first block last, so the LRU evicts the tail of the run first
        pool.release([b for b in reversed(ids) if b not in kept])
    held += len(placed)
    host = core.tiers.host if core.tiers is not None and allow_host else None
    if host is not None and len(placed) == len(ids):
        for h, payload in missing[len(ids):]:
            host.insert(h, payload)
            held += 1
    return held


def release_blocks(core: EngineCore, hold: list) -> None:
    """Drop the references `import_blocks(..., hold)` took, the chain's first block last."""
    for index, group in enumerate(core.kv.groups):
        group.pool.release([b for i, b in reversed(hold) if i == index])
    hold.clear()
