"""ProcessEngine: the engine loop in a process of its own, behind the EngineClient contract.

    server process                                        engine process (spawned)
    generate() ─▶ OutputProcessor.add_request
               ─▶ sender thread ─▶ command pipe ──────▶  LLMEngine.add_request / abort_request /
                                                          finish_sequence (a stop string matched)
                                                          loop: LLMEngine.step_tokens()
    streams ◀─ OutputProcessor.process ◀─ reader thread ◀── output pipe: per step, TokenDeltas
                                                          (new token ids, raw logprobs, finish) + stats

Why a process: the HTTP layer (parsing, SSE framing) and the engine's per-step Python work
(scheduling, batch building) would otherwise share one GIL; measured, the in-process server
delivered about half the offline engine's throughput.

The output processor (detokenization, stop strings, n > 1 fan-in, `RequestOutput`s) runs here, in the
server process: the pipe carries token ids only, proportional to what changed, and the engine process
does token work only (measured against running it in the engine process; see benchmarks/BENCHMARKS.md).
A stop string ends a sequence with one `finish` command; the tokens the engine generated for it before
the command arrived are dropped by the processor. Grammars compile once, in the engine process
(`compile_grammar`). The engine process exits when the server asks it to (after flushing KV store
writes) or when the server process disappears (its command pipe closes).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import queue
import signal
import threading
import traceback
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from deepinfer.config import EngineConfig
from deepinfer.engine.engine_client import EngineClient, EngineDeadError, run_engine_call, settle_from_thread
from deepinfer.engine.expert_parallel import RankInfo
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine.structured import StructuredOutputParams
from deepinfer.engine.validation import RequestValidator
from deepinfer.kvcache.engine_tiers import resolve_retention

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0


@dataclass
class EngineInfo:
    """What the server needs to know about the engine it talks to (sent once, at start-up)."""

    tokenizer: Any
    max_model_len: int
    vocab_size: int
    retention: Any  # RetentionPolicy
    eos_token_ids: Any
    facts: dict  # LLMEngine.describe()
    stats: dict  # the first stats snapshot


# ---------------------------------------------------------------- server side


class ProcessEngine(EngineClient):
    def __init__(self, config: EngineConfig, log_level: int | None = None, rank: RankInfo | None = None) -> None:
        """`rank`: one expert-parallel rank of several (`ExpertParallelEngine` starts them)."""
        super().__init__(config.scheduler.max_queue)
        ctx = multiprocessing.get_context("spawn")  # fork would copy the server's threads and locks
        cmd_recv, self._cmd_send = ctx.Pipe(duplex=False)
        self._out_recv, out_send = ctx.Pipe(duplex=False)
        level = log_level if log_level is not None else logging.getLogger().getEffectiveLevel()
        self._proc = ctx.Process(target=_engine_main, args=(config, cmd_recv, out_send, level, rank),
                                 name="deepinfer-engine" if rank is None else f"deepinfer-engine-rank{rank.rank}",
                                 daemon=True)
        self._proc.start()
        cmd_recv.close()
        out_send.close()
        self.info = self._await_ready()
        self.tokenizer = self.info.tokenizer
        self.max_model_len = self.info.max_model_len
        self.vocab_size = self.info.vocab_size
        self.eos_token_ids = self.info.eos_token_ids
        self.facts = self.info.facts
        self._stats: dict[str, float] = self.info.stats
        self._adds_sent = 0
        self.validator = RequestValidator(self.vocab_size, self.max_model_len, self.tokenizer is not None,
                                          self.check_retention)
        # touched by the event loop (add, abort) and the reader thread (process): under `_lock`
        self.processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self._finish)
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._closing = False
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._sender = threading.Thread(target=self._send_loop, name="deepinfer-engine-send", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="deepinfer-engine-read", daemon=True)
        self._sender.start()
        self._reader.start()

    def _await_ready(self) -> EngineInfo:
        if not self._out_recv.poll(STARTUP_TIMEOUT_S):
            self._proc.kill()
            raise RuntimeError(f"the engine process did not start within {STARTUP_TIMEOUT_S:.0f} s")
        try:
            kind, payload = self._out_recv.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the engine process exited during start-up (code {self._proc.exitcode})") from None
        if kind != "ready":
            self._proc.join(5)
            raise RuntimeError(f"the engine failed to start:\n{payload}")
        return payload

    @property
    def healthy(self) -> bool:
        return self.dead is None and self._proc.is_alive()

    def stats(self) -> dict[str, float]:
        return self._stats

    def check_retention(self, retention_class: str | None) -> str:
        return resolve_retention(self.info.retention, retention_class)

    def _submit(self, request: dict[str, Any]) -> None:
        prompt, ids = request["prompt"], request["prompt_token_ids"]
        try:
            with self._lock:
                self.processor.add_request(request["request_id"], prompt if isinstance(prompt, str) else None, ids,
                                           request["params"], request["output_prefix"], request["prefix_logprobs"])
        except ValueError as e:  # a duplicate request id
            self._add_pending(-1)
            self._deliver([(request["request_id"], e)])
            return
        self._adds_sent += 1
        # the engine needs neither the text (it has the ids) nor the prefix logprobs (text-side state)
        self._outbox.put(("add", {**request, "prompt": None, "prefix_logprobs": None}))

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.processor.abort(request_id)
        self._outbox.put(("abort", request_id))

    def _finish(self, seq_id: str, stop: str) -> None:
        """The processor matched a stop string: the engine ends the sequence (frees its blocks)."""
        self._outbox.put(("finish", (seq_id, stop)))

    async def compile_grammar(self, params: StructuredOutputParams) -> None:
        """Compile on the engine's own grammar cache, in the engine process (so a grammar compiles once,
        where the request will use it); ValueError if it is invalid."""
        await self._request("compile", params)

    async def call(self, method: str, *args: Any) -> Any:
        self._check_call(method)
        return await self._request("call", method, args)

    async def _request(self, kind: str, *payload: Any) -> Any:
        if not self.healthy:
            raise EngineDeadError("the engine loop is not running")
        call_id = next(self._call_ids)
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._calls[call_id] = (loop, future)
        self._outbox.put((kind, (call_id, *payload)))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    def shutdown(self) -> None:
        self._closing = True
        self._outbox.put(("shutdown", None))
        self._proc.join(timeout=60)  # the engine flushes queued KV store writes first
        if self._proc.is_alive():
            logger.warning("engine process still running at shutdown; terminating it")
            self._proc.terminate()
            self._proc.join(timeout=5)

    def _send_loop(self) -> None:
        # a thread, so that pickling a long prompt or a full pipe never blocks the event loop
        while True:
            cmd = self._outbox.get()
            try:
                self._cmd_send.send(cmd)
            except (OSError, ValueError):
                return  # the engine is gone; the reader reports it
            if cmd[0] == "shutdown":
                return

    def _read_loop(self) -> None:
        try:
            while True:
                deltas, rejected, stats, adds_seen, results = self._out_recv.recv()
                self._stats = stats
                for call_id, ok, value in results:
                    target = self._calls.get(call_id)
                    if target is not None:
                        settle_from_thread(*target, ok, value)
                with self._pending_lock:
                    self._num_pending_adds = self._adds_sent - adds_seen
                with self._lock:
                    for rid, _ in rejected:
                        self.processor.abort(rid)
                    outputs = self.processor.process(deltas) if deltas else []
                self._deliver([*rejected, *((out.request_id, out) for out in outputs if self._wanted(out.request_id))])
        except (EOFError, OSError) as e:
            if not self._closing:
                logger.error("the engine process died (exit code %s)", self._proc.exitcode)
                self._fail_all(e)
            else:
                self.dead = e
            for loop, future in list(self._calls.values()):
                settle_from_thread(loop, future, False, EngineDeadError("the engine is gone"))

# ---------------------------------------------------------------- engine process


def _engine_main(config: EngineConfig, commands: Connection, outputs: Connection, log_level: int,
                 rank: RankInfo | None = None) -> None:
    # Ctrl-C reaches the whole process group; the server decides when the engine stops
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from deepinfer.engine.engine import LLMEngine

    try:
        engine = LLMEngine(config, process_outputs=False, rank=rank)  # the output processor runs in the server process
    except BaseException:  # noqa: BLE001 - reported to the server, which fails its start-up
        outputs.send(("failed", traceback.format_exc()))
        return
    # What start-up built (modules, tensors, tokenizer tables: ~330K objects for the default model) lives as
    # long as this process: out of the collector's reach, a full collection no longer walks it (125-148 ms on
    # a 2-core Zen 5, a stall inside some request's step whenever enough new objects had outlived younger
    # collections). Only here, in a process that holds one engine for its life.
    engine.freeze_startup_objects()
    outputs.send(("ready", EngineInfo(engine.tokenizer, engine.max_model_len, engine.vocab_size,
                                      engine.core.retention, engine.eos_token_ids, engine.describe(),
                                      engine.stats())))
    try:
        _serve_loop(engine, commands, outputs)
    except (EOFError, OSError, BrokenPipeError):
        pass  # the server process went away
    finally:
        engine.close()  # flush queued KV store writes: what was computed outlives the process


def _serve_loop(engine, commands: Connection, outputs: Connection) -> None:
    # an expert-parallel rank ends every loop turn with the others (`ExpertParallel.finish_tick`), so an idle
    # one polls its commands briefly: a peer with work waits for it at most that long
    ep = engine.expert_parallel if engine.expert_parallel is not None and engine.expert_parallel.world > 1 else None
    idle_poll = 0.02 if ep is not None else 0.5
    stopping = False  # expert-parallel: shut down once every rank was asked to (see finish_tick)
    adds_seen = 0
    compiled: queue.SimpleQueue = queue.SimpleQueue()  # (call id, ok, error) of grammars compiled meanwhile
    compiling = 0
    while True:
        rejected: list[tuple[str, BaseException]] = []
        results: list[tuple[int, bool, Any]] = []
        changed = False
        busy = engine.has_unfinished()
        if not stopping and commands.poll(0 if busy else 0.005 if compiling else idle_poll):
            while True:
                kind, payload = commands.recv()
                changed = True
                if kind == "shutdown":
                    if ep is None:
                        return
                    stopping = True
                    break
                if kind == "add":
                    adds_seen += 1
                    try:
                        engine.add_request(**payload)
                    except ValueError as e:
                        rejected.append((payload["request_id"], e))
                elif kind == "abort":
                    engine.abort_request(payload)
                elif kind == "finish":
                    engine.finish_sequence(*payload)
                elif kind == "call":
                    call_id, method, args = payload
                    results.append((call_id, *run_engine_call(engine, method, args)))
                elif kind == "compile":
                    call_id, params = payload
                    compiling += 1
                    engine.compile_grammar(params).add_done_callback(
                        lambda f, call_id=call_id: compiled.put((call_id, *_compile_result(f))))
                if not commands.poll(0):
                    break
        while not compiled.empty():
            results.append(compiled.get())
            compiling -= 1
            changed = True
        deltas = []
        if engine.has_unfinished():
            deltas = engine.step_tokens()
            changed = True
        elif not busy:
            engine.core.idle_tick()
        if ep is not None:
            if ep.finish_tick(stopping):
                return
            changed = changed or ep.last_tick_ran  # its experts worked for the others: fresh stats for /metrics
        if changed and not stopping:
            outputs.send((deltas, rejected, engine.stats(), adds_seen, results))


def _compile_result(future: Future) -> tuple[bool, Any]:
    """(True, None) for a grammar that compiled, (False, its error) else: the compiled grammar stays here."""
    error = future.exception()
    return (True, None) if error is None else (False, error)
