"""EngineCore: the token-level engine loop (schedule -> run -> update) and its host/model overlap.

    EngineCore.step (strictly in turn) = launch(background=False) + complete
    EngineCore.launch: Scheduler.schedule ─▶ load KV tier hits ─▶ ModelRunner.prepare ─▶ Scheduler.commit
                       ─▶ ModelRunner.run (on the model thread, or inline)
    EngineCore.complete: wait for the step ─▶ CostModel.observe ─▶ Scheduler.update (tokens, stop checks)

EngineCore also owns the KV tiers below the device cache (`kv_tiers.KVTiers`, built from
`config.kvstore`): between scheduling a step and preparing it, tier hits of newly admitted
requests are loaded into their device blocks; `close()` finishes pending store writes.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from deepinfer.config import EngineConfig
from deepinfer.engine.cost_model import CostModel, StepWork
from deepinfer.engine.cost_profile import profile_steps
from deepinfer.engine.expert_parallel import ExpertParallel
from deepinfer.engine.request import Request
from deepinfer.engine.runner import ModelRunner, StepResult
from deepinfer.engine.sampler import TokenLogprobs
from deepinfer.engine.scheduler import PrefillPolicy, Scheduler, SchedulerOutput
from deepinfer.engine.spec import Speculator
from deepinfer.kvcache.engine_tiers import KVTiers, resolve_retention
from deepinfer.kvcache.manager import KVCacheManager
from deepinfer.lora import LoRAManager
from deepinfer.models.registry import text_config
from deepinfer.weights import resolve_model

logger = logging.getLogger(__name__)


@dataclass
class InFlightStep:
    plan: SchedulerOutput
    future: Future[StepResult]
    ready: threading.Event | None = None


@dataclass
class CoreOutput:
    """What one step appended to a request: usually one token; with speculative decoding, the kept drafts
    and the target's token (cut at a stop condition). `logprobs`: one per token, if the request asked."""

    request: Request
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None


