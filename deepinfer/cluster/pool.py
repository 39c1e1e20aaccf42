"""The router's view of its workers: membership, health, load, and what it has in flight on each.

    add(url, role) / register (heartbeat) ─▶ Worker ─▶ poll loop: GET /internal/load every interval
                                                         ok  ─▶ load report, last_seen, back in rotation
                                                         err ─▶ failures; out of rotation (dead) at once
    rotation(role): live workers, each as a `WorkerView` = its last report merged with the requests this
    router sent it since (a report lags; without the merge a burst would all go to one worker); queued
    prefill seconds also count down from the report at one second per second; `views` gives workers on the
    same hardware one cost model and one vision-tower speed (`peer_cost_models`, `peer_tile_seconds`)

A worker leaves rotation when a poll fails, when a request to it fails at the connection
level (`mark_failed`), or when it has not been heard from for `worker_timeout` seconds;
it rejoins on the next successful poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from deepinfer.cluster.auth import token_headers
from deepinfer.cluster.policies import WorkerView, queued_since
from deepinfer.engine.cost_model import CostModel

logger = logging.getLogger(__name__)


WORKER_ROLES = ("prefill", "decode", "encode")


@dataclass
class Worker:
    url: str
    role: str
    load: dict[str, Any] = field(default_factory=dict)
    alive: bool = False
    last_seen: float = 0.0
    report_at: float = 0.0  # when the poll that brought `load` was sent (monotonic)
    failures: int = 0
    # requests this router has in flight on the worker; prefill: request id -> (sent at, estimated seconds)
    inflight_prefill: dict[str, tuple[float, float]] = field(default_factory=dict)
    inflight_decode_tokens: dict[str, int] = field(default_factory=dict)
    inflight_encode: dict[str, int] = field(default_factory=dict)  # encode: call -> image tiles
    requests_routed: int = 0
    prefill_seconds_routed: float = 0.0  # estimated prefill compute of the requests sent to it
    decode_tokens_routed: int = 0  # prompt + max_tokens of the requests sent to it to decode
    _cost: CostModel | None = None
    _cost_key: tuple | None = None

    def cost_model(self) -> CostModel | None:
        coef = self.load.get("cost_coefficients")
        if not coef:
            return None
        key = tuple(coef)
        if key != self._cost_key:
            try:
                self._cost, self._cost_key = CostModel(key), key
            except ValueError:
                return None
        return self._cost

    def queued_prefill_seconds(self, now: float | None = None) -> float:
        """The worker's last report of its queued prefill compute, less the time since (it works its
        queue off at about a second per second), plus what this router sent it after that report.
        Neither half alone will do: the report lags a burst by up to a poll interval, and the router's
        own estimates never see a long prompt's progress, so they would keep a worker that is nearly
        through one looking busy for the whole prompt."""
        now = time.monotonic() if now is None else now
        ids = self.load.get("prefill_request_ids")
        acknowledged = None if ids is None else frozenset(ids)
        return queued_since(float(self.load.get("queued_prefill_seconds", 0.0)), self.report_at, self.inflight_prefill,
                            now, acknowledged)

    def view(self, cost_model: CostModel | None = None, tile_seconds: float | None = None) -> WorkerView:
        """What a policy sees of this worker; `cost_model` and `tile_seconds`: what to estimate its prefills
        with (default: the worker's own, from its last report)."""
        load = self.load
        queued = self.queued_prefill_seconds()
        running = max(int(load.get("num_running", 0)), len(self.inflight_decode_tokens))
        kv_tokens = max(int(load.get("kv_tokens", 0)), sum(self.inflight_decode_tokens.values()))
        waiting = max(int(load.get("num_waiting", 0)), len(self.inflight_prefill))
        return WorkerView(self.url, queued, waiting, running, kv_tokens, int(load.get("max_num_seqs", 1)),
                          int(load.get("kv_capacity_tokens", 1)), cost_model or self.cost_model(),
                          self.prefill_seconds_routed,
                          str(load.get("host", "")), tuple(load.get("cpus", ())),
                          self.tile_seconds() if tile_seconds is None else tile_seconds)

    def tile_seconds(self) -> float:
        """Its vision tower's seconds per image tile, as last reported (0: none measured)."""
        return float(self.load.get("tile_seconds") or 0.0)

    def hardware(self) -> str:
        """What makes workers peers: the same hardware, dtype and CPU count (its URL if it reports none)."""
        return str(self.load.get("hardware") or self.url)


def peer_cost_models(workers: Sequence[Worker]) -> dict[str, CostModel | None]:
    """The cost model to estimate each worker's prefills with: the mean of the fitted coefficients of its
    peers among `workers` (those reporting the same `hardware`; a worker that reports none is its own
    only peer).

    Why not each worker's own fit: a worker's model is fitted only to the steps it ran, so it knows the
    prompt sizes it was sent. On identical workers, the one that took the first huge prompts learned them
    well and the other kept a higher start-up guess; the router then saw the first as faster for every
    huge prompt by more than the finish tie, and it took 11 of 12 (prefill imbalance 1.39, benchmarks/BENCHMARKS.md,
    session 8). Peers get one estimate, so their queues decide; different hardware keeps its own."""
    groups: dict[str, list[Worker]] = defaultdict(list)
    for w in workers:
        if w.cost_model() is not None:
            groups[w.hardware()].append(w)
    out: dict[str, CostModel | None] = {w.url: None for w in workers}
    for peers in groups.values():
        if len(peers) == 1:
            out[peers[0].url] = peers[0].cost_model()
            continue
        mean = CostModel(tuple(float(c) for c in np.mean([p.cost_model().coef for p in peers], axis=0)))
        out.update({p.url: mean for p in peers})
    return out


def peer_tile_seconds(workers: Sequence[Worker]) -> dict[str, float]:
    """The seconds per image tile to price each worker's tiles with: the mean of its peers' measurements, for the
    reason peers share a cost model (`peer_cost_models`); 0 where no peer has measured one."""
    groups: dict[str, list[float]] = defaultdict(list)
    for w in workers:
        if w.tile_seconds() > 0:
            groups[w.hardware()].append(w.tile_seconds())
    return {w.url: float(np.mean(groups[w.hardware()])) if groups.get(w.hardware()) else 0.0 for w in workers}


class WorkerPool:
    def __init__(self, interval: float = 0.5, worker_timeout: float = 5.0, token: str | None = None) -> None:
        """`token`: the cluster token the polls carry (`cluster/auth.py`)."""
        self.workers: dict[str, Worker] = {}
        self.interval = interval
        self.worker_timeout = worker_timeout
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(min(worker_timeout, 10.0)), headers=token_headers(token))
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Event()

    def add(self, url: str, role: str) -> Worker:
        url = url.rstrip("/")
        if role not in WORKER_ROLES:
            raise ValueError(f"a worker's role must be prefill, decode or encode, got {role!r}")
        w = self.workers.get(url)
        if w is None or w.role != role:
            w = self.workers[url] = Worker(url, role)
            logger.info("worker %s (%s) added", url, role)
        return w

    def heartbeat(self, url: str, role: str) -> None:
        """A worker announced itself: add it if new; it is polled (and enters rotation) right away."""
        w = self.add(url, role)
        if not w.alive:
            self._changed.set()

    @staticmethod
    def views(workers: Sequence[Worker]) -> list[WorkerView]:
        """The policy's views of `workers` (one pool), each with its peers' pooled cost model and tile seconds."""
        models, tiles = peer_cost_models(workers), peer_tile_seconds(workers)
        return [w.view(models[w.url], tiles[w.url]) for w in workers]

    def rotation(self, role: str) -> list[Worker]:
        now = time.monotonic()
        return [w for w in self.workers.values()
                if w.role == role and w.alive and now - w.last_seen <= self.worker_timeout]

    def mark_failed(self, worker: Worker, why: str) -> None:
        if worker.alive:
            logger.warning("worker %s leaves rotation: %s", worker.url, why)
        worker.alive = False
        worker.failures += 1

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in list(self.workers.values())))

    async def _poll(self, w: Worker) -> None:
        sent_at = time.monotonic()
        try:
            r = await self._client.get(f"{w.url}/internal/load")
            r.raise_for_status()
            load = r.json()
        except (httpx.HTTPError, ValueError) as e:
            self.mark_failed(w, f"load poll failed: {e!r}")
            return
        if not load.get("healthy", False):
            self.mark_failed(w, "reports an unhealthy engine")
            return
        if load.get("role") not in (w.role, "unified"):
            self.mark_failed(w, f"is a {load.get('role')} worker, listed as {w.role}")
            return
        if not w.alive:
            logger.info("worker %s (%s) in rotation", w.url, w.role)
        w.load, w.alive, w.last_seen, w.report_at = load, True, time.monotonic(), sent_at

    async def run(self) -> None:
        while True:
            await self.poll_once()
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.interval)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run())

    async def wait_ready(self, timeout: float) -> bool:
        """Until at least one prefill and one decode worker are in rotation (True) or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.rotation("prefill") and self.rotation("decode"):
                return True
            await asyncio.sleep(0.2)
        return False

    def any_load(self) -> dict[str, Any]:
        """The load report of some live prefill or decode worker (model facts: max_model_len, block size, layout;
        an encode worker has no text model to report them of)."""
        for w in self.workers.values():
            if w.alive and w.load and w.role != "encode":
                return w.load
        return {}

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._client.aclose()
