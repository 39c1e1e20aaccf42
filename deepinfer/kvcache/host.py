"""The host-memory KV tier: a byte-bounded LRU map from block hash to block payload (`ByteLRU`, the map
itself, which the runner's cache of encoded image tiles uses too; `HostKVCache`, the tier on it).

Owns nothing but memory accounting and recency: a payload is whatever the caller
hands in (bytes, a memoryview, a uint8 tensor -- on CUDA, pinned host memory)
holding the K and V of one block for every layer. Every operation is O(1) per
block (an OrderedDict in recency order). `insert` (one block) returns the entries it
evicted, so the tier facade can spill them to the persistent store.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from deepinfer.kvcache.tier import KVTier


def payload_nbytes(payload: Any) -> int:
    n = getattr(payload, "nbytes", None)  # memoryview, numpy, torch all have it
    return int(n) if n is not None else len(payload)


class ByteLRU:
    """A byte-bounded LRU map from a digest to a payload (anything with `nbytes`, or bytes): the host tier's
    mechanism, also the encoded image tiles by tile digest (`multimodal/encoder.py`'s `TileEncoder.cache`)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[bytes, Any] = OrderedDict()
        self._sizes: dict[bytes, int] = {}
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.inserts = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def get(self, block_hash: bytes) -> Any | None:
        """The payload (now most recently used), or None."""
        payload = self._entries.get(block_hash)
        if payload is None:
            self.misses += 1
            return None
        self._entries.move_to_end(block_hash)
        self.hits += 1
        return payload

    def touch(self, block_hash: bytes) -> None:
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)

    def insert(self, block_hash: bytes, payload: Any) -> list[tuple[bytes, Any]]:
        """Insert (or refresh) a block as most recently used; returns the (hash, payload) pairs evicted to
        make room. A payload larger than the whole tier is not kept: it comes back as evicted."""
        size = payload_nbytes(payload)
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return []
        if size > self.max_bytes:
            return [(block_hash, payload)]
        evicted = []
        while self.nbytes + size > self.max_bytes:
            h, p = self._entries.popitem(last=False)
            self.nbytes -= self._sizes.pop(h)
            self.evictions += 1
            evicted.append((h, p))
        self._entries[block_hash] = payload
        self._sizes[block_hash] = size
        self.nbytes += size
        self.inserts += 1
        return evicted

    def pop(self, block_hash: bytes) -> Any | None:
        payload = self._entries.pop(block_hash, None)
        if payload is not None:
            self.nbytes -= self._sizes.pop(block_hash)
        return payload

    def items(self) -> list[tuple[bytes, Any]]:
        """Entries from least to most recently used."""
        return list(self._entries.items())

    def clear(self) -> None:
        self._entries.clear()
        self._sizes.clear()
        self.nbytes = 0

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._entries), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "misses": self.misses, "inserts": self.inserts, "evictions": self.evictions}


class HostKVCache(ByteLRU, KVTier):
    """Bounded (bytes) LRU cache of KV block payloads keyed by chained block hash."""

    def lookup(self, hashes: Sequence[bytes], start: int = 0) -> int:
        """How many consecutive hashes from `start` are held (recency unchanged: a lookup is not a use)."""
        n = start
        while n < len(hashes) and hashes[n] in self._entries:
            n += 1
        return n - start

    def load(self, hashes: Sequence[bytes], start: int = 0, count: int | None = None) -> list[Any]:
        limit = len(hashes) if count is None else min(len(hashes), start + count)
        out = []
        for h in hashes[start:limit]:
            payload = self.get(h)
            if payload is None:
                break
            out.append(payload)
        return out

    def put(self, hashes: Sequence[bytes], payloads: Sequence[Any], retention_class: str | None = None,
            start: int = 0) -> int:
        """Insert a run, its tail first, so its head ends most recently used (heads are what other prefixes
        share). Whatever this evicts is dropped; the tier facade uses `insert` to spill evictions."""
        if start + len(payloads) > len(hashes):
            raise ValueError(f"{len(payloads)} payloads from position {start} need {start + len(payloads)} hashes")
        kept = 0
        for i in reversed(range(len(payloads))):
            h = hashes[start + i]
            held = h in self._entries
            evicted = self.insert(h, payloads[i])
            kept += not held and not any(e == h for e, _ in evicted)
        return kept