class EngineCore:
    """Token-level engine: owns the scheduler, the KV manager and the model runner."""

    def __init__(self, config: EngineConfig, policy: PrefillPolicy | None = None,
                 expert_parallel: ExpertParallel | None = None) -> None:
        from transformers import AutoConfig

        self.config = config
        self.files = resolve_model(config.model.model)
        self.checkpoint_config = checkpoint_config = AutoConfig.from_pretrained(str(self.files.directory))
        # the language model's config (a vision-language checkpoint's text_config): what the engine sizes by
        self.hf_config = text_config(checkpoint_config)
        model_len = getattr(self.hf_config, "max_position_embeddings", None) or 4096
        self.max_model_len = config.model.max_model_len or model_len
        sc = config.scheduler
        self.runner = ModelRunner(config.model, config.cache, self.files, checkpoint_config, self.max_model_len,
                                  sc.max_num_seqs, sc.max_num_batched_tokens, expert_parallel)
        bs = config.cache.block_size
        capacity = self.runner.num_blocks * bs
        if capacity < self.max_model_len:
            if config.model.max_model_len is not None:
                raise ValueError(
                    f"the KV cache holds {capacity} tokens ({self.runner.num_blocks} blocks), less than "
                    f"max_model_len={self.max_model_len}; raise kv_cache_memory or lower max_model_len")
            logger.warning("max_model_len lowered from %d to %d to fit the KV cache", self.max_model_len, capacity)
            self.max_model_len = capacity
        # the layout key (dtype, block size, layers, KV heads, head dim) seeds every block hash: blocks of
        # another layout in a shared store can then never match, not only fail a header check
        kv_layout = self.runner.kv_layout_key()
        # what the weights compute, not where they are: copies at other paths (other hosts) share KV
        self.model_identity = self.files.kv_identity(self.runner.dtype)
        self.kv = KVCacheManager(self.runner.group_num_blocks, bs, self.model_identity, kv_layout,
                                 config.cache.enable_prefix_caching, [g.spec for g in self.runner.kv_groups],
                                 config.cache.swa_replay_tokens)
        self.cost_model = CostModel()
        if sc.profile_cost_model:
            self.cost_model.calibrate(profile_steps(self.runner, self.kv, self.max_model_len, sc.max_num_seqs,
                                                    sc.max_num_batched_tokens))
            if expert_parallel is not None:
                expert_parallel.reset()
            if self.runner.tiles is not None:  # the tower's seconds per tile, before the first image comes
                self.runner.tiles.profile()
        ks = config.kvstore
        self.retention = ks.retention
        # attached after the profile: its synthetic steps must not reach the tiers. The tiers extend the
        # prefix cache, so they are off without it.
        self.tiers: KVTiers | None = None
        if config.cache.enable_prefix_caching and self.kv.supports_tiers:
            self.tiers = KVTiers.from_config(ks, self.model_identity, self.runner.tier_blocks)
        elif config.cache.enable_prefix_caching:
            logger.info("KV tiers off: this model has window layers and bounded replay is off, or no layer kept "
                        "for the whole sequence (the tiers hold those only; the device prefix cache still serves it)")
        self.kv.attach_tiers(self.tiers)
        self.speculator = self._speculator()
        if self.speculator is not None and sc.profile_cost_model:
            self.speculator.calibrate(self.runner, self.kv, self.max_model_len, sc.max_num_seqs,
                                      sc.max_num_batched_tokens)
        # several decode steps per call (only in steps where nobody drafts): not with steps scheduled ahead of
        # the running one's tokens (a step's later tokens would be unknown to the next one's inputs), nor with
        # a proposer that reads the target's hidden states of every token (MTP)
        proposer_reads_hidden = self.speculator is not None and self.config.speculative.speculative_config.method == "mtp"
        steps_rows = 0 if proposer_reads_hidden or sc.overlap_host_work == "on" else self.runner.decode_steps_rows()
        self.scheduler = Scheduler(sc, self.kv, self.max_model_len, policy, self.cost_model, self.speculator,
                                   steps_rows, config.lora.max_loras)
        # LoRA adapters: loaded after the profile (its steps run the base model) and after the weights are final
        self.lora: LoRAManager | None = None
        if config.lora.enable_lora:
            self.lora = LoRAManager(self.runner.model, self.runner.dtype, config.lora.slots, config.lora.max_lora_rank,
                                    dict(config.lora.lora_modules), self.scheduler.in_use_adapters)
        self.scheduler.tile_seconds = lambda: self.runner.tiles.seconds if self.runner.tiles is not None else None
        self.scheduler.whole_image_runs = self.runner.bidirectional_images
        room = self.scheduler.image_run_room()
        if self.runner.bidirectional_images and room < self.runner.model.tokens_per_tile:
            logger.warning("every prompt with an image will be refused: an image's %d tokens must be prefilled in "
                           "one step, which has room for %d beside its decodes (raise --max-num-batched-tokens or "
                           "lower --max-num-seqs)", self.runner.model.tokens_per_tile, room)
        logger.info("KV cache: %s blocks x %d tokens (%.1f MiB)", "/".join(map(str, self.runner.group_num_blocks)),
                    bs, self.runner.kv_cache_bytes / 2**20)
        logger.info("scheduler: %s, step time budget %.0f ms", sc.scheduler, 1000 * self.scheduler.step_time_budget)
        self.num_steps = 0
        self._model_thread: ThreadPoolExecutor | None = None
        self._last_run_ended: float | None = None
        self.idle_gap_seconds = 0.0  # model-thread time with no step running between consecutive steps
        self.idle_gap_last = 0.0
        self.num_idle_gaps = 0
        self.num_steps_ahead = 0  # steps prepared with inputs the still-running step was sampling

    def _speculator(self) -> Speculator | None:
        method = self.config.speculative.speculative_config
        if method is None:
            return None
        # DeepSeek-V4's compressed state needs no rollback beyond `KVCacheManager.truncate`: every state a
        # position writes lives in that position's own slot (window K=V, compressor rows) or in the slot of
        # the compression group it completes (entry and indexer key of group w, completed at (w + 1) * m - 1).
        # A group completed at a rejected position is visible only to queries at or after that position
        # (entries w < (p + 1) // m), i.e. to rejected queries; after the rewind that position lies past
        # `num_computed_tokens`, so the step that computes its real token pools the group again from the
        # real rows (`build_step_meta` pools every group completing inside a step) and overwrites the
        # entry before any kept query reads it. Registered blocks never reach past the computed tokens.
        proposer = None
        if method.method in ("draft_model", "mtp"):  # proposers that run a model: built from the target's setup
            from deepinfer.engine.spec.model_proposers import build_model_proposer

            proposer = build_model_proposer(method, self)
        return Speculator(method, self.cost_model, proposer)

    def add_request(self, req: Request) -> None:
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> Request | None:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def idle_tick(self) -> None:
        """Called by an engine loop while it waits for work: the thread governor keeps measuring what other
        processes use, so the first step after an idle spell runs with the threads the machine has free now
        (cpu_threads.py). On the thread that runs the forward, as the governor needs."""
        if self._model_thread is not None:
            self._model_thread.submit(self.runner.threads.tick)
        else:
            self.runner.threads.tick()

    def check_retention(self, retention_class: str | None) -> str:
        """The retention class a request naming `retention_class` gets; ValueError if this engine has none
        of that name."""
        return resolve_retention(self.retention, retention_class)

    def flush_kv_store(self, timeout: float | None = None) -> bool:
        """Wait until the KV blocks queued for the store are written; False on timeout."""
        return self.tiers.flush(timeout) if self.tiers is not None else True

    def close(self) -> None:
        """Finish pending store writes and release the tiers; the engine cannot serve afterwards."""
        if self._model_thread is not None:
            self._model_thread.shutdown(wait=True)
            self._model_thread = None
        if self.tiers is not None:
            self.kv.attach_tiers(None)
            self.tiers.close()
            self.tiers = None

    def _load_pending(self, plan: SchedulerOutput) -> None:
        """Copy the tier hits of newly admitted requests into their device blocks. A block that does not
        come back verified (evicted, expired, corrupt meanwhile) is recomputed instead: the item starts
        earlier, computes as many tokens as planned, and the request continues next step. A replayed hit
        that lost blocks below its replay goes back to the queue instead (out of this step)."""
        for item in list(plan.scheduled):
            if item.request.pending_load is not None:
                missing = self.kv.load_pending(item.request)
                if missing is None:
                    self.scheduler.requeue(item.request)
                    plan.scheduled.remove(item)
                else:
                    item.start -= missing

    def step(self) -> list[CoreOutput]:
        """Schedule, run and apply one step, in turn."""
        inflight = self.launch(background=False)
        return self.complete(inflight) if inflight is not None else []

    def launch(self, background: bool = True, ahead: InFlightStep | None = None) -> InFlightStep | None:
        """Schedule the next step and build its inputs (host), then start the model on it: on the
        model thread when `background`, else right here. `ahead`: that step is still running; this
        one is scheduled with its tokens pending and queued behind it on the model thread (its
        sampling waits until `complete` has applied the earlier step). None when there is nothing
        to run."""
        plan = self.scheduler.schedule()
        if plan.empty:
            return None
        if ahead is not None and any(item.request.pending_load is not None for item in plan.scheduled):
            # loads write device blocks from this thread; a block just freed by a request that a stop
            # string ended can still receive that request's in-flight token, so let the step finish
            wait([ahead.future])
        # synchronous, on this thread, with no step running (overlapping loads with one is future work)
        self._load_pending(plan)
        if not plan.scheduled:
            return None
        prepared = self.runner.prepare(plan, self.kv.group_tables)
        self.scheduler.commit(plan)
        if ahead is not None:
            prepared.ready = threading.Event()
            self.num_steps_ahead += bool(prepared.pending_tokens)
        future: Future[StepResult] = Future()
        if background:
            if self._model_thread is None:
                self._model_thread = self._start_model_thread()
            future = self._model_thread.submit(self.runner.run, prepared)
        else:
            future.set_result(self.runner.run(prepared))
        return InFlightStep(plan, future, prepared.ready)

    def _start_model_thread(self) -> ThreadPoolExecutor:
        """The thread the model runs on when host work overlaps it. torch's OpenMP thread count is
        per calling thread: the model thread keeps this thread's count, and on CPU this (host) thread
        drops to one, so its small tensor ops no longer wake a second OpenMP team that competes with
        the model's threads for the same cores."""
        threads = torch.get_num_threads()
        if self.runner.device.type == "cpu":
            torch.set_num_threads(1)
        return ThreadPoolExecutor(1, thread_name_prefix="deepinfer-model",
                                  initializer=lambda: torch.set_num_threads(threads))

    def complete(self, inflight: InFlightStep, next_step: InFlightStep | None = None) -> list[CoreOutput]:
        """Wait for a launched step and apply it: sampled tokens, stop conditions. Requests finished
        or aborted while it ran (e.g. by a stop string) are skipped. `next_step`, launched ahead of
        this result, may sample once this returns."""
        try:
            return self._apply(inflight)
        finally:
            if next_step is not None and next_step.ready is not None:
                next_step.ready.set()

    def _apply(self, inflight: InFlightStep) -> list[CoreOutput]:
        result = inflight.future.result()
        plan = inflight.plan
        if self._last_run_ended is not None:
            gap = result.run_started - self._last_run_ended
            self.idle_gap_seconds += gap
            self.idle_gap_last = gap
            self.num_idle_gaps += 1
        if result.spec_steps is not None:
            # a call of speculating steps (their row counts differ from the plan's): what each verified teaches
            # the speculator; neither the cost model nor the step price learns from its mixed shapes
            self.speculator.in_call_done([(item.request, result.spec_verdicts[item.request.request_id])
                                          for item in plan.scheduled], result.spec_steps)
        else:
            # a call of several decode steps: each step is one of the plan's shape
            steps = 1 + max((len(v) for v in result.accepted.values()), default=0) \
                if plan.scheduled[0].num_steps > 1 else 1
            # the tower's time is priced per tile (`TileEncoder.seconds`), not by the text terms
            self.cost_model.observe(StepWork.from_output(plan), (result.seconds - result.encode_seconds) / steps)
            # a decode-phase step (every item a decode or a verification; a pending token makes num_tokens
            # run ahead of the plan, so the plan's own shape decides) prices verification
            if self.speculator is not None and all(item.num_new_tokens == 1 or item.draft_token_ids
                                                   for item in plan.scheduled):
                self.speculator.observe_step(plan.num_tokens, result.seconds, result.cpu_seconds, steps)
        for item in plan.scheduled:  # their KV is now written: what a KV exporter may read
            multi = item.draft_token_ids or item.num_steps > 1
            kept = len(result.accepted.get(item.request.request_id, ())) if multi else item.num_new_tokens - 1
            item.request.num_kv_done_tokens = item.start + 1 + kept
        before = {item.request.request_id: len(item.request.token_ids) for item in plan.scheduled}
        advanced = self.scheduler.update(plan, result.sampled, result.accepted)
        self.num_steps += 1
        # a gap counts only between steps that follow each other while work is pending
        self._last_run_ended = result.run_ended if self.scheduler.has_unfinished() else None
        if self._last_run_ended is None and self.speculator is not None:
            self.speculator.idle()
        outputs = []
        for r in advanced:
            rid = r.request_id
            new = r.token_ids[before[rid]:]
            lp = result.logprobs.get(rid)
            lps = None if lp is None else [*result.accepted_logprobs.get(rid, []), lp][:len(new)]
            outputs.append(CoreOutput(r, new, lps))
        return outputs
