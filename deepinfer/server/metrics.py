"""Prometheus metrics, named like vLLM's with a `deepinfer:` prefix, on a per-app registry.

Engine-side state (running / waiting requests, KV usage, prefix-cache counters by tier, host tier
and KV store health, the step-time cost model's coefficients and prediction error, time-budget
use) is read from the engine's latest stats snapshot at scrape time; request latencies are
observed as outputs stream out (`RequestTimer`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from deepinfer.engine.cost_model import TERMS

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)


def _one(family: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, doc: str, model_name: str,
         value: float):
    """A `deepinfer:` metric family with one sample, labelled by the model's name."""
    f = family(f"deepinfer:{name}", doc, labels=["model_name"])
    f.add_metric([model_name], value)
    return f


def image_metrics(s: dict[str, Any], model_name: str) -> Iterator:
    """A vision tower's metrics, from an engine's or an encode worker's stats (nothing for a text model)."""
    if "image_cache_hits" not in s:
        return
    yield _one(CounterMetricFamily, "image_cache_hits", "Image tiles served from encoded tiles kept for an earlier "
               "request.", model_name, s["image_cache_hits"])
    yield _one(CounterMetricFamily, "image_cache_misses", "Image tiles the vision tower encoded.", model_name,
               s["image_cache_misses"])
    yield _one(GaugeMetricFamily, "image_tile_seconds", "The vision tower's measured seconds per image tile (moving "
               "average; what routing and the scheduler price a tile at).", model_name, s["tile_seconds"])
    if "encoded_tiles" in s:
        yield _one(CounterMetricFamily, "encode_worker_tiles", "Image tiles encoded for other workers (an encode "
                   "worker).", model_name, s["encoded_tiles"])


