"""Store hits read ahead of admission, off the engine thread: `StorePrefetcher`.

Owns the staging of a waiting request's tier hits in host memory before it gets device blocks::

    waiting request, prefix continues in the store ─start─▶ read + verify on the prefetch thread
        (scheduler skips it, runs the others)                       │
    admitted with the staged blocks as memory hits ◀──staged()── done
        ─▶ KVTiers.load copies them into its fresh device blocks (a memcpy, before its first step)

Contract (every method is called from the engine thread; only `KVBlockStore.get` -- file I/O and the
per-block CRC check -- runs on the prefetch thread, and nothing there touches the device, the block
pool or the host tier):

- `start` takes references to the request's host-tier hits at once (so the host tier evicting them
  meanwhile cannot break the chain) and queues the read of its store hits. Nothing is allocated on the
  device while it runs: the request holds no device blocks until it is admitted.
- `staged` is `PENDING` while the read runs, then the staged payloads by block hash (host refs and
  verified store blocks), None for a request with no prefetch. A request is admitted at the first
  step boundary after its read is done, so a read that overlaps a step delays that request by the
  rest of the step. To keep that price off fast reads, `staged` may block for reads started since
  `begin_step`, for at most `admit_wait_s` per step in total (the engine stalls that long at worst,
  once per step, however slow the store); a read still running then goes on in the background and
  later steps never wait for it.
- A read that raises, returns fewer blocks than the lookup promised (corrupt, truncated, expired or
  evicted meanwhile) or takes longer than `timeout_s` stages only what verified before it (possibly
  nothing): the rest is a miss and is recomputed. Unverified bytes are never staged.
- `release` forgets a request's staging: after admission, or when it is aborted, finished or
  preempted. A read not started yet is cancelled; one running finishes on its thread and its result is
  dropped. Staged memory is bounded by `max_staged_bytes`: past it `start` refuses (the request waits
  and asks again next step) unless nothing is staged, so one request larger than the bound still runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Final

from deepinfer.kvcache import HostKVCache, KVBlockStore

logger = logging.getLogger(__name__)

PENDING: Final = "pending"
# block hash -> (payload, the tier it came from: "host" or "store")
Staged = dict[bytes, tuple[Any, str]]


@dataclass
class _Job:
    started: float
    nbytes: int
    first: int  # chain position the staging starts at (the device prefix's end when it started)
    store_hashes: tuple[bytes, ...]  # of the blocks read from the store, in chain order
    staged: Staged = field(default_factory=dict)
    future: Future[tuple[list[Any], float]] | None = None
    done: bool = False


class StorePrefetcher:
    """Reads requests' store hits on one background thread and stages them (with their host hits)."""

    def __init__(self, store: KVBlockStore, host: HostKVCache | None, max_staged_bytes: int = 512 * 2**20,
                 timeout_s: float = 10.0, admit_wait_s: float = 0.05) -> None:
        self.store = store
        self.host = host
        self.max_staged_bytes = max_staged_bytes
        self.timeout_s = timeout_s
        self.admit_wait_s = admit_wait_s
        self._step_started = float("inf")  # reads started since then may be waited for (until + admit_wait_s)
        self._jobs: dict[str, _Job] = {}
        self._staged_bytes = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-kv-prefetch")
        self._closed = False
        self.counters = dict.fromkeys(
            ("requests", "store_blocks", "short_reads", "errors", "timeouts", "refused", "read_seconds"), 0.0)

    @property
    def staged_bytes(self) -> int:
        return self._staged_bytes

    def __contains__(self, request_id: str) -> bool:
        """Whether `request_id` has a prefetch (running or staged)."""
        return request_id in self._jobs

    def begin_step(self) -> None:
        """A step is being scheduled: reads started from now on may be waited for (see `staged`)."""
        self._step_started = time.monotonic()

    def start(self, request_id: str, hashes: Sequence[bytes], first: int, num_host: int, num_store: int) -> bool:
        """Stage chain positions first .. first+num_host-1 from the host tier and queue the read of the
        next `num_store` from the store. False (nothing started) when the staging bound is reached or
        the prefetcher is closed; a request that already has a prefetch keeps it (True)."""
        if request_id in self._jobs:
            return True
        nbytes = self.store.layout.run_nbytes(first, num_host + num_store)
        if self._closed or (self._jobs and self._staged_bytes + nbytes > self.max_staged_bytes):
            self.counters["refused"] += 1
            return False
        store_first = first + num_host
        job = _Job(time.monotonic(), nbytes, first, tuple(hashes[store_first:store_first + num_store]))
        for p in range(first, store_first):
            payload = self.host.get(hashes[p]) if self.host is not None else None
            if payload is None:  # evicted since the lookup: the chain stops here, a store read would be wasted
                job.store_hashes = ()
                break
            job.staged[hashes[p]] = (payload, "host")
        if job.store_hashes:
            # the store names a group by its first hash: the read needs the chain from position 0
            chain = tuple(hashes[:store_first + num_store])
            job.future = self._pool.submit(self._read, chain, store_first, num_store)
        else:
            job.done = True
        self._jobs[request_id] = job
        self._staged_bytes += nbytes
        self.counters["requests"] += 1
        return True

    def first_position(self, request_id: str) -> int | None:
        """The chain position `request_id`'s staging starts at, None without a prefetch."""
        job = self._jobs.get(request_id)
        return job.first if job is not None else None

    def _read(self, hashes: tuple[bytes, ...], start: int, count: int) -> tuple[list[Any], float]:
        t = time.perf_counter()
        return self.store.load(hashes, start, count), time.perf_counter() - t

    def staged(self, request_id: str) -> Staged | str | None:
        """PENDING while the request's read runs; its staged payloads once done; None without a prefetch."""
        job = self._jobs.get(request_id)
        if job is None:
            return None
        if not job.done and job.future is not None:  # a job without a store read is done at start
            wait_s = self._step_started + self.admit_wait_s - time.monotonic()
            if job.started >= self._step_started and wait_s > 0:
                wait_futures([job.future], timeout=wait_s)
            if not job.future.done():
                if time.monotonic() - job.started < self.timeout_s:
                    return PENDING
                self.counters["timeouts"] += 1
                logger.warning("KV prefetch of %s: store read still running after %.1f s; recomputing",
                               request_id, self.timeout_s)
                job.future.cancel()
            else:
                self._collect(job, job.future)
            job.done = True
        return job.staged

    def _collect(self, job: _Job, future: Future[tuple[list[Any], float]]) -> None:
        """Stage the finished read's blocks (the store returns a verified run from the first position)."""
        try:
            payloads, seconds = future.result()
        except Exception:  # noqa: BLE001 - a failed read is a miss, never a failed request
            self.counters["errors"] += 1
            logger.exception("KV prefetch: store read failed; treating it as a miss")
            return
        self.counters["read_seconds"] += seconds
        self.counters["store_blocks"] += len(payloads)
        if len(payloads) < len(job.store_hashes):
            self.counters["short_reads"] += 1
        for h, payload in zip(job.store_hashes, payloads, strict=False):
            job.staged[h] = (payload, "store")

    def release(self, request_id: str) -> None:
        """Forget `request_id`'s prefetch (idempotent): staged payloads dropped, a queued read cancelled."""
        job = self._jobs.pop(request_id, None)
        if job is None:
            return
        self._staged_bytes -= job.nbytes
        if job.future is not None and not job.done:
            job.future.cancel()

    def in_flight(self) -> list[Future[tuple[list[Any], float]]]:
        """The reads still queued or running (an idle engine waits on them rather than spinning)."""
        return [j.future for j in self._jobs.values() if not j.done and j.future is not None and not j.future.done()]

    def close(self) -> None:
        """Drop every staging and stop the thread; a read in progress is not waited for (a stuck
        filesystem must not hang shutdown) and its result is dropped."""
        self._closed = True
        for request_id in list(self._jobs):
            self.release(request_id)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict[str, float]:
        return {**self.counters, "staged_bytes": self._staged_bytes, "in_flight": len(self._jobs)}
