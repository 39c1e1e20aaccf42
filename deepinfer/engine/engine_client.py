"""EngineClient: what the HTTP layer (and the cluster router) may ask of an engine, whoever runs it.

Two implementations:
- `AsyncEngine` (async_engine.py): the engine loop on a thread of the server process;
- `ProcessEngine` (process_engine.py): the engine loop in its own process, so that the
  HTTP layer and the engine's Python work do not share one GIL (the default for `serve`).

The base class owns the per-request output streams: `generate()` registers an asyncio
queue per request, the implementation delivers `RequestOutput`s (or an exception) to it
from whatever thread it runs, in batches of one call per event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import threading
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.structured import StructuredOutputParams
from deepinfer.engine.validation import RequestValidator
from deepinfer.multimodal.inputs import MultiModalInputs
from deepinfer.multimodal.processor import MultiModalProcessor

# LLMEngine methods an EngineClient may run on the engine's side (`EngineClient.call`)
ENGINE_CALLS = frozenset({"flush_kv_store", "stats", "export_kv_blocks", "import_kv_blocks", "release_kv_blocks",
                          "load_lora_adapter", "unload_lora_adapter"})


class EngineDeadError(RuntimeError):
    pass


class QueueFullError(RuntimeError):
    pass


class EngineClient(ABC):
    """An engine serving requests for asyncio callers.

    Contract:
    - `generate()` validates synchronously, once, with `validator` (a `RequestValidator`: ValueError for a
      bad prompt, sampling parameter or retention class; the engine does not check again),
      QueueFullError over `max_queue`, EngineDeadError once the engine is gone), then yields the
      request's state after every step that changed it (`delta_text` / `delta_token_ids`: what is new
      since the previous one); the last one has `finished`. Leaving the iteration early aborts the
      request in the engine (its KV blocks are freed).
    - If the engine dies, every open stream raises EngineDeadError and `healthy` turns False.
    - `stats()` is a recent snapshot of scheduler / cache counters, safe to call from any thread.
    """

    tokenizer: Any
    max_model_len: int
    vocab_size: int
    eos_token_ids: Any
    facts: dict  # model and cache facts (LLMEngine.describe())
    validator: RequestValidator  # the checks every request passes once, here

    def __init__(self, max_queue: int | None) -> None:
        self.max_queue = max_queue
        self.dead: BaseException | None = None
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._pending_lock = threading.Lock()
        self._num_pending_adds = 0  # sent to the engine, not yet counted in its stats
        self._grammars: Any = None  # GrammarCache, made on first use

    # ------------------------------------------------------------------ implementation hooks

    @property
    @abstractmethod
    def healthy(self) -> bool: ...

    @abstractmethod
    def stats(self) -> dict[str, float]: ...

    @abstractmethod
    def check_retention(self, retention_class: str | None) -> str:
        """The retention class a request naming `retention_class` gets; ValueError if unknown."""

    @abstractmethod
    def _submit(self, request: dict[str, Any]) -> None:
        """Hand a request to the engine: `request` holds `LLMEngine.add_request`'s keyword arguments."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; unknown or finished ids are ignored."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the engine, letting it finish pending KV store writes."""

    @abstractmethod
    async def call(self, method: str, *args: Any) -> Any:
        """Run `LLMEngine.<method>(*args)` where the engine lives, between two steps, and return its
        result (or raise its exception). `method` must be one of `ENGINE_CALLS`; arguments and results
        must pickle (they may cross a process boundary)."""

    def _check_call(self, method: str) -> None:
        if method not in ENGINE_CALLS:
            raise ValueError(f"engine method {method!r} cannot be called remotely")
        if not self.healthy:
            raise EngineDeadError("the engine loop is not running")

    # ------------------------------------------------------------------ shared by both

    async def compile_grammar(self, params: StructuredOutputParams) -> None:
        """Compile `params`' grammar (or find it cached) without blocking the event loop; ValueError if it
        is invalid. This default compiles on a cache of the client's own, beside the engine's (the engine
        may live in another process); `AsyncEngine` shares the engine's."""
        if self._grammars is None:
            self._grammars = GrammarChecker(self.tokenizer, self.vocab_size, self.eos_token_ids)
        await self._grammars.check(params)

    def num_waiting(self) -> int:
        return int(self.stats().get("num_waiting", 0)) + self._num_pending_adds

    @functools.cached_property
    def multimodal_processor(self) -> MultiModalProcessor | None:
        """The model's processor for prompts with images, here in the caller's process; None: no images."""
        mm = (getattr(self, "facts", None) or {}).get("multimodal")  # a cluster router has no model facts
        if not mm:
            return None
        return MultiModalProcessor(Path(mm["directory"]), mm["image_token_id"], mm["tokens_per_tile"])

    loads_lora_adapters = True  # whether `call("load_lora_adapter" / "unload_lora_adapter")` serves new ones

    @property
    def lora_adapters(self) -> dict[str, str] | None:
        """The LoRA adapters requests may name -> their directories; None where the engine serves none. The
        server's load / unload routes keep this dict in step with the engine."""
        return self.facts.get("lora_adapters")

    @property
    def sampling_defaults(self) -> dict:
        """The model's sampling defaults for parameters a request leaves unset (`--generation-config`)."""
        return dict(self.facts.get("sampling_defaults", {}))

    @property
    def running_capacity(self) -> int:
        """Sequences the engine runs at once (max_num_seqs); the server's admission bound builds on it."""
        return int(self.facts.get("max_num_seqs", 1))

    def check_admission(self, num_requests: int = 1) -> None:
        """Raise unless the engine is alive and the waiting queue has room for `num_requests`."""
        if not self.healthy:
            raise EngineDeadError("the engine loop is not running")
        if self.max_queue is not None and self.num_waiting() + num_requests > self.max_queue:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue} requests)")

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       prompt: str | None = None, cache_salt: str | None = None,
                       retention_class: str | None = None, output_prefix: list[int] | None = None,
                       prefix_logprobs: list | None = None, stream_kv: bool = False,
                       cache_tenant: str | None = None, multi_modal: MultiModalInputs | None = None,
                       lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """`output_prefix` / `prefix_logprobs`: tokens another worker already generated for this request;
        `stream_kv`: outputs carry the prompt's KV blocks as they are computed; `cache_tenant`: the
        authenticated tenant's cache namespace (see `LLMEngine.add_request`); `multi_modal`: the prompt's
        images (`multimodal_processor` made them with the prompt's ids); `lora`: the name of the LoRA adapter it
        runs with (None: the base model)."""
        retention_class = self.validator.validate(prompt_token_ids, params, retention_class, output_prefix,
                                                  prefix_logprobs, stream_kv)
        self.check_admission()
        request_id = request_id or f"areq-{next(self._ids)}"
        out_queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), out_queue)
        self._add_pending(1)
        self._submit({"prompt": prompt if prompt is not None else list(prompt_token_ids), "params": params,
                      "validated": True, "request_id": request_id, "cache_salt": cache_salt, "prompt_token_ids": list(prompt_token_ids),
                      "retention_class": retention_class, "output_prefix": output_prefix,
                      "prefix_logprobs": prefix_logprobs, "stream_kv": stream_kv, "cache_tenant": cache_tenant,
                      "multi_modal": multi_modal, "lora_request": lora})
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

    def _add_pending(self, n: int) -> None:
        with self._pending_lock:
            self._num_pending_adds += n

    def _wanted(self, request_id: str) -> bool:
        """Whether someone still reads this request's stream (a request whose caller left before the
        engine saw it need not run at all)."""
        return request_id in self._streams

    def _deliver(self, items: list[tuple[str, Any]]) -> None:
        """Hand (request_id, RequestOutput or exception) pairs to their streams: one wake-up per event
        loop, not one per item. Callable from any thread."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = defaultdict(list)
        for request_id, item in items:
            if isinstance(item, RequestOutput) and item.finished:
                error = next((c.error for c in item.outputs if c.error), None)
                if error:  # an engine-side rejection (e.g. a grammar that failed to compile) ends the stream
                    item = ValueError(error)
            target = self._streams.get(request_id)
            if target is not None:
                by_loop[target[0]].append((target[1], item))
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the event loop is closed
                loop.call_soon_threadsafe(_put_all, batch)

    def _fail_all(self, error: BaseException) -> None:
        self.dead = error
        self._deliver([(rid, EngineDeadError(f"the engine loop died: {error!r}")) for rid in list(self._streams)])


class GrammarChecker:
    """Compiles grammars where no engine lives (the server beside an engine process, the router), only to
    reject invalid ones before a request is queued; cached by schema like the engine's own."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Any) -> None:
        from deepinfer.engine.grammar import GrammarCache
        from deepinfer.engine.structured import XGrammarBackend

        self._cache = GrammarCache(lambda: XGrammarBackend(tokenizer, vocab_size, eos_token_ids), num_threads=1)

    async def check(self, params: StructuredOutputParams) -> None:
        await asyncio.wrap_future(self._cache.compile(params))


def run_engine_call(engine: Any, method: str, args: tuple) -> tuple[bool, Any]:
    """(True, result) of `engine.<method>(*args)`, or (False, the exception it raised); runs where the
    engine lives (see `EngineClient.call`)."""
    try:
        return True, getattr(engine, method)(*args)
    except Exception as e:  # noqa: BLE001 - the caller gets it
        return False, e


def settle_from_thread(loop: asyncio.AbstractEventLoop, future: asyncio.Future, ok: bool, value: Any) -> None:
    """From any thread: complete `future` on its loop with a result (ok) or an exception, unless its
    caller gave up on it or the loop is closed."""
    with contextlib.suppress(RuntimeError):  # the event loop is closed
        loop.call_soon_threadsafe(_settle, future, ok, value)


def _settle(future: asyncio.Future, ok: bool, value: Any) -> None:
    if future.done():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def _put_all(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in batch:
        q.put_nowait(item)
