"""Stored Responses, for `previous_response_id` and `GET /v1/responses/{id}`.

Bounded two ways, so memory never grows without limit: at most `max_entries` (the oldest are
dropped first) and each entry at most `ttl` seconds old (expired entries are dropped on access and
on every insert). One store per app; only the event loop touches it, so it needs no lock.

Each response belongs to the tenant that created it (`request.state.cache_tenant`: the cache namespace of
its API key, None without keys): `get` and `delete` with any other tenant find nothing, exactly as for an
unknown id, so a response id that leaks (logs, a shared trace) neither reads, continues nor deletes
another tenant's conversation, nor tells that it exists. Keys of one `KEY=GROUP` group share one
namespace and so their responses (a rotated key keeps its conversations).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class StoredResponse:
    body: dict  # the Response object as returned
    messages: list[dict]  # the whole conversation it ended: its input (with history) + its output
    created: float
    tenant: str | None = None  # who may read, continue or delete it


class ResponseStore:
    def __init__(self, max_entries: int = 1000, ttl: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.ttl = ttl
        self._clock = clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, body: dict, messages: list[dict], tenant: str | None = None) -> None:
        if self.max_entries <= 0:
            return
        now = self._clock()
        self._expire(now)
        self._items[response_id] = StoredResponse(body, messages, now, tenant)
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def get(self, response_id: str, tenant: str | None = None) -> StoredResponse | None:
        self._expire(self._clock())
        item = self._items.get(response_id)
        return item if item is not None and item.tenant == tenant else None

    def delete(self, response_id: str, tenant: str | None = None) -> bool:
        if self.get(response_id, tenant) is None:
            return False
        del self._items[response_id]
        return True

    def _expire(self, now: float) -> None:
        # insertion order is age order, so expired entries are at the front
        while self._items:
            key, item = next(iter(self._items.items()))
            if now - item.created <= self.ttl:
                return
            del self._items[key]