class _EngineCollector:
    def __init__(self, stats_fn, model_name: str) -> None:
        self.stats_fn = stats_fn
        self.model_name = model_name

    def collect(self):
        s = self.stats_fn()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return _one(GaugeMetricFamily, name, doc, self.model_name, value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return _one(CounterMetricFamily, name, doc, self.model_name, value)

        yield gauge("num_requests_running", "Requests in the running batch.", s["num_running"])
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s["num_waiting"])
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", s["kv_usage"])
        yield gauge("kv_cache_blocks_used", "KV blocks referenced by requests.", s["kv_blocks_used"])
        yield gauge("kv_cache_blocks_total", "KV blocks in the pool.", s["kv_blocks_total"])
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s["prefix_queries"])
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s["prefix_hits"])
        yield counter("swa_replayed_tokens", "Cached prompt tokens whose sliding-window KV was recomputed (SWA "
                      "bounded replay).", s.get("swa_replayed_tokens", 0))
        by_tier = CounterMetricFamily("deepinfer:prefix_cache_hits_by_tier",
                                      "Prompt tokens served from cache, by where they were found (device cache, "
                                      "host-memory tier, persistent store); sums to prefix_cache_hits.",
                                      labels=["model_name", "tier"])
        for tier in ("device", "host", "store"):
            by_tier.add_metric([self.model_name, tier], s[f"prefix_hits_{tier}"])
        yield by_tier
        yield from _kv_tier_metrics(s, gauge, counter)
        yield counter("num_preemptions", "Requests preempted for lack of KV blocks.", s["num_preemptions"])
        if "lora_adapters_loaded" in s:  # an engine serving LoRA adapters
            yield gauge("lora_adapters_loaded", "LoRA adapters loaded (kept in slots).", s["lora_adapters_loaded"])
            yield gauge("lora_adapters_running", "Distinct LoRA adapters of the running requests (at most "
                        "--max-loras).", s["lora_adapters_running"])
            yield gauge("lora_requests_running", "Running requests with a LoRA adapter.", s["lora_requests_running"])
            yield gauge("lora_requests_waiting", "Waiting requests with a LoRA adapter.", s["lora_requests_waiting"])
        yield from image_metrics(s, self.model_name)
        yield counter("cost_model_observations", "Engine steps the step-time cost model has been fitted on.",
                      s["cost_model_observations"])
        yield gauge("step_time_seconds", "Measured time of the last engine step.", s["step_time_seconds"])
        yield gauge("step_time_predicted_seconds", "The cost model's prediction for the last engine step.",
                    s["step_time_predicted_seconds"])
        yield gauge("step_time_prediction_error", "(predicted - measured) / measured time of the last step.",
                    s["step_time_prediction_error"])
        yield gauge("step_time_prediction_abs_error_ema", "Moving average of |relative error| of predicted step "
                    "times (each step predicted before it joins the fit).", s["step_time_prediction_abs_error_ema"])
        yield gauge("step_time_prediction_abs_error_median", "Median |relative error| of predicted step times "
                    "over the cost model's window.", s["step_time_prediction_abs_error_median"])
        yield gauge("step_time_budget_seconds", "Time budget of one step (the compute scheduler fills it).",
                    s["step_time_budget_seconds"])
        yield gauge("step_time_budget_utilization", "Moving average of measured step time / step time budget.",
                    s["step_time_budget_utilization"])
        yield counter("step_idle_gap_seconds", "Time the model sat idle between consecutive steps while requests "
                      "were pending (host work not overlapped with the model).", s["step_idle_gap_seconds_total"])
        yield counter("step_idle_gaps", "Gaps between consecutive steps counted in step_idle_gap_seconds.",
                      s["step_idle_gaps"])
        yield gauge("step_idle_gap_last_seconds", "The last idle gap between consecutive steps.",
                    s["step_idle_gap_last_seconds"])
        if "gc_frozen_objects" in s:  # one engine's (a router's merged stats leave them out)
            yield gauge("engine_gc_frozen_objects", "Objects of the engine process kept out of Python's garbage "
                        "collector (what start-up built).", s["gc_frozen_objects"])
            yield counter("engine_gc_full_collections", "Full garbage collections in the engine process (each "
                          "walks every object not frozen).", s["gc_full_collections"])
        coef = GaugeMetricFamily("deepinfer:cost_model_coefficient",
                                 "Step-time cost model: seconds per unit of each term (overhead: per step; token: "
                                 "per token; seq: per request; attn_pair: per prefill attention pair; decode_ctx: "
                                 "per KV token a decode reads).", labels=["model_name", "term"])
        for term in TERMS:
            coef.add_metric([self.model_name, term], s[f"cost_coef_{term}"])
        yield coef
        if "eplb" in s:
            yield from _expert_metrics(s["eplb"], self.model_name, gauge, counter)
        # one engine's stats carry one proposer's counters flat; a router's carry them per proposer ("spec")
        by_proposer = s.get("spec") or ({str(s["spec_proposer"]): s} if "spec_proposer" in s else {})
        if by_proposer:
            yield from _spec_metrics(by_proposer, self.model_name)


def _expert_metrics(e: dict, model: str, gauge: Callable[[str, str, float], GaugeMetricFamily],
                    counter: Callable[[str, str, float], CounterMetricFamily]) -> Iterator[Any]:
    """Expert parallelism / EPLB (`deepinfer/eplb/balancer.py`): per-rank load, imbalance, replica map."""
    ranks = e.get("ranks") or [e]
    tokens = CounterMetricFamily("deepinfer:eplb_rank_expert_tokens", "(token, expert) pairs each rank's experts "
                                 "computed.", labels=["model_name", "rank"])
    seconds = CounterMetricFamily("deepinfer:eplb_rank_expert_compute_seconds", "Time each rank spent computing "
                                  "its experts' pairs.", labels=["model_name", "rank"])
    for r in ranks:
        if r:
            tokens.add_metric([model, str(r["rank"])], r["expert_tokens_total"])
            seconds.add_metric([model, str(r["rank"])], r["expert_compute_seconds_total"])
    yield tokens
    yield seconds
    yield gauge("eplb_imbalance", "max / mean of per-rank expert tokens over the last balancer interval "
                "(1 = even).", e["imbalance"])
    yield counter("eplb_rebalances", "Expert re-placements done.", e["rebalances"])
    yield gauge("eplb_last_rebalance_timestamp_seconds", "Unix time of the last expert re-placement (0: never).",
                e["last_rebalance_time"])
    yield gauge("eplb_last_rebalance_duration_seconds", "Time from the last re-placement's decision to its switch "
                "(the weights move between ranks meanwhile, beside serving).", e["last_rebalance_seconds"])
    replicas = GaugeMetricFamily("deepinfer:eplb_expert_replicas", "Physical copies of each logical expert, per "
                                 "MoE layer (its index among the MoE layers).", labels=["model_name", "layer", "expert"])
    for layer, row in enumerate(e["replicas"]):
        for expert, n in enumerate(row):
            replicas.add_metric([model, str(layer), str(expert)], n)
    yield replicas


