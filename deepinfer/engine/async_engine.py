"""AsyncEngine: the engine loop on a thread of the calling process, requests streamed to asyncio callers.

    event loop (HTTP handlers)                     engine thread
    generate() ── ("add", ...) ──▶ command queue ──▶ LLMEngine.add_request
                                                     loop: LLMEngine.step()  (torch releases the GIL)
    async for out ◀── call_soon_threadsafe ◀──────── RequestOutput per request per step
    (client gone) ── ("abort", id) ──▶ command queue ──▶ LLMEngine.abort_request (blocks freed)

All engine state is touched only by the engine thread. `ProcessEngine` (process_engine.py)
runs the same loop in a process of its own; see engine_client.py for the shared contract.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any

from deepinfer.config import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.engine_client import (
    EngineClient,
    EngineDeadError,
    QueueFullError,
    run_engine_call,
    settle_from_thread,
)
from deepinfer.engine.structured import StructuredOutputParams

__all__ = ["AsyncEngine", "EngineDeadError", "QueueFullError"]

logger = logging.getLogger(__name__)


class AsyncEngine(EngineClient):
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None) -> None:
        super().__init__(config.scheduler.max_queue)
        self.config = config
        self.engine = engine or LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.vocab_size
        self.eos_token_ids = self.engine.eos_token_ids
        self.facts = self.engine.describe()
        self.validator = self.engine.validator
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._stats: dict[str, float] = self.engine.stats()
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    def stats(self) -> dict[str, float]:
        """The latest snapshot taken by the engine thread."""
        return dict(self._stats)

    def check_retention(self, retention_class: str | None) -> str:
        return self.engine.core.check_retention(retention_class)

    async def compile_grammar(self, params: StructuredOutputParams) -> None:
        await asyncio.wrap_future(self.engine.compile_grammar(params))  # the engine's own cache

    def _submit(self, request: dict[str, Any]) -> None:
        self._commands.put(("add", request))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    async def call(self, method: str, *args: Any) -> Any:
        self._check_call(method)
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._commands.put(("call", (method, args, loop, future)))
        return await future

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
                    self._deliver([(out.request_id, out) for out in self.engine.step()])
                else:
                    self.engine.core.idle_tick()
                self._stats = self.engine.stats()
        except BaseException as e:  # noqa: BLE001 - any failure kills the loop; streams must learn of it
            logger.exception("engine loop died")
            self._fail_all(e)

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
            self._add_pending(-1)
            if not self._wanted(payload["request_id"]):
                return  # the caller went away before the engine saw the request
            try:
                self.engine.add_request(**payload)
            except ValueError as e:
                self._deliver([(payload["request_id"], e)])
        elif kind == "abort":
            self.engine.abort_request(payload)
        elif kind == "call":
            method, args, loop, future = payload
            settle_from_thread(loop, future, *run_engine_call(self.engine, method, args))
