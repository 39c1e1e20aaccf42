"""LLMEngine (text level: tokenize, detokenize, stop strings, n > 1 grouping) around EngineCore,
used by the offline `LLM` and the server.

    LLMEngine.add_request ─▶ EngineCore.add_request ─▶ Scheduler.waiting
    LLMEngine.step ─▶ EngineCore (see core.py): schedule ─▶ run ─▶ update
                  ─▶ detokenize new tokens, match stop strings (finishing the request in the core)
                  ─▶ RequestOutput per request that changed

Structured output: `add_request` starts each sequence's grammar compiling on `grammar.GrammarCache`
(a small thread pool, cached by schema); the scheduler holds the request back until it is ready.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import platform
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from deepinfer.config import EngineConfig
from deepinfer.engine.core import CoreOutput, EngineCore, InFlightStep
from deepinfer.engine.engine_client import validate_model_params, validate_prompt_ids
from deepinfer.engine.grammar import GrammarCache
from deepinfer.engine.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import PrefillPolicy
from deepinfer.engine.structured import GrammarBackend, StructuredOutputParams, XGrammarBackend
from deepinfer.kvcache.blocks import layout_of
from deepinfer.kvcache.engine_tiers import tier_stats
from deepinfer.kvcache.exchange import export_blocks, export_computed, import_blocks, release_blocks
from deepinfer.kvcache.manager import TIERS
from deepinfer.recipe.detokenizer import IncrementalDetokenizer
from deepinfer.recipe.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)


def hardware_name(device: torch.device) -> str:
    """What the engine computes on, by name (a GPU's model, else the CPU's): workers that report the same
    name, dtype and CPU count are peers whose cost models a router may pool."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


class _Child:
    """Text-level state of one of a request's n sequences."""

    def __init__(self, req: Request, detok: IncrementalDetokenizer) -> None:
        self.req = req
        self.detok = detok
        self.logprobs: list[dict[int, Logprob]] | None = [] if req.params.logprobs is not None else None
        self.cumulative_logprob = 0.0 if self.logprobs is not None else None


class _Parent:
    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], children: list[_Child]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.children = children
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # made once, at the first token

    @property
    def finished(self) -> bool:
        return all(c.req.finished for c in self.children)


def _continue_after(child: _Child, tokens: list[int], logprobs: list[dict[int, Logprob]] | None) -> None:
    """Make `child` look as if it had already generated `tokens` (text, logprobs, token state)."""
    child.req.token_ids.extend(tokens)
    if child.req.grammar is not None:
        child.req.grammar.replay.extend(tokens)
    for t in tokens:
        child.detok.add_token(t)
    if child.logprobs is not None and logprobs is not None:
        for token, entry in zip(tokens, logprobs, strict=True):
            child.logprobs.append(entry)
            if token in entry:
                child.cumulative_logprob += entry[token].logprob


