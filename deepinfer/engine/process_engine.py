"""ProcessEngine: the engine loop in a process of its own, behind the EngineClient contract.

    server process                                        engine process (spawned)
    generate() ─▶ sender thread ─▶ command pipe ──────▶  LLMEngine.add_request / abort_request
                                                          loop: LLMEngine.step()
    streams ◀─ call_soon_threadsafe ◀─ reader thread ◀── output pipe: per step, output *deltas*
                                                          (new text, token ids, logprobs) + stats

Why a process: the HTTP layer (parsing, SSE framing) and the engine's per-step Python work
(scheduling, batch building, detokenization) would otherwise share one GIL; measured, the
in-process server delivered about half the offline engine's throughput.

Deltas keep the pipe traffic per step proportional to what changed, not to the length of
every running output. The engine process exits when the server asks it to (after flushing
KV store writes) or when the server process disappears (its command pipe closes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import threading
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from deepinfer.config import EngineConfig
from deepinfer.engine.engine_client import EngineClient, EngineDeadError, run_engine_call, settle_from_thread
from deepinfer.engine.outputs import CompletionOutput, Logprob, RequestOutput
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


@dataclass
class CompletionDelta:
    index: int
    text_keep: int  # characters of the previously sent text that stay
    text_new: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None
    error: str | None = None


@dataclass
class OutputDelta:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None  # only in a request's first delta
    outputs: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int
    num_cached_tokens_by_tier: dict[str, int]
    metrics: dict = field(default_factory=dict)
    kv_blocks: list | None = None  # RequestOutput.kv_blocks: never accumulated, passed through as is
    prompt_logprobs: list | None = None  # RequestOutput.prompt_logprobs: sent once, in the first delta that has them


# ---------------------------------------------------------------- server side


class ProcessEngine(EngineClient):
    def __init__(self, config: EngineConfig, log_level: int | None = None) -> None:
        super().__init__(config.scheduler.max_queue)
        ctx = multiprocessing.get_context("spawn")  # fork would copy the server's threads and locks
        cmd_recv, self._cmd_send = ctx.Pipe(duplex=False)
        self._out_recv, out_send = ctx.Pipe(duplex=False)
        level = log_level if log_level is not None else logging.getLogger().getEffectiveLevel()
        self._proc = ctx.Process(target=_engine_main, args=(config, cmd_recv, out_send, level),
                                 name="deepinfer-engine", daemon=True)
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
        self._assembled: dict[str, RequestOutput] = {}
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
        self._adds_sent += 1
        self._outbox.put(("add", request))

    def abort(self, request_id: str) -> None:
        self._assembled.pop(request_id, None)
        self._outbox.put(("abort", request_id))

    async def call(self, method: str, *args: Any) -> Any:
        self._check_call(method)
        call_id = next(self._call_ids)
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._calls[call_id] = (loop, future)
        self._outbox.put(("call", (call_id, method, args)))
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
                deltas, stats, adds_seen, results = self._out_recv.recv()
                self._stats = stats
                for call_id, ok, value in results:
                    target = self._calls.get(call_id)
                    if target is not None:
                        settle_from_thread(*target, ok, value)
                with self._pending_lock:
                    self._num_pending_adds = self._adds_sent - adds_seen
                self._deliver([(rid, item if isinstance(item, BaseException) else self._assemble(item))
                               for rid, item in deltas if self._wanted(rid)])
        except (EOFError, OSError) as e:
            if not self._closing:
                logger.error("the engine process died (exit code %s)", self._proc.exitcode)
                self._fail_all(e)
            else:
                self.dead = e
            for loop, future in list(self._calls.values()):
                settle_from_thread(loop, future, False, EngineDeadError("the engine is gone"))

    def _assemble(self, d: OutputDelta) -> RequestOutput:
        prev = self._assembled.get(d.request_id)
        outputs = {o.index: o for o in prev.outputs} if prev is not None else {}
        for c in d.outputs:
            old = outputs.get(c.index)
            if old is None:
                old = CompletionOutput(index=c.index, text="", token_ids=[], logprobs=[] if c.new_logprobs
                                       is not None else None)
            logprobs = old.logprobs
            if c.new_logprobs is not None:
                logprobs = (logprobs or []) + c.new_logprobs
            outputs[c.index] = CompletionOutput(
                index=c.index, text=old.text[:c.text_keep] + c.text_new, token_ids=old.token_ids + c.new_token_ids,
                cumulative_logprob=c.cumulative_logprob, logprobs=logprobs, finish_reason=c.finish_reason,
                stop_reason=c.stop_reason, error=c.error)
        out = RequestOutput(
            request_id=d.request_id, prompt=d.prompt if prev is None else prev.prompt,
            prompt_token_ids=d.prompt_token_ids if prev is None else prev.prompt_token_ids,
            outputs=[outputs[i] for i in sorted(outputs)], finished=d.finished,
            num_cached_tokens=d.num_cached_tokens, num_cached_tokens_by_tier=d.num_cached_tokens_by_tier,
            metrics=d.metrics,
            prompt_logprobs=d.prompt_logprobs if d.prompt_logprobs is not None or prev is None else prev.prompt_logprobs)
        if not d.finished:
            self._assembled[d.request_id] = out
        if d.kv_blocks:
            out = dataclasses.replace(out, kv_blocks=d.kv_blocks)  # not kept in `_assembled`
        if d.finished or not self._wanted(d.request_id):  # re-checked: abort() may have run meanwhile
            self._assembled.pop(d.request_id, None)
        return out


# ---------------------------------------------------------------- engine process


class _DeltaEncoder:
    """Remembers what was sent per request so each step sends only what changed."""

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, tuple[str, int, int]]] = {}  # rid -> index -> (text, ntok, nlp)
        self._sent_prompt_logprobs: set[str] = set()

    def encode(self, out: RequestOutput) -> OutputDelta:
        first = out.request_id not in self._sent
        sent = self._sent.setdefault(out.request_id, {})
        deltas = []
        for o in out.outputs:
            text, ntok, nlp = sent.get(o.index, ("", 0, 0))
            keep = len(text) if o.text.startswith(text) else len(os.path.commonprefix([text, o.text]))
            lps = o.logprobs[nlp:] if o.logprobs is not None else None
            deltas.append(CompletionDelta(o.index, keep, o.text[keep:], o.token_ids[ntok:], lps,
                                          o.cumulative_logprob, o.finish_reason, o.stop_reason, o.error))
            sent[o.index] = (o.text, len(o.token_ids), len(o.logprobs) if o.logprobs is not None else 0)
        prompt_lps = None
        if out.prompt_logprobs is not None and out.request_id not in self._sent_prompt_logprobs:
            prompt_lps = out.prompt_logprobs
            self._sent_prompt_logprobs.add(out.request_id)
        if out.finished:
            self._sent.pop(out.request_id, None)
            self._sent_prompt_logprobs.discard(out.request_id)
        return OutputDelta(out.request_id, out.prompt if first else None, out.prompt_token_ids if first else None,
                           deltas, out.finished, out.num_cached_tokens, out.num_cached_tokens_by_tier, out.metrics,
                           out.kv_blocks, prompt_lps)

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)
        self._sent_prompt_logprobs.discard(request_id)


def _engine_main(config: EngineConfig, commands: Connection, outputs: Connection, log_level: int) -> None:
    # Ctrl-C reaches the whole process group; the server decides when the engine stops
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from deepinfer.engine.engine import LLMEngine

    try:
        engine = LLMEngine(config)
    except BaseException:  # noqa: BLE001 - reported to the server, which fails its start-up
        outputs.send(("failed", traceback.format_exc()))
        return
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
    encoder = _DeltaEncoder()
    adds_seen = 0
    while True:
        items: list[Any] = []
        results: list[tuple[int, bool, Any]] = []
        changed = False
        if commands.poll(0 if engine.has_unfinished() else 0.5):
            while True:
                kind, payload = commands.recv()
                changed = True
                if kind == "shutdown":
                    return
                if kind == "add":
                    adds_seen += 1
                    try:
                        engine.add_request(**payload)
                    except ValueError as e:
                        items.append((payload["request_id"], e))
                elif kind == "abort":
                    engine.abort_request(payload)
                    encoder.forget(payload)
                elif kind == "call":
                    call_id, method, args = payload
                    results.append((call_id, *run_engine_call(engine, method, args)))
                if not commands.poll(0):
                    break
        if engine.has_unfinished():
            items.extend((out.request_id, encoder.encode(out)) for out in engine.step())
            changed = True
        if changed:
            outputs.send((items, engine.stats(), adds_seen, results))
