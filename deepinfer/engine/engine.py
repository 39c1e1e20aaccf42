"""LLMEngine: requests in, outputs out, around EngineCore; used by the offline `LLM`, the server's engine
thread (`AsyncEngine`) and the engine process (`ProcessEngine`).

    LLMEngine.add_request ─▶ RequestValidator.validate (unless the caller already did)
                          ─▶ n sequences (`Request`s) ─▶ EngineCore.add_request ─▶ Scheduler.waiting
    LLMEngine.step_tokens ─▶ EngineCore (see core.py): schedule ─▶ run ─▶ update
                          ─▶ TokenDelta per sequence that advanced (token ids, raw logprobs, finish)
    LLMEngine.step = step_tokens ─▶ OutputProcessor.process (output_processor.py: detokenization, stop
                     strings, which finish sequences here through `finish_sequence`, n > 1 fan-in)
                          ─▶ RequestOutput per request that changed

With `process_outputs=False` (the engine process) the engine has no OutputProcessor: it serves
`step_tokens` and `finish_sequence`, and the processor runs where the outputs are wanted.

Structured output: `add_request` starts each sequence's grammar compiling on `grammar.GrammarCache`
(a small thread pool, cached by schema); the scheduler holds the request back until it is ready.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import logging
import platform
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from deepinfer.config import EngineConfig
from deepinfer.engine.core import CoreOutput, EngineCore, InFlightStep
from deepinfer.engine.expert_parallel import ExpertParallel, RankInfo
from deepinfer.engine.grammar import GrammarCache
from deepinfer.engine.output_processor import OutputProcessor, sequence_ids
from deepinfer.engine.outputs import Logprob, RequestOutput, TokenDelta
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.runner import resolve_device
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import PrefillPolicy
from deepinfer.engine.structured import GrammarBackend, StructuredOutputParams, XGrammarBackend
from deepinfer.engine.validation import RequestValidator
from deepinfer.kvcache.blocks import layout_of
from deepinfer.kvcache.engine_tiers import tier_stats
from deepinfer.kvcache.exchange import export_blocks, export_computed, import_blocks, release_blocks
from deepinfer.lora import LoadedAdapter, LoRAManager, LoRARequest
from deepinfer.models.registry import image_facts
from deepinfer.multimodal.encoder import tile_stats
from deepinfer.multimodal.inputs import MultiModalInputs
from deepinfer.multimodal.processor import MultiModalProcessor
from deepinfer.recipe.tokenizer import bad_word_sequences, eos_token_ids, load_tokenizer, sampling_defaults

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


class LLMEngine:
    """Validation, tokenization and request bookkeeping around EngineCore; outputs through an OutputProcessor
    (`process_outputs`), else as token deltas (`step_tokens`) for a processor elsewhere."""

    def __init__(self, config: EngineConfig, policy: PrefillPolicy | None = None, process_outputs: bool = True,
                 rank: RankInfo | None = None) -> None:
        """`rank`: this engine's place among expert-parallel ranks (started by `ExpertParallelEngine`)."""
        # expert parallelism / EPLB: the MoE layers' share of experts and the step protocol (expert_parallel.py)
        self.expert_parallel = ExpertParallel(config.parallel, rank, resolve_device(config.model.device)) \
            if config.parallel.expert_parallel else None
        self.core = EngineCore(config, policy, self.expert_parallel)
        self.tokenizer = load_tokenizer(self.core.files) if self.core.files.has_tokenizer() else None
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.core.hf_config, self.core.files.directory)
        self.sampling_defaults = sampling_defaults(self.core.config.model.generation_config, self.core.files.directory)
        self.vocab_size = self.core.hf_config.vocab_size
        self.validator = RequestValidator(self.vocab_size, self.core.max_model_len, self.tokenizer is not None,
                                          self.core.check_retention)
        self.processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.finish_sequence) \
            if process_outputs else None
        self._seqs: dict[str, list[Request]] = {}  # request id -> its sequences in the core
        self._seq_request: dict[str, str] = {}  # sequence id -> request id
        self._prompt_logprobs_due: set[str] = set()  # requests whose prompt logprobs are still to be sent
        self._ids = itertools.count()
        mode = config.scheduler.overlap_host_work
        self.overlap = mode == "on" or (mode == "auto" and self.core.runner.device.type == "cuda")
        # the expert-parallel step protocol and EPLB's switches run between steps on this thread
        self.overlap = self.overlap and self.expert_parallel is None
        self._inflight: InFlightStep | None = None
        self.grammars = GrammarCache(self._grammar_backend)
        self._kv_streams: dict[str, list] = {}  # stream_kv requests: id -> [Request, blocks exported]
        self._kv_holds: dict[str, list[tuple[int, int]]] = {}  # import_kv_blocks(hold_key=...) -> (group, block) held
        self.gc_frozen_objects = 0  # set by freeze_startup_objects

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

    @functools.cached_property
    def multimodal_processor(self) -> MultiModalProcessor | None:
        """The model's HF processor for prompts with images; None for a model that takes no images."""
        facts = image_facts(self.core.checkpoint_config)
        return MultiModalProcessor(self.core.files.directory, *facts) if facts is not None else None

    def describe(self) -> dict:
        """Model and cache facts for start-up banners and cluster registration (plain values only)."""
        core = self.core
        tiers = core.tiers
        names = core.config.model.served_model_name
        return {"model_name": names[0] if names else core.files.name, "sampling_defaults": self.sampling_defaults,
                "dtype": str(core.runner.dtype), "device": str(core.runner.device),
                "hardware": hardware_name(core.runner.device),
                "num_blocks": core.runner.num_blocks, "block_size": core.config.cache.block_size,
                "host_tier_bytes": tiers.host.max_bytes if tiers is not None and tiers.host is not None else None,
                "store_root": str(tiers.store.root) if tiers is not None and tiers.store is not None else None,
                "architectures": list(getattr(core.checkpoint_config, "architectures", None) or []),
                "model_identity": core.model_identity, "max_num_seqs": core.config.scheduler.max_num_seqs,
                # LoRA adapters requests may name -> their directories and content digests (None: serves none)
                "lora_adapters": None if core.lora is None else dict(core.lora.paths),
                "lora_digests": None if core.lora is None else dict(core.lora.digests),
                # a vision-language model: where its processor is and what its image tokens are (None: no images)
                "multimodal": None if (images := image_facts(core.checkpoint_config)) is None else {
                    "directory": str(core.files.directory), "image_token_id": images[0], "tokens_per_tile": images[1]},
                # None: a model with its own KV state (DeepSeek-V4), which KV export does not move yet
                "kv_layout": None if core.runner.custom_kv
                else list(dataclasses.astuple(layout_of(core.runner.tier_caches)))}

    def compile_grammar(self, params: StructuredOutputParams):
        """Start compiling (or find cached) `params`' grammar; a Future whose `result()` raises
        ValueError for an invalid grammar. Callers that want the error before queuing wait on it."""
        return self.grammars.compile(params)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    cache_salt: str | None = None, prompt_token_ids: list[int] | None = None,
                    retention_class: str | None = None, output_prefix: list[int] | None = None,
                    prefix_logprobs: list[dict[int, Logprob]] | None = None, stream_kv: bool = False,
                    cache_tenant: str | None = None, validated: bool = False, stream: bool = True,
                    multi_modal: MultiModalInputs | None = None, lora_request: LoRARequest | str | None = None
                    ) -> str:
        """Queue a request; `prompt_token_ids`, if given, is `prompt` already tokenized. `retention_class`
        (default: the configured default class) says how long the KV store keeps its blocks.
        `output_prefix`: tokens already generated elsewhere (a prefill worker's first token, with their
        `prefix_logprobs` if the request wants logprobs); the request continues after them as if it had
        sampled them itself (n == 1 only). `stream_kv` (n == 1 only): after every step that completed more
        of the prompt's full blocks, the request's output carries them (`RequestOutput.kv_blocks`), with
        or without a new token: a prefill worker ships them while the rest of the prompt computes.
        `cache_tenant`: the authenticated tenant's cache namespace (set by the server from the API key, never
        by a client); its blocks are named apart from every other tenant's, whatever `cache_salt` says.
        `validated`: the caller already ran `self.validator.validate` (and resolved `retention_class`).
        `stream`: False when only the final output is wanted (the offline `LLM`). `multi_modal`: the prompt's
        images (a vision-language model; `multimodal/processor.py` makes them with the prompt's tokens).
        `lora_request`: the LoRA adapter it runs with, a `LoRARequest` or a loaded adapter's name (the engine
        must serve adapters: `enable_lora`)."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._seqs or (self.processor is not None and request_id in self.processor):
            raise ValueError(f"duplicate request id {request_id!r}")
        prompt_ids = list(prompt_token_ids) if prompt_token_ids is not None else self.tokenize(prompt)
        if not validated:
            retention_class = self.validator.validate(prompt_ids, params, retention_class, output_prefix,
                                                      prefix_logprobs, stream_kv)
        self.check_images(prompt_ids, multi_modal)
        lora = self.resolve_adapter(lora_request)
        if params.bad_words and params.bad_words_token_ids is None:
            params = dataclasses.replace(params, bad_words_token_ids=bad_word_sequences(self.tokenizer,
                                                                                        params.bad_words))
        if self.processor is not None:
            self.processor.add_request(request_id, prompt if isinstance(prompt, str) else None, prompt_ids, params,
                                       output_prefix, prefix_logprobs, stream)
        output_prefix = list(output_prefix or [])
        seqs: list[Request] = []
        first: Request | None = None
        for i, seq_id in enumerate(sequence_ids(request_id, params.n)):
            seq_params = params
            if params.n > 1 and params.seed is not None and i > 0:
                seq_params = dataclasses.replace(params, seed=params.seed + i)
            grammar = None
            if params.structured_output is not None:  # each sequence walks the grammar on its own
                grammar = self.grammars.request_state(params.structured_output)
            req = Request(seq_id, prompt_ids, seq_params, self.eos_token_ids, cache_salt, wait_for=first,
                          retention_class=retention_class, grammar=grammar, cache_tenant=cache_tenant,
                          multi_modal=multi_modal, lora=lora)
            first = first or req
            if output_prefix:  # as if it had sampled them: token state (its text is the processor's)
                req.token_ids.extend(output_prefix)
                if grammar is not None:
                    grammar.replay.extend(output_prefix)
            seqs.append(req)
        self._seqs[request_id] = seqs
        for req in seqs:
            self._seq_request[req.request_id] = request_id
            self.core.add_request(req)
        if params.prompt_logprobs is not None:
            self._prompt_logprobs_due.add(request_id)
        if stream_kv:
            self._kv_streams[request_id] = [seqs[0], 0]
        return request_id

    def resolve_adapter(self, lora_request: LoRARequest | str | None) -> LoadedAdapter | None:
        """The loaded adapter `lora_request` names (loading it if need be); None for none; ValueError where the
        engine serves no adapters or cannot serve this one."""
        if lora_request is None:
            return None
        manager = self._lora()  # first: an engine without adapters refuses whatever the request is
        if not isinstance(lora_request, str):  # vLLM's LoRARequest, or any object of its shape
            lora_request = LoRARequest(lora_request.lora_name, getattr(lora_request, "lora_int_id", 0),
                                       getattr(lora_request, "lora_path", "") or "")
        return manager.acquire(lora_request)

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the adapter in directory `path` as `name` (ValueError if it cannot be served)."""
        self._lora().register(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving `name` (requests already running with it finish with it)."""
        self._lora().unregister(name)

    def lora_adapter_names(self) -> list[str]:
        """The names of the adapters requests may use (none where the engine serves none)."""
        return self.core.lora.names() if self.core.lora is not None else []

    def _lora(self) -> LoRAManager:
        if self.core.lora is None:
            raise ValueError("this engine serves no LoRA adapters (start it with enable_lora / --enable-lora)")
        return self.core.lora

    def check_images(self, prompt_ids: list[int], multi_modal: MultiModalInputs | None) -> None:
        """Raise ValueError unless the prompt's image placeholders and `multi_modal` fit each other and the model."""
        model = self.core.runner.model
        if not hasattr(model, "encode_tiles"):
            if multi_modal is not None:
                raise ValueError(f"{type(model).__name__} takes no images")
            return
        if multi_modal is None:
            if model.image_token_id in prompt_ids:
                raise ValueError("the prompt has image tokens but no images")
            return
        multi_modal.check(prompt_ids, model.image_token_id, model.tokens_per_tile)
        self.core.scheduler.check_image_runs(multi_modal)
        if multi_modal.embeddings is not None and multi_modal.embeddings.shape[-1] != model.config.hidden_size:
            raise ValueError(f"image embeddings of width {multi_modal.embeddings.shape[-1]} for a model of width "
                             f"{model.config.hidden_size}")

    @contextlib.contextmanager
    def closed_batch(self) -> Iterator[None]:
        """Within it, the caller adds no request until every one in the engine has finished (`LLM.generate`):
        speculation then weighs each request's drafts by its projected finish (`FinishBalance`), since the
        batch's wall time is its last request's, and a pass of several decode steps is not cut to
        `multi_step_budget_ms` (which bounds the wait of a request arriving during it)."""
        scheduler, speculator = self.core.scheduler, self.core.speculator
        scheduler.closed_batch = True
        if speculator is not None:
            speculator.balance.begin()
        try:
            yield
        finally:
            scheduler.closed_batch = False
            if speculator is not None:
                speculator.balance.end()

    def abort_request(self, request_id: str) -> None:
        if self.processor is not None:
            self.processor.abort(request_id)
        self._kv_streams.pop(request_id, None)
        for req in self._forget(request_id):
            self.core.abort_request(req.request_id)

    def finish_sequence(self, seq_id: str, stop: str) -> None:
        """End a sequence that a stop string matched (the output processor's one command): the core frees
        its blocks now. Unknown or already finished sequences are ignored."""
        self.core.scheduler.finish_request(seq_id, RequestStatus.FINISHED_STOPPED, stop)
        request_id = self._seq_request.get(seq_id)
        if request_id is not None and all(r.finished for r in self._seqs[request_id]):
            self._forget(request_id)

    def _forget(self, request_id: str) -> list[Request]:
        seqs = self._seqs.pop(request_id, [])
        for req in seqs:
            self._seq_request.pop(req.request_id, None)
        self._prompt_logprobs_due.discard(request_id)
        return seqs

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

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

    def freeze_startup_objects(self) -> None:
        """Move every object alive now out of the garbage collector's reach (`gc.freeze`), for a process that
        holds this engine for its whole life (an engine built and dropped in a longer-lived process would keep
        its reference cycles, its KV cache with them, frozen). The count is read here, once:
        `gc.get_freeze_count()` walks the whole frozen list (~330K objects for the default model), and
        `stats()` runs after every step (12% of a guidellm run's engine time on a 2-core Zen 4 went there)."""
        gc.collect()
        gc.freeze()
        self.gc_frozen_objects = gc.get_freeze_count()

    def flush_kv_store(self, timeout: float | None = None) -> bool:
        """Wait until the KV blocks queued for the persistent store are written; False on timeout."""
        return self.core.flush_kv_store(timeout)

    def close(self) -> None:
        """Finish pending KV store writes and release the tiers (see `EngineCore.close`)."""
        self._inflight = None
        self.grammars.close()
        self.core.close()
        if self.expert_parallel is not None:
            self.expert_parallel.close()

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
            "swa_replayed_tokens": kv.replayed_tokens,
            **tier_stats(self.core.tiers),
            "num_preemptions": sched.num_preemptions,
            # load signals for a cluster router: queued prefill compute (cost model) and KV held
            "prefill_queued_seconds": self._queued_prefill_seconds(),
            "prefill_queued_at": time.monotonic(),  # system-wide clock: a worker process ages the snapshot
            "kv_tokens": sum(r.num_tokens for r in sched.running),
            "kv_blocks_held_for_imports": sum(len(h) for h in self._kv_holds.values()),
            **(tile_stats(tiles) if (tiles := self.core.runner.tiles) is not None else {}),
            "step_idle_gap_seconds_total": self.core.idle_gap_seconds,
            "step_idle_gap_last_seconds": self.core.idle_gap_last,
            "step_idle_gaps": self.core.num_idle_gaps,
            # the collector: objects kept out of its reach, and its full collections (each walks the rest)
            "gc_frozen_objects": self.gc_frozen_objects,
            "gc_full_collections": gc.get_stats()[2]["collections"],
            **self.core.cost_model.stats(sched.step_time_budget),
            **({"eplb": self.expert_parallel.stats()} if self.expert_parallel is not None else {}),
            **(self.core.speculator.stats() if self.core.speculator is not None else {}),
            **(self._lora_stats() if self.core.lora is not None else {}),
        }

    def _lora_stats(self) -> dict[str, float]:
        sched = self.core.scheduler
        with_adapter = [r for r in sched.running if r.lora is not None]
        return {"lora_adapters_loaded": self.core.lora.num_loaded,
                "lora_adapters_running": len({r.lora.slot for r in with_adapter}),
                "lora_requests_running": len(with_adapter),
                "lora_requests_waiting": sum(r.lora is not None for r in sched.waiting)}

    def _queued_prefill_seconds(self) -> float:
        """Predicted compute of the prompt tokens not yet computed (waiting and partly prefilled requests),
        each prefilled alone in one step: one vectorized sum, as it runs after every step. A step in
        flight (`overlap_host_work`) counts its tokens as computed from its launch; its prefill chunks are
        still to run, so a request in it counts from where that chunk starts (else a prompt prefilled
        in one long step would be reported as done for the whole step)."""
        from deepinfer.engine.cost_model import step_features

        sched, cost, tiles = self.core.scheduler, self.core.cost_model, self.core.runner.tiles
        running_from = {} if self._inflight is None else {
            item.request.request_id: item.start for item in self._inflight.plan.scheduled if item.num_new_tokens > 1}
        chunks = []
        num_tiles = 0  # image tiles still to run through the vision tower, priced at its measured seconds per tile
        for r in (*sched.waiting, *sched.running):
            done = running_from.get(r.request_id, r.num_computed_tokens)
            total = r.num_tokens - r.num_pending_tokens  # a pending token is the next decode, not prompt
            if done < total - 1:
                chunks.append((total - done, done))
                if r.multi_modal is not None and tiles is not None:
                    num_tiles += r.multi_modal.tiles_to_encode(done, r.mm_encoded.held_digests(), tiles.cache)
        if not chunks:
            return 0.0
        overhead = cost.coefficients["overhead"]
        tile_seconds = (tiles.seconds or 0.0) if num_tiles else 0.0
        return cost.predict_features(step_features(chunks)) + (len(chunks) - 1) * overhead + num_tiles * tile_seconds

    def step(self) -> list[RequestOutput]:
        """Run one engine step (`step_tokens`); return the output of every request that advanced (with
        `stream=False`, only the final ones) from the OutputProcessor."""
        return self.processor.process(self.step_tokens())

    def step_tokens(self) -> list[TokenDelta]:
        """Run one engine step; return a TokenDelta per sequence that advanced or ended.

        With `overlap_host_work`, the step that produced these deltas (N) was launched by the
        previous call; this call schedules and prepares step N+1 while N still runs (N's tokens
        pending), queues it behind N on the model thread, then applies N while N+1 runs; the caller
        detokenizes and matches stop strings meanwhile too (a sequence a stop string ends then has one
        token in flight, which is discarded)."""
        core = self.core
        if not self.overlap:
            outputs = core.step()
        else:
            inflight = self._inflight or core.launch()
            if inflight is None:
                outputs = []
            elif core.speculator is not None and (_carries_drafts(inflight) or (
                    inflight.ready is not None and core.speculator.wants_fresh_step(
                        [item.request for item in inflight.plan.scheduled], core.max_model_len,
                        core.scheduler.decode_batch_ahead(), bool(core.scheduler.waiting)))):
                # Speculative decoding: nothing is scheduled behind a step that verifies drafts (where its
                # requests resume depends on how many drafts it keeps, so the scheduler would leave them out
                # of a step scheduled ahead: they would sit a step out), nor, while drafts may pay, behind a
                # step that was itself scheduled ahead (its requests had a token in flight, so they drafted
                # nothing; the next step is scheduled fresh, when they can). Where the adaptive price says no
                # drafts pay, steps overlap as without speculation (a chat batch would otherwise lose every
                # other step's overlap: 5-7% of its throughput, BENCHMARKS.md session 15).
                self._inflight = None
                outputs = core.complete(inflight)
            else:
                self._inflight = core.launch(ahead=inflight)
                outputs = core.complete(inflight, next_step=self._inflight)
        # requests the scheduler ended without a token (a grammar that failed to compile)
        outputs += [CoreOutput(r, [], None) for r in core.scheduler.take_failed()]
        if not outputs and self._inflight is None:
            self._wait_idle()
        deltas = []
        ended = []
        for out in outputs:
            req = out.request
            request_id = self._seq_request.get(req.request_id)
            if request_id is None:
                continue
            deltas.append(self._delta(request_id, req, out.new_token_ids, out.logprobs))
            if req.finished:
                ended.append(request_id)
        if self._kv_streams:
            self._attach_kv(deltas)
        if self.expert_parallel is not None and self.expert_parallel.world == 1:
            self.expert_parallel.finish_tick()  # EPLB on one rank: count the step (ranks > 1: the rank loop)
        for request_id in ended:
            seqs = self._seqs.get(request_id)
            if seqs is not None and all(r.finished for r in seqs):
                self._forget(request_id)
        return deltas

    def _delta(self, request_id: str, req: Request, tokens: list[int] | None, logprobs) -> TokenDelta:
        first = self._seqs[request_id][0]  # cache facts are the first sequence's (its siblings share its prompt)
        d = TokenDelta(req.request_id, list(tokens or []), list(logprobs) if logprobs and tokens else None,
                       req.finish_reason, req.stop_reason, req.error,
                       (first.num_cached_tokens, first.num_cached_device, first.num_cached_host,
                        first.num_cached_store, first.num_replayed_tokens) if first.num_cached_tokens >= 0 else None,
                       first.first_scheduled_time)
        if req.spec is not None:
            d.spec = (req.spec.num_steps, req.spec.num_draft_tokens, req.spec.num_accepted_tokens)
        if request_id in self._prompt_logprobs_due:
            lps = first.prompt_logprobs
            if lps is not None and all(lp is not None for lp in lps[1:]):
                d.prompt_logprobs = list(lps)
                self._prompt_logprobs_due.discard(request_id)
        return d

    def _attach_kv(self, deltas: list[TokenDelta]) -> None:
        """Give every `stream_kv` request whose finished steps completed more prompt blocks a delta carrying
        them (its token delta of this step, else one without a new token)."""
        by_id = {d.seq_id: d for d in deltas}
        for rid, entry in list(self._kv_streams.items()):
            req, sent = entry
            blocks = export_computed(self.core, req, sent)
            if blocks:
                entry[1] = sent + len(blocks)
                d = by_id.get(rid)
                if d is None and rid in self._seqs:
                    d = by_id[rid] = self._delta(rid, req, None, None)
                    deltas.append(d)
                if d is not None:
                    # plain bytes: they may cross a process pipe, where tensors would go through shared memory
                    d.kv_blocks = [(h, p.numpy().tobytes() if hasattr(p, "numpy") else bytes(p)) for h, p in blocks]
            if req.finished:
                del self._kv_streams[rid]

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


def _carries_drafts(step: InFlightStep) -> bool:
    return any(item.draft_token_ids for item in step.plan.scheduled)
