"""Background writes into the persistent store: a byte-bounded queue drained by one thread.

Owns when a store write happens, not how (that is `KVBlockStore.put`). A
write-through put costs about a millisecond per block with fsync; done on the
engine thread it would stall every step that completes a block. The caller
hands over payloads it already copied (a device block may be reused for other
tokens as soon as its request frees it), so a queued write never reads live KV.

When the queue holds `max_pending_bytes`, new writes are dropped and counted
rather than blocking the engine: a missing store entry costs a recompute later,
a blocked engine costs latency now. `flush` waits until everything queued is
written (engine shutdown, tests); an `atexit` hook flushes writers nobody
closed, so a short offline run still persists what it computed.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from deepinfer.kvcache.host import payload_nbytes

logger = logging.getLogger(__name__)

# hashes, payloads, retention class, chain position of payloads[0] -> blocks written
PutFn = Callable[[Sequence[bytes], Sequence[Any], str | None, int], int]


class StoreWriter:
    """One daemon thread running `put` for queued block runs, oldest first."""

    def __init__(self, put: PutFn, max_pending_bytes: int = 256 * 2**20, flush_timeout_s: float = 60.0) -> None:
        self._put = put
        self.max_pending_bytes = max_pending_bytes
        self.flush_timeout_s = flush_timeout_s
        self._queue: deque[tuple[Sequence[bytes], list[Any], str | None, int, int]] = deque()
        self._cond = threading.Condition()
        self._pending_bytes = 0  # queued plus the write in progress
        self._closed = False
        self.submitted_blocks = 0
        self.dropped_blocks = 0
        self.written_blocks = 0
        self.failed_puts = 0
        self._thread = threading.Thread(target=self._run, name="deepinfer-kvstore-writer", daemon=True)
        self._thread.start()
        # a weak reference: the hook must not keep a discarded engine's writer alive
        ref = weakref.ref(self)
        self._atexit = lambda: (w := ref()) is not None and w.close()
        atexit.register(self._atexit)

    def submit(self, hashes: Sequence[bytes], payloads: list[Any], retention_class: str | None, start: int) -> bool:
        """Queue blocks start .. start+len(payloads)-1 of the chain `hashes`; False (dropped) when full or closed."""
        nbytes = sum(payload_nbytes(p) for p in payloads)
        with self._cond:
            if self._closed or self._pending_bytes + nbytes > self.max_pending_bytes:
                self.dropped_blocks += len(payloads)
                return False
            self._queue.append((hashes, payloads, retention_class, start, nbytes))
            self._pending_bytes += nbytes
            self.submitted_blocks += len(payloads)
            self._cond.notify_all()
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed and drained
                hashes, payloads, cls, start, nbytes = self._queue.popleft()
            try:
                written = self._put(hashes, payloads, cls, start)
            except Exception:  # noqa: BLE001 - a bug in one write must not stop every later one
                logger.exception("KV store write failed")
                written = 0
                self.failed_puts += 1
            with self._cond:
                self.written_blocks += written
                self._pending_bytes -= nbytes
                self._cond.notify_all()

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; False if `timeout` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending_bytes == 0 or not self._thread.is_alive(),
                                       timeout if timeout is not None else self.flush_timeout_s)

    def close(self) -> None:
        """Finish queued writes (bounded by `flush_timeout_s`), then stop the thread. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        atexit.unregister(self._atexit)
        self._thread.join(self.flush_timeout_s)
        if self._thread.is_alive():
            logger.warning("KV store writer: %d bytes of writes still pending at close", self._pending_bytes)

    def stats(self) -> dict[str, int]:
        return {"submitted_blocks": self.submitted_blocks, "dropped_blocks": self.dropped_blocks,
                "written_blocks": self.written_blocks, "failed_puts": self.failed_puts,
                "pending_bytes": self._pending_bytes}
