"""The interface every KV tier below the device pool implements: lookup / load / put by chained hash.

A tier holds block payloads (one chain position of the groups kept for the whole sequence: the K and
V of every layer for a dense model, DeepSeek-V4's compressed entries; `blocks.TierBlocks` lays them
out) named by the chained block hashes of `hashing.py`.
Positions are chain positions: block i of a prefix is `hashes[i]`, and a hash names its
whole prefix, so a tier answers for runs of consecutive positions, never single blocks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any


class KVTier(ABC):
    """A store of KV block payloads keyed by chained block hash.

    Contract:
    - `lookup(hashes, start)` returns n >= 0 such that positions start .. start+n-1 of the chain
      are held (a tier may check headers but need not read payloads). It changes no recency: a
      lookup is not a use.
    - `load(hashes, start, count)` returns the payloads of the longest held run from `start` (at
      most `count`), in chain order, as fresh buffers the caller owns. It may return fewer than
      `lookup` promised (evicted, expired, found corrupt meanwhile); a corrupt block is never
      returned. Loaded blocks become the most recently used.
    - `put(hashes, payloads, retention_class, start)` stores blocks start .. start+len(payloads)-1
      of the chain (which must reach that far; earlier positions name the run's context). Blocks
      already held are skipped. Returns how many it newly holds. Storage failures are counted,
      never raised; a payload of the wrong size is a ValueError.
    - None of them raises for a missing block: absence is an answer (0, [], 0).
    """

    @abstractmethod
    def lookup(self, hashes: Sequence[bytes], start: int = 0) -> int: ...

    @abstractmethod
    def load(self, hashes: Sequence[bytes], start: int = 0, count: int | None = None) -> list[Any]: ...

    @abstractmethod
    def put(self, hashes: Sequence[bytes], payloads: Sequence[Any], retention_class: str | None = None,
            start: int = 0) -> int: ...
