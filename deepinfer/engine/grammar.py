"""Grammar compilation off the engine loop, its bounded cache, and each request's grammar state.

    LLMEngine.add_request ─▶ GrammarCache.request_state ─▶ compile pool (or a cache hit)
    Scheduler: a waiting request whose grammar is not compiled yet is skipped, not waited for
               (Request.ready_to_schedule); one whose grammar failed is finished with the error
    Sampler:   rows whose matcher is live get the backend's bitmask, filled and applied in one batch
    Scheduler.update: the matcher accepts each appended token; termination finishes the request

A request's matcher follows `Request.token_ids` and nothing else: preemption keeps the tokens (and
so the matcher), and a token is accepted exactly when it is appended.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from deepinfer.engine.structured import GrammarBackend, GrammarMatcher, StructuredOutputParams


class RequestGrammar:
    """One request's grammar: pending while it compiles, then a matcher (or an error)."""

    def __init__(self, future: Future[tuple[GrammarBackend, Any]]) -> None:
        self.future = future
        self.backend: GrammarBackend | None = None
        self.matcher: GrammarMatcher | None = None
        self.error: str | None = None
        # tokens generated before this engine saw the request (a prefill worker's first token): the
        # matcher accepts them as soon as it exists, before any token this engine samples
        self.replay: list[int] = []

    def poll(self) -> bool:
        """True once compiled (a matcher exists) or failed (`error` is set); never blocks."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self.future.done():
            return False
        try:
            backend, compiled = self.future.result()
        except ValueError as e:
            self.error = str(e)
        except Exception as e:  # noqa: BLE001 - a library failure ends this request, not the engine
            self.error = f"grammar compilation failed: {e!r}"
        else:
            self.backend, self.matcher = backend, backend.matcher(compiled)
            if not all(self.matcher.accept(t) for t in self.replay):
                self.error = "the tokens generated before this engine took over do not fit the grammar"
        return True

    @property
    def live(self) -> bool:
        """The next token is constrained (compiled, not failed, not yet terminated)."""
        return self.matcher is not None and not self.matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        """Advance past an appended token; False if the grammar rejects it."""
        return self.matcher is not None and self.matcher.accept(token_id)

    @property
    def terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()


class GrammarCache:
    """Compiles `StructuredOutputParams` on a small thread pool and keeps the last `max_entries`
    results (failures too: a bad schema sent again fails without recompiling) keyed by
    `StructuredOutputParams.key`. The backend itself is built on first use, in the pool (building
    the tokenizer tables takes a moment). Thread-safe: the server compiles here ahead of queuing."""

    def __init__(self, backend_factory: Callable[[], GrammarBackend], max_entries: int = 256,
                 num_threads: int = 2) -> None:
        self._factory = backend_factory
        self._backend: GrammarBackend | None = None
        self._max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], Future[tuple[GrammarBackend, Any]]] = OrderedDict()
        self._lock = threading.Lock()
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="deepinfer-grammar")
        self.num_compiles = 0
        self.num_hits = 0

    def compile(self, params: StructuredOutputParams) -> Future[tuple[GrammarBackend, Any]]:
        """A future of (backend, compiled grammar); its exception is a ValueError for a bad grammar."""
        key = params.key
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
                self.num_hits += 1
                return future
            future = self._pool.submit(self._compile, params)
            self.num_compiles += 1
            self._entries[key] = future
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)
            return future

    def request_state(self, params: StructuredOutputParams) -> RequestGrammar:
        """Fresh per-request state (its own matcher) over the shared compiled grammar."""
        return RequestGrammar(self.compile(params))

    def backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._factory()
            return self._backend

    def _compile(self, params: StructuredOutputParams) -> tuple[GrammarBackend, Any]:
        backend = self.backend()
        return backend, backend.compile(params)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __len__(self) -> int:
        return len(self._entries)