class LLMEngine:
    """Text-level engine: validation, tokenization, detokenization and stop strings around EngineCore."""

    def __init__(self, config: EngineConfig, policy: PrefillPolicy | None = None) -> None:
        self.core = EngineCore(config, policy)
        self.tokenizer = load_tokenizer(self.core.files) if self.core.files.has_tokenizer() else None
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.core.hf_config, self.core.files.directory)
        self.vocab_size = self.core.hf_config.vocab_size
        self._parents: dict[str, _Parent] = {}
        self._child_parent: dict[str, _Parent] = {}
        self._ids = itertools.count()
        mode = config.scheduler.overlap_host_work
        self.overlap = mode == "on" or (mode == "auto" and self.core.runner.device.type == "cuda")
        self._inflight: InFlightStep | None = None
        self.grammars = GrammarCache(self._grammar_backend)
        self._kv_streams: dict[str, list] = {}  # stream_kv requests: id -> [Request, blocks exported]
        self._kv_holds: dict[str, list[int]] = {}  # import_kv_blocks(hold_key=...) -> device blocks held

    def _grammar_backend(self) -> GrammarBackend:
        return XGrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids,
                               any_whitespace=self.core.config.model.json_whitespace == "any")

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token ids")
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return list(prompt)

    def describe(self) -> dict:
        """Model and cache facts for start-up banners and cluster registration (plain values only)."""
        core = self.core
        tiers = core.tiers
        return {"model_name": core.config.model.served_model_name or core.files.name,
                "dtype": str(core.runner.dtype), "device": str(core.runner.device),
                "hardware": hardware_name(core.runner.device),
                "num_blocks": core.runner.num_blocks, "block_size": core.config.cache.block_size,
                "host_tier_bytes": tiers.host.max_bytes if tiers is not None and tiers.host is not None else None,
                "store_root": str(tiers.store.root) if tiers is not None and tiers.store is not None else None,
                "architectures": list(getattr(core.hf_config, "architectures", None) or []),
                "model_identity": core.model_identity, "max_num_seqs": core.config.scheduler.max_num_seqs,
                "kv_layout": list(dataclasses.astuple(layout_of(core.runner.kv_caches)))}

    def validate_prompt(self, prompt_ids: list[int]) -> None:
        validate_prompt_ids(prompt_ids, self.vocab_size, self.max_model_len)

    def validate_params(self, params: SamplingParams) -> None:
        """Checks that need the model: logit_bias token ids in its vocabulary, a tokenizer for grammars."""
        validate_model_params(params, self.vocab_size, self.tokenizer is not None)

    def compile_grammar(self, params: StructuredOutputParams):
        """Start compiling (or find cached) `params`' grammar; a Future whose `result()` raises
        ValueError for an invalid grammar. Callers that want the error before queuing wait on it."""
        return self.grammars.compile(params)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    cache_salt: str | None = None, prompt_token_ids: list[int] | None = None,
                    retention_class: str | None = None, output_prefix: list[int] | None = None,
                    prefix_logprobs: list[dict[int, Logprob]] | None = None, stream_kv: bool = False,
                    cache_tenant: str | None = None) -> str:
        """Queue a request; `prompt_token_ids`, if given, is `prompt` already tokenized. `retention_class`
        (default: the configured default class) says how long the KV store keeps its blocks.
        `output_prefix`: tokens already generated elsewhere (a prefill worker's first token, with their
        `prefix_logprobs` if the request wants logprobs); the request continues after them as if it had
        sampled them itself (n == 1 only). `stream_kv` (n == 1 only): after every step that completed more
        of the prompt's full blocks, the request's output carries them (`RequestOutput.kv_blocks`), with
        or without a new token: a prefill worker ships them while the rest of the prompt computes.
        `cache_tenant`: the authenticated tenant's cache namespace (set by the server from the API key, never
        by a client); its blocks are named apart from every other tenant's, whatever `cache_salt` says."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._parents:
            raise ValueError(f"duplicate request id {request_id!r}")
        prompt_ids = list(prompt_token_ids) if prompt_token_ids is not None else self.tokenize(prompt)
        self.validate_prompt(prompt_ids)
        self.validate_params(params)
        retention_class = self.core.check_retention(retention_class)
        output_prefix = list(output_prefix or [])
        if (output_prefix or stream_kv) and params.n != 1:
            raise ValueError("output_prefix and stream_kv need n == 1")
        if output_prefix and params.logprobs is not None and len(prefix_logprobs or ()) != len(output_prefix):
            raise ValueError("a request with logprobs needs prefix_logprobs for every output_prefix token")
        if len(prompt_ids) + len(output_prefix) >= self.max_model_len:
            raise ValueError("the prompt and output prefix fill the context")
        children = []
        first: Request | None = None
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None and i > 0:
                child_params = dataclasses.replace(params, seed=params.seed + i)
            grammar = None
            if params.structured_output is not None:  # each sequence walks the grammar on its own
                grammar = self.grammars.request_state(params.structured_output)
            req = Request(f"{request_id}#{i}" if params.n > 1 else request_id, prompt_ids, child_params,
                          self.eos_token_ids, cache_salt, wait_for=first, retention_class=retention_class,
                          grammar=grammar, cache_tenant=cache_tenant)
            first = first or req
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens,
                                           params.include_stop_str_in_output)
            child = _Child(req, detok)
            if output_prefix:
                _continue_after(child, output_prefix, prefix_logprobs)
            children.append(child)
        parent = _Parent(request_id, prompt if isinstance(prompt, str) else None, prompt_ids, children)
        self._parents[request_id] = parent
        for child in children:
            self._child_parent[child.req.request_id] = parent
            self.core.add_request(child.req)
        if stream_kv:
            self._kv_streams[request_id] = [children[0].req, 0]
        return request_id

    def abort_request(self, request_id: str) -> None:
        parent = self._parents.pop(request_id, None)
        self._kv_streams.pop(request_id, None)
        if parent is None:
            return
        for child in parent.children:
            self.core.abort_request(child.req.request_id)
            self._child_parent.pop(child.req.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def export_kv_blocks(self, token_ids: list[int], cache_salt: str | None = None,
                         cache_tenant: str | None = None) -> list[tuple[bytes, Any]]:
        """(block hash, payload) of the full blocks of `token_ids` this engine still holds, in chain order
        from the first block (see `kv_exchange.export_blocks`)."""
        return export_blocks(self.core, token_ids, cache_salt, cache_tenant)

    def import_kv_blocks(self, blocks: list[tuple[bytes, Any]], hold_key: str | None = None) -> int:
        """Put named KV blocks where this engine's prefix cache finds them (see `kv_exchange.import_blocks`);
        a request added afterwards hits them. Returns how many are held. `hold_key`: keep a reference on
        them under that key until `release_kv_blocks(hold_key)` (blocks arriving in several batches)."""
        if self._inflight is not None:
            # with host work overlapped a step may still be running: a block it frees can still receive
            # its in-flight token, so let it finish before writing free blocks (as `EngineCore.launch` does)
            self._inflight.future.result()
        hold = self._kv_holds.setdefault(hold_key, []) if hold_key is not None else None
        return import_blocks(self.core, blocks, hold)

    def release_kv_blocks(self, hold_key: str) -> int:
        """Drop the references `import_kv_blocks(..., hold_key)` took (the blocks stay cached until
        evicted); returns how many. Unknown keys release nothing."""
        hold = self._kv_holds.pop(hold_key, [])
        n = len(hold)
        release_blocks(self.core, hold)
        return n

    def flush_kv_store(self, timeout: float | None = None) -> bool:
        """Wait until the KV blocks queued for the persistent store are written; False on timeout."""
        return self.core.flush_kv_store(timeout)

    def close(self) -> None:
        """Finish pending KV store writes and release the tiers (see `EngineCore.close`)."""
        self._inflight = None
        self.grammars.close()
        self.core.close()

    def stats(self) -> dict[str, float]:
        """A snapshot of scheduler and cache state for metrics."""
        sched, kv = self.core.scheduler, self.core.kv
        return {
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "kv_usage": kv.usage(),
            "kv_blocks_used": kv.pool.num_used,
            "kv_blocks_total": kv.pool.num_blocks,
            "prefix_queries": kv.prefix_queries,
            "prefix_hits": kv.prefix_hits,
            **{f"prefix_hits_{tier}": n for tier, n in kv.tier_hits.items()},
            **tier_stats(self.core.tiers),
            "num_preemptions": sched.num_preemptions,
            # load signals for a cluster router: queued prefill compute (cost model) and KV held
            "prefill_queued_seconds": self._queued_prefill_seconds(),
            "prefill_queued_at": time.monotonic(),  # system-wide clock: a worker process ages the snapshot
            "kv_tokens": sum(r.num_tokens for r in sched.running),
            "kv_blocks_held_for_imports": sum(len(h) for h in self._kv_holds.values()),
            "step_idle_gap_seconds_total": self.core.idle_gap_seconds,
            "step_idle_gap_last_seconds": self.core.idle_gap_last,
            "step_idle_gaps": self.core.num_idle_gaps,
            **self.core.cost_model.stats(sched.step_time_budget),
        }

    def _queued_prefill_seconds(self) -> float:
        """Predicted compute of the prompt tokens not yet computed (waiting and partly prefilled requests),
        each prefilled alone in one step: one vectorized sum, as it runs after every step. A step in
        flight (`overlap_host_work`) counts its tokens as computed from its launch; its prefill chunks are
        still to run, so a request in it counts from where that chunk starts (else a prompt prefilled
        in one long step would be reported as done for the whole step)."""
        from deepinfer.engine.cost_model import step_features

        sched, cost = self.core.scheduler, self.core.cost_model
        running_from = {} if self._inflight is None else {
            item.request.request_id: item.start for item in self._inflight.plan.scheduled if item.num_new_tokens > 1}
        chunks = []
        for r in (*sched.waiting, *sched.running):
            done = running_from.get(r.request_id, r.num_computed_tokens)
            total = r.num_tokens - r.num_pending_tokens  # a pending token is the next decode, not prompt
            if done < total - 1:
                chunks.append((total - done, done))
        if not chunks:
            return 0.0
        overhead = cost.coefficients["overhead"]
        return cost.predict_features(step_features(chunks)) + (len(chunks) - 1) * overhead

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the current state of every request that advanced.

        With `overlap_host_work`, the step that produced these outputs (N) was launched by the
        previous call; this call schedules and prepares step N+1 while N still runs (N's tokens
        pending), queues it behind N on the model thread, then applies N and detokenizes and
        matches stop strings while N+1 runs (a request a stop string ends then has one token in
        flight, which is discarded)."""
        core = self.core
        if not self.overlap:
            outputs = core.step()
        else:
            inflight = self._inflight or core.launch()
            if inflight is None:
                outputs = []
            else:
                self._inflight = core.launch(ahead=inflight)
                outputs = core.complete(inflight, next_step=self._inflight)
        # requests the scheduler ended without a token (a grammar that failed to compile)
        outputs += [CoreOutput(r, None, None) for r in core.scheduler.take_failed()]
        if not outputs and self._inflight is None:
            self._wait_idle()
        results = self._process(outputs)
        return self._attach_kv(results) if self._kv_streams else results

    def _attach_kv(self, results: list[RequestOutput]) -> list[RequestOutput]:
        """Give every `stream_kv` request whose finished steps completed more prompt blocks an output
        carrying them (its token output of this step, else a snapshot without a new token)."""
        by_id = {out.request_id: out for out in results}
        for rid, entry in list(self._kv_streams.items()):
            req, sent = entry
            blocks = export_computed(self.core, req, sent)
            if blocks:
                entry[1] = sent + len(blocks)
                out = by_id.get(rid)
                parent = self._parents.get(rid)
                if out is None and parent is not None:
                    out = by_id[rid] = self._snapshot(parent)
                    results.append(out)
                if out is not None:
                    # plain bytes: they may cross a process pipe, where tensors would go through shared memory
                    out.kv_blocks = [(h, p.numpy().tobytes() if hasattr(p, "numpy") else bytes(p)) for h, p in blocks]
            if req.finished:
                del self._kv_streams[rid]
        return results

    def _wait_idle(self) -> None:
        """Nothing ran: if requests wait only for their grammars or their KV store reads, sleep until one
        is ready (briefly: new requests may arrive meanwhile) instead of spinning, which would also keep
        the GIL from the prefetch thread."""
        if self.core.scheduler.running:
            return
        pending = [r.grammar.future for r in self.core.scheduler.waiting
                   if r.grammar is not None and not r.grammar.poll()]
        prefetcher = self.core.tiers.prefetcher if self.core.tiers is not None else None
        if prefetcher is not None:
            pending += prefetcher.in_flight()
        if pending:
            wait_futures(pending, timeout=0.05, return_when=FIRST_COMPLETED)

    def _process(self, core_outputs: list[CoreOutput]) -> list[RequestOutput]:
        changed: dict[str, _Parent] = {}
        for out in core_outputs:
            parent = self._child_parent.get(out.request.request_id)
            if parent is None:
                continue
            child = next(c for c in parent.children if c.req is out.request)
            self._process_token(child, out)
            if parent.first_token_time is None and out.new_token_id is not None:
                parent.first_token_time = time.monotonic()
            changed[parent.request_id] = parent
        results = []
        for parent in changed.values():
            results.append(self._snapshot(parent))
            if parent.finished:
                self._parents.pop(parent.request_id, None)
                for c in parent.children:
                    self._child_parent.pop(c.req.request_id, None)
        return results

    def _process_token(self, child: _Child, out: CoreOutput) -> None:
        token = out.new_token_id
        req = child.req
        if token is None:
            return
        ended_by_token = req.status is RequestStatus.FINISHED_STOPPED and (
            token in req.eos_token_ids or token == req.stop_reason)
        if not ended_by_token or req.params.include_stop_str_in_output:
            stop_str = child.detok.add_token(token)
            if stop_str is not None:
                if req.finished:  # the same token also hit a length limit: the stop string wins
                    req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
                else:
                    self.core.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, stop_str)
        if child.logprobs is not None and out.logprobs is not None:
            lp = out.logprobs
            child.logprobs.append(self._logprob_entry(token, lp))
            child.cumulative_logprob += lp.logprob

    def _logprob_entry(self, token: int, lp) -> dict[int, Logprob]:
        """{token id: Logprob} for `token` and the alternatives in `lp` (a TokenLogprobs)."""
        entry = {tid: Logprob(val, rank + 1, self._decode_one(tid)) for rank, (tid, val) in enumerate(lp.top)}
        entry[token] = Logprob(lp.logprob, lp.rank, self._decode_one(token))
        return entry

    def _decode_one(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    def _snapshot(self, parent: _Parent) -> RequestOutput:
        outputs = []
        for i, c in enumerate(parent.children):
            req = c.req
            finished = req.finished
            token_ids = req.output_token_ids
            outputs.append(CompletionOutput(
                index=i, text=c.detok.text(finished), token_ids=list(token_ids),
                cumulative_logprob=c.cumulative_logprob, logprobs=c.logprobs,
                finish_reason=req.finish_reason, stop_reason=req.stop_reason, error=req.error,
            ))
        first = parent.children[0].req
        now = time.monotonic()
        if (parent.prompt_logprobs is None and first.prompt_logprobs is not None
                and all(lp is not None for lp in first.prompt_logprobs[1:])):
            parent.prompt_logprobs = [None] + [self._logprob_entry(tid, lp) for tid, lp in
                                               zip(parent.prompt_ids[1:], first.prompt_logprobs[1:], strict=True)]
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt, prompt_token_ids=parent.prompt_ids,
            outputs=outputs, finished=parent.finished, num_cached_tokens=max(first.num_cached_tokens, 0),
            num_cached_tokens_by_tier=dict(zip(TIERS, (first.num_cached_device, first.num_cached_host,
                                                       first.num_cached_store), strict=True)),
            metrics={"arrival": parent.arrival, "first_token": parent.first_token_time, "now": now,
                     "first_scheduled": first.first_scheduled_time},
            prompt_logprobs=parent.prompt_logprobs,
        )
