"""One lookup / load / offload interface over the host-memory tier and the persistent store.

Owns the chaining rule between tiers and when blocks move between them::

    device pool --offload--> host tier --(write-through, or spill on eviction)--> store
    device pool <--load----- host tier <--(promote on load)------------------------ store

`lookup` returns the longest run of consecutive chain positions found: first in
host memory, then the store continues the chain where the host stopped.

Write-through is the default: every offloaded block is written to the store at
once. The store is what makes a prefix usable by other workers (prefill routing
without cache affinity) and after a restart or crash; spill-on-evict would keep
a prefix invisible to every other worker for as long as this worker's host tier
holds it, and lose it with the process. Spill-on-evict (`write_through=False`)
writes only what the host tier drops -- less store traffic, for one worker with
a private store; call `flush()` at shutdown to persist the rest.

Within one chain the host tier is filled tail first, so a prefix's head is the
most recently used and its tail is evicted first (heads are what other
prefixes share) -- the same order as the device pool's free queue.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from deepinfer.kvcache.host import HostKVCache, payload_nbytes
from deepinfer.kvcache.store import KVBlockStore


class TieredKVStore:
    """Host tier (optional) + persistent store (optional), chained by block position."""

    def __init__(self, host: HostKVCache | None, store: KVBlockStore | None, write_through: bool = True) -> None:
        self.host = host
        self.store = store
        self.write_through = write_through
        # spill mode: position, group hash and retention class of host blocks not yet in the store,
        # because a spilled block must be written into its chain's group
        self._origin: dict[bytes, tuple[int, bytes, str | None]] = {}
        self.counters: Counter[str] = Counter()

    def lookup(self, hashes: Sequence[bytes], start: int = 0) -> tuple[int, int]:
        """(num_host, num_store): blocks start .. start+num_host-1 are in host memory, the next num_store
        in the store. Changes no recency."""
        num_host = self.host.lookup(hashes, start) if self.host is not None else 0
        num_store = self.store.lookup(hashes, start + num_host) if self.store is not None else 0
        self.counters["lookups"] += 1
        self.counters["lookup_blocks"] += len(hashes) - start
        self.counters["host_hit_blocks"] += num_host
        self.counters["store_hit_blocks"] += num_store
        return num_host, num_store

    def load(self, hashes: Sequence[bytes], start: int = 0, count: int | None = None) -> list[Any]:
        """Payloads of consecutive blocks from `start` (at most `count`): host tier first, then the store.
        Store hits are promoted into the host tier. May return fewer than `lookup` promised (a block
        evicted, expired or found corrupt meanwhile): the caller recomputes the rest."""
        limit = len(hashes) if count is None else min(len(hashes), start + count)
        out: list[Any] = []
        p = start
        if self.host is not None:
            while p < limit:
                payload = self.host.get(hashes[p])
                if payload is None:
                    break
                out.append(payload)
                p += 1
            for h in reversed(hashes[start:p]):
                self.host.touch(h)
        self.counters["loaded_host_blocks"] += p - start
        if p < limit and self.store is not None:
            got = self.store.load(hashes, p, limit - p)
            out.extend(got)
            self.counters["loaded_store_blocks"] += len(got)
            if self.host is not None and got:
                self._promote(hashes, start, p, out[:p - start], got)
        self.counters["loads"] += 1
        return out

    def _promote(self, hashes: Sequence[bytes], start: int, p: int, head: list[Any], got: list[Any]) -> None:
        """Copy store hits (chain positions p ..) into host memory, behind the chain's head start .. p-1
        already there: only as many as fit without evicting that head, tail first, then the head
        re-touched so it stays the most recently used."""
        assert self.host is not None
        room = self.host.max_bytes - sum(payload_nbytes(x) for x in head)
        k = 0
        while k < len(got) and payload_nbytes(got[k]) <= room:
            room -= payload_nbytes(got[k])
            k += 1
        evicted = []
        for i in reversed(range(k)):
            evicted += self.host.insert(hashes[p + i], got[i])
        for h in reversed(hashes[start:p]):
            self.host.touch(h)
        self._spill(evicted)

    def offload(self, hashes: Sequence[bytes], payloads: Sequence[Any], retention_class: str | None = None,
                start: int = 0) -> None:
        """Blocks start .. start+len(payloads)-1 of the chain `hashes` leave the device: keep them in host
        memory and (write-through) in the store. Never raises for storage failures."""
        self.counters["offloaded_blocks"] += len(payloads)
        if self.store is not None and (self.write_through or self.host is None):
            self.store.put(hashes, payloads, retention_class, start)
        if self.host is None:
            return
        spill = self.store is not None and not self.write_through
        n = self.store.segment_blocks if spill else 1
        evicted = []  # spilled together, so consecutive blocks become one segment
        for i in reversed(range(len(payloads))):
            pos = start + i
            h = hashes[pos]
            if spill and h not in self.host:
                self._origin[h] = (pos, hashes[pos - pos % n], retention_class)
            evicted += self.host.insert(h, payloads[i])
        self._spill(evicted)

    def _spill(self, evicted: list[tuple[bytes, Any]]) -> None:
        """Write evicted host blocks that the store lacks, one segment per run of consecutive positions."""
        infos = [(self._origin.pop(h), h, payload) for h, payload in evicted if h in self._origin]
        if not infos or self.store is None:
            return
        infos.sort(key=lambda x: (x[0][1], x[0][0]))
        i = 0
        while i < len(infos):
            (pos, group, cls), _, _ = infos[i]
            j = i + 1
            while j < len(infos) and infos[j][0] == (pos + j - i, group, cls):
                j += 1
            run = infos[i:j]
            if self.store.put_run(group, pos, [x[1] for x in run], [x[2] for x in run], cls):
                self.counters["spilled_blocks"] += len(run)
            i = j

    def flush(self) -> None:
        """Spill mode: write every host block the store lacks (at shutdown); the host tier keeps them."""
        if self.host is not None:
            self._spill([(h, p) for h, p in self.host.items() if h in self._origin])

    def stats(self) -> dict[str, Any]:
        keys = ("lookups", "lookup_blocks", "host_hit_blocks", "store_hit_blocks", "loads", "loaded_host_blocks",
                "loaded_store_blocks", "offloaded_blocks", "spilled_blocks")
        out: dict[str, Any] = {k: self.counters[k] for k in keys}
        if self.host is not None:
            out["host"] = self.host.stats()
        if self.store is not None:
            out["store"] = self.store.stats()
        return out
