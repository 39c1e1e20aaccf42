"""AsyncEngine: the engine loop on its own thread, requests streamed to asyncio callers.

    event loop (HTTP handlers)                     engine thread
    generate() ── ("add", ...) ──▶ command queue ──▶ LLMEngine.add_request
                                                     loop: LLMEngine.step()  (torch releases the GIL)
    async for out ◀── call_soon_threadsafe ◀──────── RequestOutput per request per step
    (client gone) ── ("abort", id) ──▶ command queue ──▶ LLMEngine.abort_request (blocks freed)

All engine state is touched only by the engine thread. If the loop dies, every
open stream receives `EngineDeadError` and `healthy` turns False.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

from deepinfer.config import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class QueueFullError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        self.engine = engine or LLMEngine(config)
        self.max_queue = config.scheduler.max_queue
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._num_pending_adds = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self.dead: BaseException | None = None
        self._stats: dict[str, float] = self.engine.stats()
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public (event loop side)

    @property
    def healthy(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> dict[str, float]:
        """The latest snapshot taken by the engine thread (safe to read from any thread)."""
        return dict(self._stats)

    def check_admission(self, num_requests: int = 1) -> None:
        """Raise unless the engine is alive and the waiting queue has room for `num_requests`."""
        if not self.healthy:
            raise EngineDeadError("the engine loop is not running")
        if self.max_queue is not None and self.num_waiting() + num_requests > self.max_queue:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue} requests)")

    def num_waiting(self) -> int:
        return int(self._stats["num_waiting"]) + self._num_pending_adds

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       prompt: str | None = None, cache_salt: str | None = None,
                       retention_class: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's state after every step that changed it; the last one has `finished`.
        Raises ValueError for an invalid prompt or retention class, QueueFullError when the waiting queue
        is full."""
        self.engine.validate_prompt(prompt_token_ids)
        self.engine.validate_params(params)
        self.engine.core.check_retention(retention_class)
        self.check_admission()
        request_id = request_id or f"areq-{next(self._ids)}"
        out_queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), out_queue)
        with self._lock:
            self._num_pending_adds += 1
        self._commands.put(("add", (request_id, prompt, prompt_token_ids, params, cache_salt, retention_class)))
        finished = False
        try:
            while True:
                item = await out_queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("noop", None))
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            logger.warning("engine loop still running at shutdown; not waiting for KV store writes")
            return
        self.engine.close()  # waits for queued KV store writes: what was computed outlives the process

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        error = next((c.error for c in out.outputs if c.error), None)
                        # an engine-side rejection (e.g. a grammar that failed to compile) ends the stream
                        self._deliver(out.request_id, ValueError(error) if error and out.finished else out)
                self._stats = self.engine.stats()
        except BaseException as e:  # noqa: BLE001 - any failure kills the loop; streams must learn of it
            logger.exception("engine loop died")
            self.dead = e
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"the engine loop died: {e!r}"))

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, kind: str, payload: Any) -> None:
        if kind == "add":
            request_id, prompt, prompt_ids, params, cache_salt, retention_class = payload
            with self._lock:
                self._num_pending_adds -= 1
            if request_id not in self._streams:
                return  # the caller went away before the engine saw the request
            try:
                self.engine.add_request(prompt if prompt is not None else prompt_ids, params, request_id,
                                        cache_salt=cache_salt, prompt_token_ids=prompt_ids,
                                        retention_class=retention_class)
            except ValueError as e:
                self._deliver(request_id, e)
        elif kind == "abort":
            self.engine.abort_request(payload)

    def _deliver(self, request_id: str, item: Any) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, out_queue = target
        with contextlib.suppress(RuntimeError):  # the event loop is closed
            loop.call_soon_threadsafe(out_queue.put_nowait, item)
