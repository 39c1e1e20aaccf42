"""The engine's side of the KV tiers: moving blocks between the paged device cache and `TieredKVStore`.

Owns building the tiers from `KVStoreConfig`, and the three moves the KV manager asks for:

    a block is computed  ──write──▶ store        (write-through, subject to admission; on the background `StoreWriter`)
    the device pool evicts a block ─▶ host tier  (copied out on the engine thread, before reuse)
    a request is admitted with tier hits ─load─▶ its fresh device blocks (before its first step)

Write-through, not spill-on-evict: an admitted block goes to the store as soon as
it is computed (in segment-aligned runs, see `KVCacheManager`), so other workers
and a restarted engine can use it, and nothing is lost when the process dies.
Admission (`--kv-store-admit`): `always` writes every computed block; `reused`
(a unified server's default) writes a block at its second use -- a device or
host-tier hit (`reused`), or a recompute of a block this engine declined
before (`write`) -- so one-off prompts cost no disk traffic and cannot push
reused prefixes out of the store's LRU (a 32-stream server of unique prompts
on a 2-core CPU spent ~6% of its throughput writing them; BENCHMARKS.md,
session 28), except for the retention classes of `--kv-store-admit-always-
classes` (agent): an agent's context comes back every turn, and a turn the
tiers evicted before the next one would be recomputed. Prefill and decode
workers write everything: their router routes by what the shared store holds.

The host tier caches what the device pool dropped (plus, without the prefetcher,
store hits, which `TieredKVStore.load` promotes), so it duplicates little of the device. The two
moves are split because `TieredKVStore.offload` does both at the same moment,
synchronously.

A payload is one chain position of the tier groups' blocks (`blocks.TierBlocks`: every layer's K/V
for a dense model, the full layers' for one with sliding layers, DeepSeek-V4's compressed entries);
the manager hands over a request's block tables and this module asks `TierBlocks` which device
blocks a position's bytes come from and go to.

Loads of store hits are split in two (`StorePrefetcher`, on by default): while the request waits,
the prefetch thread reads and verifies its store objects into host memory (the scheduler runs other
requests meanwhile); once they are staged it is admitted, and `load` copies the staged and host-tier
payloads into its device blocks on the engine thread -- a memcpy, no I/O. With the prefetcher off,
`load` reads the store itself, synchronously, between scheduling a step and preparing its inputs.
Staged store blocks are not promoted into the host tier: they go to the device, and the host tier
gets them when the device pool evicts them (`evicted`).

Anything unexpected from a tier (an exception, a payload of the wrong size) is
logged and treated as a miss: the request recomputes, nothing unverified is
served, and no storage failure reaches the caller.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from typing import Any

from deepinfer.config import KVStoreConfig, resolve_size
from deepinfer.kvcache import HostKVCache, KVBlockStore, KVLayout, RetentionPolicy, TieredKVStore
from deepinfer.kvcache.blocks import TierBlocks
from deepinfer.kvcache.host import payload_nbytes
from deepinfer.kvcache.manager import consecutive_runs
from deepinfer.kvcache.prefetch import Staged, StorePrefetcher
from deepinfer.kvcache.writer import StoreWriter

logger = logging.getLogger(__name__)


class KVTiers:
    """Host tier and persistent store wired to one engine's paged KV cache."""

    # how many declined block hashes "reused" admission remembers (~2 MB of dict; at 16-token blocks, the
    # last ~1M computed tokens: a prefix needed again after more than that is stored at its third use)
    SEEN_CAPACITY = 1 << 16

    def __init__(self, tiers: TieredKVStore, blocks: TierBlocks, writer: StoreWriter | None = None,
                 prefetch: bool = True, prefetch_wait_s: float = 0.05, admit: str = "always",
                 always_classes: frozenset[str] = frozenset()) -> None:
        if admit not in ("always", "reused"):
            raise ValueError(f"store admission must be always or reused, got {admit!r}")
        self.admit = admit
        self.always_classes = always_classes  # retention classes written at once under "reused"
        self._declined: dict[bytes, None] = {}  # block hashes not written at their first use, oldest first
        self.declined_blocks = 0
        self.tiers = tiers
        self.blocks = blocks
        self.layout = blocks.layout
        self.writer = writer
        self.prefetcher = (StorePrefetcher(tiers.store, tiers.host, admit_wait_s=prefetch_wait_s)
                           if prefetch and tiers.store is not None else None)
        # a store write covers whole segments when it can: runs are cut at multiples of this
        self.group_blocks = tiers.store.segment_blocks if tiers.store is not None else 1
        self.errors = 0
        self.evicted_to_host = 0
        self._closed = False

    @classmethod
    def from_config(cls, config: KVStoreConfig, model_identity: str, blocks: TierBlocks) -> KVTiers | None:
        """The configured tiers, or None when both are off (host_cache_memory 0, kv_store none)."""
        import psutil

        retention = config.retention
        layout = blocks.layout
        host_bytes = resolve_size(config.host_cache_memory, psutil.virtual_memory().available)
        host = HostKVCache(host_bytes) if host_bytes >= layout.block_nbytes else None
        store = _open_store(config, model_identity, layout, retention)
        if host is None and store is None:
            return None
        writer = StoreWriter(store.put) if store is not None else None
        logger.info("KV tiers: host %s, store %s", f"{host_bytes / 2**20:.0f} MiB" if host is not None else "off",
                    store.root if store is not None else "off")
        return cls(TieredKVStore(host, store), blocks, writer, config.kv_store_prefetch,
                   config.kv_store_prefetch_wait_ms / 1000, config.admission(), config.always_classes())

    @property
    def host(self) -> HostKVCache | None:
        return self.tiers.host

    @property
    def store(self) -> KVBlockStore | None:
        return self.tiers.store

    def _failed(self, what: str) -> None:
        self.errors += 1
        logger.exception("KV tiers: %s failed; treating it as a miss", what)

    # ------------------------------------------------------------------ the three moves

    def lookup(self, hashes: Sequence[bytes], start: int) -> tuple[int, int]:
        """(blocks in host memory, blocks in the store that follow) from chain position `start`."""
        try:
            return self.tiers.lookup(hashes, start)
        except Exception:  # noqa: BLE001 - a broken tier must cost a recompute, never a request
            self._failed("lookup")
            return 0, 0

    def evicted(self, block_hash: bytes, pos: int, blocks: list[int] | None) -> None:
        """A device pool is about to reuse a block of chain position `pos`, named `block_hash`; `blocks`:
        the position's device blocks (`TierBlocks.carried` order) while they all still hold its KV, None
        if one is gone (then the position cannot be copied whole)."""
        host = self.tiers.host
        if host is None:
            return
        if block_hash in host:  # loaded from there (or promoted): no copy needed, but it was just used
            host.touch(block_hash)
            return
        if blocks is None:
            return
        try:
            host.insert(block_hash, self.blocks.gather(pos, blocks))
            self.evicted_to_host += 1
        except Exception:  # noqa: BLE001
            self._failed("host offload")

    def write(self, hashes: Sequence[bytes], tables: Sequence[Sequence[int]], start: int, count: int,
              retention_class: str | None) -> None:
        """Queue chain positions start .. start+count-1 of a request (its block `tables`, one per layer
        group), which it computed, for the store; copies them now. Stops before a position whose blocks are
        not all there. With "reused" admission only the leading positions computed before (declined then)
        are written; the rest are remembered as declined."""
        if self.writer is None or count <= 0:
            return
        if self.admit == "reused" and self.tiers.store.retention.resolve(retention_class) not in self.always_classes:
            end = start + count
            count = 0
            while count < end - start and hashes[start + count] in self._declined:
                del self._declined[hashes[start + count]]
                count += 1
            self._decline(hashes[start + count:end])
        self._write(hashes, tables, start, count, retention_class)

    def reused(self, hashes: Sequence[bytes], tables: Sequence[Sequence[int]], start: int, count: int,
               retention_class: str | None) -> None:
        """A request found chain positions start .. start+count-1 cached (in the device pool, or loaded from
        the host tier: its `tables` hold them now): under "reused" admission, write those of them declined
        earlier, now needed a second time."""
        if self.admit != "reused" or self.writer is None or not self._declined:
            return
        due = [pos for pos in range(start, start + count) if hashes[pos] in self._declined]
        for pos in due:
            del self._declined[hashes[pos]]
        for run_start, run_count in consecutive_runs(due):
            self._write(hashes, tables, run_start, run_count, retention_class)

    def _decline(self, hashes: Sequence[bytes]) -> None:
        declined = self._declined
        for h in hashes:
            declined.pop(h, None)  # re-inserted: the newest
            declined[h] = None
        self.declined_blocks += len(hashes)
        while len(declined) > self.SEEN_CAPACITY:
            del declined[next(iter(declined))]

    def _write(self, hashes: Sequence[bytes], tables: Sequence[Sequence[int]], start: int, count: int,
               retention_class: str | None) -> None:
        if count <= 0:
            return
        try:
            payloads = []
            for pos in range(start, start + count):
                blocks = self.blocks.device_blocks(pos, tables)
                if blocks is None:
                    break
                payloads.append(self.blocks.gather(pos, blocks))
        except Exception:  # noqa: BLE001
            self._failed("gather for the store")
            return
        if payloads:
            # the chain up to the run's end: the store names groups by their first hash
            self.writer.submit(tuple(hashes[:start + len(payloads)]), payloads, retention_class, start)

    def memory_prefix(self, hashes: Sequence[bytes], start: int, staged: Staged) -> tuple[int, int]:
        """(blocks, of which staged from the store): consecutive chain positions from `start` held in
        `staged` or the host tier -- what `load` can copy without I/O. Changes no recency."""
        host = self.tiers.host
        n = from_store = 0
        for h in hashes[start:]:
            got = staged.get(h)
            if got is None and (host is None or h not in host):
                break
            n += 1
            from_store += got is not None and got[1] == "store"
        return n, from_store

    def load(self, hashes: Sequence[bytes], tables: Sequence[Sequence[int]], start: int, count: int,
             staged: Staged | None = None) -> tuple[int, int]:
        """Fill a request's device blocks (its `tables`, one per layer group, fresh blocks for these
        positions) with chain positions start .. start+count-1 from the tiers, in order, stopping at the
        first position that does not come back verified. With `staged` (a prefetch), from it and the
        host tier only; else from the host tier, then the store (read here). Returns (from host, from store)."""
        counters = self.tiers.counters
        host_before, store_before = counters["loaded_host_blocks"], counters["loaded_store_blocks"]
        try:
            if staged is None:
                payloads = self.tiers.load(hashes, start, count)
                tiers = None
            else:
                payloads, tiers = self._from_memory(hashes, start, count, staged)
        except Exception:  # noqa: BLE001
            self._failed("load")
            return 0, 0
        # a payload of another size, or a position without its blocks, ends the run: it and what follows
        # are recomputed
        n, targets = 0, []
        while n < min(count, len(payloads)):
            pos = start + n
            blocks = self.blocks.device_blocks(pos, tables)
            if blocks is None or payload_nbytes(payloads[n]) != self.layout.nbytes(pos):
                self.errors += 1
                logger.error("KV tiers: position %d: a payload of %d bytes, not %d (or no blocks); recomputing "
                             "from there", pos, payload_nbytes(payloads[n]), self.layout.nbytes(pos))
                break
            targets.append(blocks)
            n += 1
        try:
            self.blocks.scatter(range(start, start + n), targets, payloads[:n])
        except Exception:  # noqa: BLE001
            self._failed("scatter")
            n = 0
        if tiers is not None:
            from_host = tiers[:n].count("host")
            counters["loaded_host_blocks"] += from_host
            counters["loaded_store_blocks"] += n - from_host
            return from_host, n - from_host
        from_host = min(n, counters["loaded_host_blocks"] - host_before)
        return from_host, min(n - from_host, counters["loaded_store_blocks"] - store_before)

    def _from_memory(self, hashes: Sequence[bytes], start: int, count: int,
                     staged: Staged) -> tuple[list[Any], list[str]]:
        """Payloads (and their tiers) of consecutive positions from `start` in `staged` or the host tier."""
        host = self.tiers.host
        payloads, tiers = [], []
        for h in hashes[start:start + count]:
            got = staged.get(h)
            if got is None:
                payload = host.get(h) if host is not None else None
                if payload is None:
                    break
                got = (payload, "host")
            payloads.append(got[0])
            tiers.append(got[1])
        return payloads, tiers

    # ------------------------------------------------------------------ lifecycle and stats

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued store writes are on disk."""
        return self.writer.flush(timeout) if self.writer is not None else True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.writer is not None:
            self.writer.close()
        if self.tiers.store is not None:
            self.tiers.store.close()

    def stats(self) -> dict[str, float]:
        """Flat counters for engine stats / metrics, every key of STAT_KEYS (cheap: no file system access)."""
        t = self.tiers.stats()
        out = dict.fromkeys(STAT_KEYS, 0.0)
        out.update(kv_tier_errors=self.errors, kv_host_offloaded_blocks=self.evicted_to_host,
                   kv_loaded_host_blocks=t["loaded_host_blocks"], kv_loaded_store_blocks=t["loaded_store_blocks"])
        host = t.get("host")
        if host is not None:
            out.update(kv_host_bytes=host["bytes"], kv_host_max_bytes=host["max_bytes"],
                       kv_host_blocks=host["entries"], kv_host_evictions=host["evictions"])
        store = t.get("store")
        if store is not None:
            for key in _STORE_KEYS:
                out[f"kv_store_{key}"] = store[key]
        if self.prefetcher is not None:
            p = self.prefetcher.stats()
            for key in _PREFETCH_KEYS:
                out[f"kv_prefetch_{key}"] = p[key]
        if self.writer is not None:
            w = self.writer.stats()
            out.update(kv_store_dropped_queue_blocks=w["dropped_blocks"], kv_store_pending_bytes=w["pending_bytes"],
                       kv_store_declined_blocks=self.declined_blocks)
        return out


_STORE_KEYS = ("written_blocks", "get_blocks", "corrupt", "expired", "read_errors", "write_errors",
               "dropped_capacity", "evicted")
_PREFETCH_KEYS = ("requests", "store_blocks", "short_reads", "errors", "timeouts", "refused", "read_seconds",
                  "staged_bytes", "in_flight")
STAT_KEYS = ("kv_tier_errors", "kv_host_offloaded_blocks", "kv_loaded_host_blocks", "kv_loaded_store_blocks",
             "kv_host_bytes", "kv_host_max_bytes", "kv_host_blocks", "kv_host_evictions",
             *(f"kv_store_{k}" for k in _STORE_KEYS), "kv_store_dropped_queue_blocks", "kv_store_pending_bytes",
             "kv_store_declined_blocks",
             *(f"kv_prefetch_{k}" for k in _PREFETCH_KEYS))


def tier_stats(tiers: KVTiers | None) -> dict[str, float]:
    """`tiers.stats()`, or zeros for every key when there are no tiers."""
    return tiers.stats() if tiers is not None else dict.fromkeys(STAT_KEYS, 0.0)


# OpenAI's `prompt_cache_retention` values, so its clients work unchanged: both ask for *at least*
# that long. "in-memory" (minutes) gets the default class; "24h" the default class if it keeps
# entries a day, else the class that keeps them longest.
OPENAI_RETENTION = ("in-memory", "24h")


def resolve_retention(policy: RetentionPolicy, retention_class: str | None) -> str:
    """`retention_class` if the policy knows it (or one of OpenAI's values, mapped), the default class
    for None; ValueError otherwise."""
    if retention_class is None or retention_class == "in-memory":
        return policy.default_class
    if retention_class == "24h" and retention_class not in policy.ttls:
        if policy.ttls[policy.default_class] >= 86400:
            return policy.default_class
        return max(policy.ttls, key=policy.ttls.__getitem__)
    if retention_class not in policy.ttls:
        raise ValueError(f"unknown cache retention class {retention_class!r}; this server has "
                         f"{', '.join(sorted(policy.ttls))} (and OpenAI's {', '.join(OPENAI_RETENTION)})")
    return retention_class


def _open_store(config: KVStoreConfig, model_identity: str, layout: KVLayout,
                retention: RetentionPolicy) -> KVBlockStore | None:
    """The configured store, or None if off or unusable (logged: the engine then runs without it)."""
    path = config.store_path()
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
        total = shutil.disk_usage(path).total
    except OSError as e:
        total = 0  # an absolute size still works: the store counts each failed write and reads what it can
        logger.warning("KV store %s: %s", path, e)
    max_bytes = resolve_size(config.kv_store_max_bytes, total)
    if max_bytes <= 0:
        logger.warning("KV store %s is off: its capacity %r resolves to 0 bytes", path, config.kv_store_max_bytes)
        return None
    return KVBlockStore(path, model_identity, layout, max_bytes, retention, fsync=config.kv_store_fsync)