def _spec_metrics(by_proposer: dict[str, dict], model_name: str) -> Iterator[Any]:
    """Speculative decoding, labelled by proposer: counters, acceptance rate, mean accepted length, and the
    histogram of the draft length chosen per decoding request-step (k = 0: no drafts verified)."""
    labels = ["model_name", "proposer"]
    for family, name, key, doc in (
            (CounterMetricFamily, "spec_decode_verifications", "spec_verifications",
             "Request-steps that verified at least one draft token."),
            (CounterMetricFamily, "spec_decode_num_draft_tokens", "spec_draft_tokens", "Draft tokens verified."),
            (CounterMetricFamily, "spec_decode_num_accepted_tokens", "spec_accepted_tokens",
             "Draft tokens accepted."),
            (CounterMetricFamily, "spec_decode_num_emitted_tokens", "spec_emitted_tokens",
             "Tokens emitted by verifications (accepted drafts + the target's token)."),
            (CounterMetricFamily, "spec_decode_hindsight_checks", "spec_hindsight_checks",
             "Proposals not drafted, checked against the tokens decoded after them."),
            (CounterMetricFamily, "spec_decode_hindsight_kept_tokens", "spec_hindsight_kept_tokens",
             "Tokens of those proposals that a verification would have kept."),
            (GaugeMetricFamily, "spec_decode_acceptance_rate", "spec_acceptance_rate",
             "Accepted / verified draft tokens since start."),
            (GaugeMetricFamily, "spec_decode_mean_accepted_length", "spec_mean_accepted_length",
             "Mean tokens emitted per verification (accepted drafts + 1).")):
        m = family(f"deepinfer:{name}", doc, labels=labels)
        for proposer, s in by_proposer.items():
            m.add_metric([model_name, proposer], s[key])
        yield m
    h = HistogramMetricFamily("deepinfer:spec_decode_draft_length", "Draft length chosen per decoding "
                              "request-step (adaptive: per request and step; 0 = no drafts).", labels=labels)
    for proposer, s in by_proposer.items():
        counts = []
        while f"spec_k_chosen_{len(counts)}" in s:
            counts.append(s[f"spec_k_chosen_{len(counts)}"])
        total = 0
        buckets = []
        for k, n in enumerate(counts):
            total += n
            buckets.append((str(float(k)), total))
        buckets.append(("+Inf", total))
        h.add_metric([model_name, proposer], buckets, sum(k * n for k, n in enumerate(counts)))
    yield h


