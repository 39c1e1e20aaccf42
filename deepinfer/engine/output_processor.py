"""OutputProcessor: the one place a request's tokens become its API-facing output.

    engine token side (LLMEngine.step_tokens)          OutputProcessor.process
    TokenDelta per sequence per step ─────────────────▶ detokenize the new tokens (IncrementalDetokenizer)
      (new token ids, raw logprobs, finish,              match stop strings ─▶ finish(seq_id, stop string)
       cached tokens, prompt logprobs once)              fan the n sequences of a request in
                                                        ─▶ one RequestOutput per request that changed

Contract:
- `add_request` registers a request (its prompt, sampling parameters and, for a request continuing
  another worker's tokens, its `output_prefix`) before any of its deltas arrive; deltas of unknown or
  aborted requests are ignored, as are those of a sequence after it finished (a step may have been in
  flight when a stop string ended it).
- A stop string ends a sequence here: the processor calls `finish(seq_id, stop_string)` once, and the
  engine frees the sequence (at once when the processor runs beside the core; with the next command when
  it runs across a process pipe). The text is cut at the stop string (kept with
  `include_stop_str_in_output`); a token that also hit a length limit reports the stop string.
- `process` returns, per request that changed, a `RequestOutput` with the whole text / token ids /
  logprobs so far and what is new since the request's previous output (`delta_text`,
  `delta_token_ids`). With `stream=False` (the offline `LLM`) only the final output is built.
- A request is forgotten once its final output (`finished`) is returned, or on `abort`.

Not thread-safe: callers serialize `add_request`, `abort` and `process` (one thread, or a lock).

Where it runs: beside the core in `LLMEngine` (offline `LLM`, `AsyncEngine`); in the server process for
`ProcessEngine`, so the engine process only runs token work and the pipe carries token ids, not text
(measured; see benchmarks/BENCHMARKS.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from deepinfer.engine.outputs import CompletionOutput, Logprob, RequestOutput, TokenDelta
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.recipe.detokenizer import IncrementalDetokenizer

TIERS = ("device", "host", "store")


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's sequences in the engine: the request's own for n == 1, `id#i` for n > 1."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


class _Sequence:
    __slots__ = ("index", "detok", "token_ids", "logprobs", "cumulative_logprob", "finish_reason", "stop_reason",
                 "error", "sent_text", "sent_tokens")

    def __init__(self, index: int, detok: IncrementalDetokenizer, logprobs: bool) -> None:
        self.index = index
        self.detok = detok
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if logprobs else None
        self.cumulative_logprob: float | None = 0.0 if logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.sent_text = 0  # characters of text, and token ids, in the request's previous output
        self.sent_tokens = 0


class _Request:
    __slots__ = ("request_id", "prompt", "prompt_ids", "params", "seqs", "stream", "arrival", "first_token",
                 "first_scheduled", "num_cached", "prompt_logprobs", "kv_blocks", "spec")

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 seqs: list[_Sequence], stream: bool) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.seqs = seqs
        self.stream = stream
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.first_scheduled: float | None = None
        self.num_cached: tuple[int, int, int, int, int] | None = None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.kv_blocks: list | None = None
        self.spec: dict[str, tuple[int, int, int]] = {}  # speculative decoding totals per sequence

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class OutputProcessor:
    """Detokenization, stop strings, n > 1 fan-in and `RequestOutput`s for the requests of one engine.
    `finish(seq_id, stop_string)` ends a sequence in the engine (see the module docstring)."""

    def __init__(self, tokenizer: Any, eos_token_ids: Iterable[int], finish: Callable[[str, str], None]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids or ())
        self.finish = finish
        self._requests: dict[str, _Request] = {}
        self._seqs: dict[str, tuple[_Request, _Sequence]] = {}
        self._decoded: dict[int, str | None] = {}  # token id -> its text alone (logprobs' decoded_token)

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add_request(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                    output_prefix: list[int] | None = None, prefix_logprobs: list[dict[int, Logprob]] | None = None,
                    stream: bool = True) -> None:
        """Register a request before its first delta. `output_prefix` (n == 1): tokens already generated
        elsewhere, with their logprob entries if the request wants logprobs; its text starts with theirs.
        `stream`: build an output after every step that changed it (False: only the final one)."""
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        seqs = []
        for i in range(params.n):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens,
                                           params.include_stop_str_in_output)
            seq = _Sequence(i, detok, params.logprobs is not None)
            if output_prefix:
                seq.token_ids.extend(output_prefix)
                for t in output_prefix:
                    detok.add_token(t)
                if seq.logprobs is not None and prefix_logprobs is not None:
                    for token, entry in zip(output_prefix, prefix_logprobs, strict=True):
                        seq.logprobs.append(entry)
                        if token in entry:
                            seq.cumulative_logprob += entry[token].logprob
            seqs.append(seq)
        req = _Request(request_id, prompt, list(prompt_ids), params, seqs, stream)
        self._requests[request_id] = req
        for seq_id, seq in zip(sequence_ids(request_id, params.n), seqs, strict=True):
            self._seqs[seq_id] = (req, seq)

    def abort(self, request_id: str) -> None:
        """Forget a request (its deltas still in flight are ignored)."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            for seq_id in sequence_ids(request_id, len(req.seqs)):
                self._seqs.pop(seq_id, None)

    def process(self, deltas: Iterable[TokenDelta]) -> list[RequestOutput]:
        """Apply one step's deltas; the outputs of the requests they changed, in first-changed order."""
        changed: dict[str, _Request] = {}
        for d in deltas:
            entry = self._seqs.get(d.seq_id)
            if entry is None:
                continue
            req, seq = entry
            if seq.finish_reason is None:
                self._apply(req, seq, d)
            elif d.kv_blocks is None:
                continue
            if d.kv_blocks:
                req.kv_blocks = (req.kv_blocks or []) + d.kv_blocks
            changed[req.request_id] = req
        outputs = []
        for req in changed.values():
            finished = req.finished
            if finished:
                self.abort(req.request_id)
            if req.stream or finished:
                outputs.append(self._output(req, finished))
        return outputs

    def _apply(self, req: _Request, seq: _Sequence, d: TokenDelta) -> None:
        if d.num_cached is not None:
            req.num_cached = d.num_cached
        if d.first_scheduled is not None and req.first_scheduled is None:
            req.first_scheduled = d.first_scheduled
        if d.prompt_logprobs is not None and req.prompt_logprobs is None:
            req.prompt_logprobs = [None] + [self._entry(tid, lp) for tid, lp in
                                            zip(req.prompt_ids[1:], d.prompt_logprobs[1:], strict=True)]
        if d.spec is not None:
            req.spec[d.seq_id] = d.spec
        tokens = d.new_token_ids
        lps = d.new_logprobs
        if tokens:
            if req.first_token is None:
                req.first_token = time.monotonic()
            seq.token_ids.extend(tokens)
            params = req.params
            last = len(tokens) - 1
            for k, token in enumerate(tokens):
                # a token that ended the sequence as EOS or a stop token id is not text (unless asked)
                ended_by_token = k == last and d.finish_reason == "stop" and (
                    token in self.eos_token_ids or token == d.stop_reason)
                if ended_by_token and not params.include_stop_str_in_output:
                    continue
                stop = seq.detok.add_token(token)
                if stop is not None and seq.finish_reason is None:
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    if d.finish_reason is None:  # the engine still runs it: one finish, which frees it
                        self.finish(d.seq_id, stop)
                    if k < last:  # a step that emitted several tokens (speculative decoding): none after it
                        del seq.token_ids[len(seq.token_ids) - (last - k):]
                        tokens = tokens[:k + 1]
                        lps = lps[:k + 1] if lps is not None else None
                    break
            if seq.logprobs is not None and lps is not None:
                for token, lp in zip(tokens, lps, strict=True):
                    seq.logprobs.append(self._entry(token, lp))
                    seq.cumulative_logprob += lp.logprob
        if seq.finish_reason is None and d.finish_reason is not None:
            seq.finish_reason, seq.stop_reason, seq.error = d.finish_reason, d.stop_reason, d.error

    def _entry(self, token: int, lp) -> dict[int, Logprob]:
        """{token id: Logprob} for `token` and the alternatives in `lp` (a sampler.TokenLogprobs)."""
        entry = {tid: Logprob(val, rank + 1, self._decode_one(tid)) for rank, (tid, val) in enumerate(lp.top)}
        entry[token] = Logprob(lp.logprob, lp.rank, self._decode_one(token))
        return entry

    def _decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._decoded.get(token_id)
        if text is None:
            text = self._decoded[token_id] = self.tokenizer.decode([token_id])
        return text

    def _output(self, req: _Request, finished: bool) -> RequestOutput:
        outputs = []
        for seq in req.seqs:
            done = seq.finish_reason is not None
            text = seq.detok.text(done)
            tokens = seq.token_ids
            outputs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=list(tokens), cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, error=seq.error,
                delta_text=text[seq.sent_text:], delta_token_ids=tokens[seq.sent_tokens:]))
            seq.sent_text, seq.sent_tokens = len(text), len(tokens)
        cached = req.num_cached or (0, 0, 0, 0, 0)
        kv_blocks, req.kv_blocks = req.kv_blocks, None
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_ids, outputs=outputs,
            finished=finished, num_cached_tokens=max(cached[0], 0),
            num_cached_tokens_by_tier=dict(zip(TIERS, cached[1:4], strict=True)), num_replayed_tokens=cached[4],
            metrics={"arrival": req.arrival, "first_token": req.first_token, "now": time.monotonic(),
                     "first_scheduled": req.first_scheduled, **_spec_metrics(req.spec)},
            prompt_logprobs=req.prompt_logprobs, kv_blocks=kv_blocks)


def _spec_metrics(per_seq: dict[str, tuple[int, int, int]]) -> dict[str, float]:
    """A request's speculative decoding totals (its sequences summed), as `RequestOutput.metrics` entries."""
    if not per_seq:
        return {}
    steps, drafted, accepted = (sum(v[i] for v in per_seq.values()) for i in range(3))
    return {"spec_verifications": steps, "spec_draft_tokens": drafted, "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / drafted if drafted else 0.0,
            "spec_mean_accepted_length": (accepted + steps) / steps if steps else 0.0}
