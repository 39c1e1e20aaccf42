"""Structured output: what a request asks for (`StructuredOutputParams`), the grammar backend
interface (`GrammarBackend`, `GrammarMatcher`) and its xgrammar implementation.

xgrammar was chosen over llguidance by measurement (benchmarks/grammar_backends.py, numbers in
benchmarks/BENCHMARKS.md): llguidance compiles ~4x faster, but xgrammar fills a token mask ~4.5x
faster, and the mask fill is on every decode step while compiles are cached and off the hot path.
Compilation, caching and per-request state live in `grammar.py`; the sampler applies the masks.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.layers.cpu_kernels import apply_token_bitmask


@dataclass(frozen=True)
class StructuredOutputParams:
    """Constrain a request's output to a grammar. Exactly one field is set:

    `json_schema`: a JSON schema (dict, or its JSON text); `json_object`: any JSON object;
    `regex`: the whole output matches this regular expression; `grammar`: an EBNF grammar
    (xgrammar / GBNF dialect, start rule `root`); `choice`: the whole output is exactly one of these
    strings (vLLM's `guided_choice`; a list is kept as a tuple). Invalid values raise ValueError.
    """

    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        given = [name for name in _KINDS if getattr(self, name) is not None and getattr(self, name) is not False]
        if len(given) != 1:
            raise ValueError(f"structured output needs exactly one of {', '.join(_KINDS)}; "
                             f"got {', '.join(given) if given else 'none'}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, list | tuple) or not self.choice:
                raise ValueError("choice must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("every choice must be a non-empty string")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_schema is not None:
            schema = self.json_schema
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"json_schema is not valid JSON: {e}") from e
            if not isinstance(schema, dict):
                raise ValueError(f"json_schema must be a JSON object, got {type(schema).__name__}")
        if self.json_object is not True and self.json_object is not False:
            raise ValueError("json_object must be a boolean")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        """Which field is set: one of `_KINDS`."""
        if self.json_object:
            return "json_object"
        return next(name for name in _KINDS if name != "json_object" and getattr(self, name) is not None)

    @property
    def key(self) -> tuple[str, str]:
        """The compile-cache key: (kind, grammar text). Schema property order is kept: it is the
        order the output follows."""
        kind = self.kind
        if kind == "json_schema":
            schema = self.json_schema
            return kind, schema if isinstance(schema, str) else json.dumps(schema)
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, json.dumps(self.choice)
        return kind, self.regex if kind == "regex" else self.grammar  # type: ignore[return-value]


_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


def choice_grammar(choices: Sequence[str]) -> str:
    """The EBNF grammar whose only sentences are `choices` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarMatcher(ABC):
    """One request's position in its grammar. Used by one thread at a time (the engine advances it
    between steps; the sampler reads it to fill the mask)."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar does not allow it."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar has accepted a stop token: the output is complete."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding tries drafts on the matcher)."""


class GrammarBackend(ABC):
    """A grammar library behind one interface.

    Contract: `compile` is thread-safe, may take milliseconds to seconds (callers run it off the
    engine loop), and raises ValueError with a readable message for an invalid grammar; its result is
    immutable and shared by every request with the same `StructuredOutputParams.key`. `matcher` is
    cheap. `allocate_bitmask(n)` returns a bitmask for n logits rows; `fill_bitmask` writes the rows
    `rows` (one per matcher, in order) with the tokens each matcher allows next, a stop token only
    where the grammar may end; `apply_bitmask` sets the disallowed logits of those rows to -inf in
    place. Rows not listed are neither written nor masked.
    """

    vocab_size: int

    @abstractmethod
    def compile(self, params: StructuredOutputParams) -> Any:
        """Compile `params` into the backend's grammar object."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of `compiled`."""

    @abstractmethod
    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """A bitmask with room for `num_rows` rows."""

    @abstractmethod
    def fill_bitmask(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill row rows[i] from matchers[i], for all i, in one batched call."""

    @abstractmethod
    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Mask the logits rows `rows` (float32 [B, >= vocab]) in place."""


class _XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: Any) -> None:
        self.inner = matcher

    def accept(self, token_id: int) -> bool:
        return bool(self.inner.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self.inner.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)  # matchers are built with unlimited rollback (xgrammar's default)


class XGrammarBackend(GrammarBackend):
    """xgrammar over an HF tokenizer. JSON is generated compactly-spaced by default (fixed separators
    `", "` and `": "`, no free whitespace runs: a weak model could otherwise spend its whole budget on
    spaces and newlines); `any_whitespace` allows whitespace between any two tokens (xgrammar's and vLLM's
    default; `--json-whitespace any`). The two were measured on the default model in
    benchmarks/BENCHMARKS.md ("JSON whitespace (issue #17)")."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], max_threads: int = 2,
                 any_whitespace: bool = False) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.any_whitespace = any_whitespace
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        # the compile cache is ours (grammar.py, bounded by entries); xgrammar's would be a second one
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        # one thread: filling 32 rows took 0.15 ms on one core and 0.5 ms with two (thread handoff)
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._lock = threading.Lock()  # GrammarCompiler is not documented as safe for concurrent calls

    def compile(self, params: StructuredOutputParams) -> Any:
        kind, text = params.key
        try:
            with self._lock:
                if kind == "json_schema":
                    return self._compiler.compile_json_schema(text, any_whitespace=self.any_whitespace)
                if kind == "json_object":
                    return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=self.any_whitespace)
                if kind == "regex":
                    return self._compiler.compile_regex(text)
                if kind == "choice":
                    return self._compiler.compile_grammar(choice_grammar(params.choice or ()))
                return self._compiler.compile_grammar(text)
        except Exception as e:  # xgrammar raises RuntimeError / its own types for bad input
            raise ValueError(f"invalid {kind}: {_first_line(e)}") from e

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return _XGrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        inner = [m.inner for m in matchers]  # type: ignore[attr-defined]
        if len(inner) == 1:
            inner[0].fill_next_token_bitmask(bitmask, rows[0])
        else:
            self._batch.batch_fill_next_token_bitmask(inner, bitmask, rows)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        if apply_token_bitmask(logits, bitmask, rows, self.vocab_size):  # the C kernel (CPU float32)
            return
        self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size,
                                              indices=rows)


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0] if len(text) < 400 else text[:400]