def _kv_tier_metrics(s: dict, gauge: Callable[[str, str, float], GaugeMetricFamily],
                     counter: Callable[[str, str, float], CounterMetricFamily]) -> Iterator[Any]:
    """Host tier occupancy and store health (zeros when a tier is off)."""
    yield gauge("kv_host_cache_bytes", "Bytes of KV blocks held by the host-memory tier.", s["kv_host_bytes"])
    yield gauge("kv_host_cache_capacity_bytes", "Capacity of the host-memory tier.", s["kv_host_max_bytes"])
    yield gauge("kv_host_cache_blocks", "KV blocks held by the host-memory tier.", s["kv_host_blocks"])
    yield counter("kv_host_cache_evictions", "KV blocks the host tier dropped for room.", s["kv_host_evictions"])
    yield counter("kv_tier_loaded_blocks_host", "KV blocks copied from host memory into the device cache.",
                  s["kv_loaded_host_blocks"])
    yield counter("kv_tier_loaded_blocks_store", "KV blocks read from the store into the device cache.",
                  s["kv_loaded_store_blocks"])
    yield counter("kv_store_written_blocks", "KV blocks written to the store by this process.",
                  s["kv_store_written_blocks"])
    yield counter("kv_store_corrupt", "Store objects found damaged or mismatched, dropped and treated as misses.",
                  s["kv_store_corrupt"])
    yield counter("kv_store_expired", "Store objects found past their retention TTL and dropped.",
                  s["kv_store_expired"])
    yield counter("kv_store_read_errors", "Store reads that failed with an I/O error.", s["kv_store_read_errors"])
    yield counter("kv_store_write_errors", "Store writes dropped by an I/O error (full disk, read-only ...).",
                  s["kv_store_write_errors"])
    yield counter("kv_store_evictions", "Store objects this process evicted to stay under capacity.",
                  s["kv_store_evicted"])
    yield counter("kv_store_queue_dropped_blocks", "KV blocks not written to the store: the background writer's "
                  "queue was full.", s["kv_store_dropped_queue_blocks"])
    yield counter("kv_store_declined_blocks", "Computed KV blocks not written to the store at their first use "
                  "(--kv-store-admit reused); written if needed again.", s["kv_store_declined_blocks"])
    yield counter("kv_store_capacity_dropped_writes", "Store writes dropped because they could not fit even "
                  "after eviction.", s["kv_store_dropped_capacity"])
    yield counter("kv_tier_errors", "Unexpected KV tier failures handled as misses.", s["kv_tier_errors"])
    yield counter("kv_prefetch_requests", "Requests whose store hits were read ahead on the prefetch thread.",
                  s["kv_prefetch_requests"])
    yield counter("kv_prefetch_read_seconds", "Time the prefetch thread spent reading and verifying store hits.",
                  s["kv_prefetch_read_seconds"])
    yield counter("kv_prefetch_misses", "Prefetches that staged less than the lookup found (corrupt, expired, "
                  "failed or timed-out reads), recomputed instead.",
                  s["kv_prefetch_short_reads"] + s["kv_prefetch_errors"] + s["kv_prefetch_timeouts"])
    yield gauge("kv_prefetch_staged_bytes", "Bytes of KV staged in host memory for requests not yet admitted.",
                s["kv_prefetch_staged_bytes"])


class ServerMetrics:
    def __init__(self, stats_fn, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(stats_fn, model_name))
        self.model_name = model_name
        label = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("deepinfer:prompt_tokens", "Prompt tokens processed.", label, registry=r)
        self.generation_tokens = Counter("deepinfer:generation_tokens", "Tokens generated.", label, registry=r)
        self.request_success = Counter("deepinfer:request_success", "Finished requests by reason.",
                                       label + ["finished_reason"], registry=r)
        self.ttft = Histogram("deepinfer:time_to_first_token_seconds", "Time to first token.", label,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("deepinfer:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             label, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("deepinfer:e2e_request_latency_seconds", "Arrival to last token.", label,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("deepinfer:request_queue_time_seconds", "Arrival to first scheduled.", label,
                                    buckets=_LATENCY_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Observes one request's latencies from the outputs it streams."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics
        self.start = time.monotonic()
        self.last: float | None = None
        self.tokens = 0

    def observe(self, out) -> None:
        now = time.monotonic()
        tokens = sum(len(c.token_ids) for c in out.outputs)
        new = tokens - self.tokens
        name = self.m.model_name
        if new > 0:
            if self.last is None:
                self.m.ttft.labels(name).observe(now - self.start)
                queued = out.metrics.get("first_scheduled")
                if queued is not None:
                    self.m.queue_time.labels(name).observe(max(0.0, queued - out.metrics["arrival"]))
            else:
                gap = (now - self.last) / new
                for _ in range(new):
                    self.m.itl.labels(name).observe(gap)
            self.last = now
            self.tokens = tokens
            self.m.generation_tokens.labels(name).inc(new)
        if out.finished:
            self.m.e2e.labels(name).observe(now - self.start)
            self.m.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
            for c in out.outputs:
                self.m.request_success.labels(name, c.finish_reason or "abort").inc()
