"""Stored Responses, for `previous_response_id` and `GET /v1/responses/{id}`.

Bounded two ways, so memory never grows without limit: at most `max_entries` (the oldest are
dropped first) and each entry at most `ttl` seconds old (expired entries are dropped on access and
on every insert). One store per app; only the event loop touches it, so it needs no lock.
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


class ResponseStore:
    def __init__(self, max_entries: int = 1000, ttl: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.ttl = ttl
        self._clock = clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, body: dict, messages: list[dict]) -> None:
        if self.max_entries <= 0:
            return
        now = self._clock()
        self._expire(now)
        self._items[response_id] = StoredResponse(body, messages, now)
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire(self._clock())
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def _expire(self, now: float) -> None:
        # insertion order is age order, so expired entries are at the front
        while self._items:
            key, item = next(iter(self._items.items()))
            if now - item.created <= self.ttl:
                return
            del self._items[key]
