"""`deepinfer bench simulate`: routing policies compared on a replayed trace against modelled workers.

A discrete-event simulation on a simulated clock (no model runs, nothing sleeps). It replays a Mooncake-style
trace (jsonl: `timestamp` ms, `input_length`, `output_length`, `hash_ids` naming 512-token prefix blocks)
through P prefill and D decode workers, once per routing policy, with the policy classes the real router uses:

    arrival ─▶ store lookup (RouteInfo) ─▶ policy.pick_prefill / pick_decode (WorkerViews, as pool.py builds them)
    prefill worker: FIFO, one prompt at a time; time = cost_model.prefill_seconds(input, cached, chunk)
                    + load_seconds_per_token * cached; at its end the first token exists (TTFT) and the
                    request's blocks enter the shared store
    decode worker:  continuous batching; admits while running < max_running and reserved KV (input + output
                    of each running request) fits; each step's time is the cost model's for the batch
                    (overhead + per-token + per-sequence + decode context terms); a request leaves after
                    output_length - 1 decode steps

The store is shared by all prefill workers (prefixes live in shared storage, as in issue #6): a request's
cached prefix is the longest leading run of its hash_ids that finished prefills have written, optionally
bounded to a capacity in blocks with LRU eviction. Everything is deterministic: no randomness is involved.

It is a model, not a measurement: no KV transfer time, no network, no preemption, perfect load information
(the real router's reports lag), one prompt per prefill step.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import os
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from deepinfer.cluster.policies import RouteInfo, WorkerView, leading_run, make_policy
from deepinfer.config import _f
from deepinfer.engine.cost_model import DEFAULT_COEFFICIENTS, TERMS, CostModel

TRACE_ENV = "DEEPINFER_TRACE"  # the trace to replay when --trace is not given
# the project's shared trace as seen from a checkout's root (where the README's commands run); relative to the
# working directory, never to where the package is installed
DEFAULT_TRACE = Path("../shared/traces/mooncake_conversation_trace.jsonl")
POLICIES = ("round_robin", "least_requests", "deepinfer")
_ARRIVE, _PREFILL_DONE, _STEP_DONE = range(3)


@dataclass(frozen=True)
class SimConfig:
    """Trace replay against modelled prefill and decode workers."""

    trace: str | None = _f(None, f"Trace jsonl (Mooncake format). Default: ${TRACE_ENV} if set, else the "
                           f"project's shared trace, {DEFAULT_TRACE} (relative to the working directory: a "
                           "checkout's root).")
    prefill_workers: int = _f(8, "Modelled prefill workers.")
    decode_workers: int = _f(8, "Modelled decode workers.")
    policies: tuple[str, ...] = _f(POLICIES, f"Routing policies to compare ({', '.join(POLICIES)}).", nargs="+")
    max_requests: int | None = _f(None, "Replay only the first N requests of the trace.")
    time_scale: float | None = _f(None, "Multiply arrival times by this (default: chosen for --target-load).")
    target_load: float = _f(0.8, "Without --time-scale: stretch arrivals so that the prefill pool's offered "
                            "load (estimated prefill seconds at the ideal hit rate / (workers * span)) is this.")
    coefficients: str | None = _f(None, "Cost model coefficients: a JSON file (list of 5, or a dict by term: "
                                  f"{', '.join(TERMS)}) (default: {DEFAULT_COEFFICIENTS}).")
    max_chunk_tokens: int = _f(2048, "Prefill chunk size (tokens per prefill step).")
    block_tokens: int = _f(512, "Tokens per trace hash id.")
    store_capacity_blocks: int | None = _f(None, "Shared store capacity in blocks, LRU (default: unbounded).")
    load_seconds_per_token: float = _f(
        1e-5, "Seconds to load one cached token's KV from the store (~23 KB/token at ~2 GB/s for SmolLM2-135M).")
    max_running: int = _f(128, "Decode worker: most requests in a batch (as --max-num-seqs).")
    kv_capacity_tokens: int = _f(2_097_152, "Decode worker: KV capacity in tokens (input + output reserved).")
    decode_pick: str = _f("arrival", "When the decode worker is chosen: arrival (as the router does: with the "
                          "prefill worker, counting requests against it from the pick on) or prefill_done (when the "
                          "first token exists).", choices=["arrival", "prefill_done"])
    decode_running_weight: float = _f(1.0, "deepinfer policy: weight of running requests / max_running.")
    decode_kv_weight: float = _f(1.0, "deepinfer policy: weight of KV tokens / KV capacity.")

    def __post_init__(self) -> None:
        if self.prefill_workers <= 0 or self.decode_workers <= 0:
            raise ValueError("need at least one prefill and one decode worker")
        for name in ("max_chunk_tokens", "block_tokens", "max_running", "kv_capacity_tokens", "target_load",
                     "time_scale", "max_requests"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("load_seconds_per_token", "store_capacity_blocks"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.decode_pick not in ("arrival", "prefill_done"):
            raise ValueError(f"decode_pick must be arrival or prefill_done, got {self.decode_pick!r}")
        unknown = [p for p in self.policies if p not in POLICIES] or ([] if self.policies else ["(none)"])
        if unknown:
            raise ValueError(f"unknown routing policy {unknown[0]!r} (choose from {', '.join(POLICIES)})")


@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds, before time scaling
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def resolve_trace(trace: str | Path | None) -> Path:
    """The trace to replay: `trace` if given, else $DEEPINFER_TRACE, else DEFAULT_TRACE."""
    if trace:
        return Path(trace).expanduser()
    env = os.environ.get(TRACE_ENV, "").strip()
    return Path(env).expanduser() if env else DEFAULT_TRACE


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a jsonl trace, sorted by arrival (stable); `limit` keeps the first N lines."""
    out: list[TraceRequest] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                r = TraceRequest(float(d["timestamp"]) / 1000.0, int(d["input_length"]), int(d["output_length"]),
                                 tuple(int(h) for h in d.get("hash_ids", ())))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a trace record ({e!r})") from e
            if r.input_length <= 0 or r.output_length < 0 or r.arrival < 0:
                raise ValueError(f"{path}:{n}: need input_length > 0, output_length >= 0, timestamp >= 0")
            out.append(r)
    if not out:
        raise ValueError(f"{path}: no requests")
    return sorted(out, key=lambda r: r.arrival)


def load_coefficients(path: str | None) -> tuple[float, ...]:
    if path is None:
        return tuple(DEFAULT_COEFFICIENTS)
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        data = data.get("coefficients", data)
        if isinstance(data, dict):
            missing = [t for t in TERMS if t not in data]
            if missing:
                raise ValueError(f"{path}: coefficients lack {', '.join(missing)}")
            data = [data[t] for t in TERMS]
    if not isinstance(data, list) or len(data) != len(TERMS):
        raise ValueError(f"{path}: need {len(TERMS)} coefficients ({', '.join(TERMS)})")
    return tuple(float(c) for c in data)


class BlockStore:
    """The shared prefix store: which hash ids finished prefills have written; LRU when bounded."""

    def __init__(self, capacity_blocks: int | None = None) -> None:
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def cached_blocks(self, hash_ids: Sequence[int], touch: bool = False) -> int:
        """Length of the leading run of `hash_ids` in the store (a prefix cache matches only prefixes)."""
        n = leading_run(hash_ids, self._blocks)
        if touch:
            for h in hash_ids[:n]:
                self._blocks.move_to_end(h)
        return n

    def write(self, hash_ids: Sequence[int]) -> None:
        for h in hash_ids:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        if self.capacity is not None:
            while len(self._blocks) > self.capacity:
                self._blocks.popitem(last=False)


def cached_tokens(blocks: int, input_length: int, block_tokens: int) -> int:
    return min(blocks * block_tokens, input_length)


def ideal_hit_rate(requests: Sequence[TraceRequest], block_tokens: int = 512) -> float:
    """Input tokens served from an unbounded store if every request saw all earlier ones' blocks."""
    store, hits, total = BlockStore(), 0, 0
    for r in requests:
        hits += cached_tokens(store.cached_blocks(r.hash_ids), r.input_length, block_tokens)
        total += r.input_length
        store.write(r.hash_ids)
    return hits / total


def decode_step_seconds(coef: Sequence[float], batch: int, context_tokens: int) -> float:
    """The cost model's time for a decode step of `batch` requests whose KV holds `context_tokens` in all
    (each request's decode_ctx term is p + 1, p its tokens before the step; the sum is passed in)."""
    overhead, token, seq, _pair, ctx = coef
    return overhead + (token + seq) * batch + ctx * context_tokens


def auto_time_scale(requests: Sequence[TraceRequest], cfg: SimConfig, model: CostModel) -> float:
    """Time scale at which the prefill pool's offered load is cfg.target_load (ideal hits assumed)."""
    store, work = BlockStore(), 0.0
    for r in requests:
        c = cached_tokens(store.cached_blocks(r.hash_ids), r.input_length, cfg.block_tokens)
        work += model.prefill_seconds(r.input_length, c, cfg.max_chunk_tokens) + cfg.load_seconds_per_token * c
        store.write(r.hash_ids)
    span = max(requests[-1].arrival - requests[0].arrival, 1e-9)
    return work / (cfg.prefill_workers * span * cfg.target_load)


@dataclass
class _Prefill:
    queue: deque = field(default_factory=deque)  # (request index, estimated seconds)
    queued_estimate: float = 0.0
    busy_until: float = 0.0
    busy: bool = False
    busy_seconds: float = 0.0
    inflight_blocks: Counter = field(default_factory=Counter)  # hash ids of the prompts queued or running


@dataclass
class _Decode:
    waiting: deque = field(default_factory=deque)  # request indices
    waiting_tokens: int = 0
    assigned: int = 0  # routed here at arrival, still in prefill (the router counts them from the pick on)
    assigned_tokens: int = 0
    finishes: list = field(default_factory=list)  # heap of (step at which it leaves, request index)
    reserved: int = 0  # input + output of the running requests
    context: int = 0  # sum over running of input + tokens generated
    steps: int = 0
    stepping: bool = False
    busy_seconds: float = 0.0
    request_seconds: float = 0.0  # integral of the batch size over time


@dataclass
class PolicyResult:
    policy: str
    ttft: np.ndarray
    tpot: np.ndarray
    hit_rate: float
    prefill_busy: list[float]
    decode_request_seconds: list[float]
    output_tokens: int
    makespan: float

    def row(self) -> dict[str, float]:
        def imbalance(xs: list[float]) -> float:
            mean = sum(xs) / len(xs)
            return max(xs) / mean if mean > 0 else 1.0

        p50, p90, p99 = (np.percentile(self.ttft, q) for q in (50, 90, 99))
        return {"ttft_p50": p50, "ttft_p90": p90, "ttft_p99": p99, "ttft_mean": float(self.ttft.mean()),
                "tpot_mean": float(self.tpot.mean()) if len(self.tpot) else 0.0,
                "tpot_p99": float(np.percentile(self.tpot, 99)) if len(self.tpot) else 0.0,
                "hit_rate": self.hit_rate, "prefill_imbalance": imbalance(self.prefill_busy),
                "decode_imbalance": imbalance(self.decode_request_seconds),
                "throughput_tok_s": self.output_tokens / self.makespan if self.makespan > 0 else 0.0}


def simulate(requests: Sequence[TraceRequest], policy_name: str, cfg: SimConfig, model: CostModel,
             time_scale: float = 1.0) -> PolicyResult:
    """Replay `requests` (arrivals multiplied by `time_scale`) through one routing policy."""
    policy = make_policy(policy_name, cfg.decode_running_weight, cfg.decode_kv_weight)
    coef = [float(c) for c in model.coef]
    store = BlockStore(cfg.store_capacity_blocks)
    pre = [_Prefill() for _ in range(cfg.prefill_workers)]
    dec = [_Decode() for _ in range(cfg.decode_workers)]
    n = len(requests)
    decode_of = [0] * n
    first_token = [math.nan] * n
    finish = [math.nan] * n
    hits = 0
    events: list[tuple[float, int, int, int, int]] = []  # (time, seq, kind, worker, request); seq breaks ties
    order = itertools.count()

    def push(t: float, kind: int, worker: int, idx: int) -> None:
        heapq.heappush(events, (t, next(order), kind, worker, idx))

    def prefill_view(i: int, now: float) -> WorkerView:
        w = pre[i]
        return WorkerView(f"prefill-{i}", max(w.busy_until - now, 0.0) + w.queued_estimate, len(w.queue),
                          int(w.busy), 0, 1, 1, model, w.busy_seconds + w.queued_estimate)

    def decode_view(i: int) -> WorkerView:
        w = dec[i]
        running = len(w.finishes)
        return WorkerView(f"decode-{i}", 0.0, 0, running + len(w.waiting) + w.assigned,
                          w.context + w.waiting_tokens + w.assigned_tokens,
                          cfg.max_running, cfg.kv_capacity_tokens, model)

    def pick_decode(route: RouteInfo) -> int:
        return int(policy.pick_decode([decode_view(i) for i in range(len(dec))], route).url.rsplit("-", 1)[1])

    def start_prefill(i: int, now: float) -> None:
        nonlocal hits
        w = pre[i]
        idx, estimate = w.queue.popleft()
        w.queued_estimate = w.queued_estimate - estimate if w.queue else 0.0  # no float drift below zero
        r = requests[idx]
        c = cached_tokens(store.cached_blocks(r.hash_ids, touch=True), r.input_length, cfg.block_tokens)
        hits += c
        seconds = model.prefill_seconds(r.input_length, c, cfg.max_chunk_tokens) + cfg.load_seconds_per_token * c
        w.busy, w.busy_until = True, now + seconds
        w.busy_seconds += seconds
        push(now + seconds, _PREFILL_DONE, i, idx)

    def start_step(i: int, now: float) -> None:
        w = dec[i]
        while w.waiting:  # FIFO admission, reserving each request's whole KV (no preemption modelled)
            r = requests[w.waiting[0]]
            need = r.input_length + r.output_length
            if w.finishes and (len(w.finishes) >= cfg.max_running or w.reserved + need > cfg.kv_capacity_tokens):
                break
            idx = w.waiting.popleft()
            w.waiting_tokens -= r.input_length + 1
            w.reserved += need
            w.context += r.input_length + 1  # the prompt plus the first token (from prefill)
            heapq.heappush(w.finishes, (w.steps + r.output_length - 1, idx))
        if not w.finishes:
            w.stepping = False
            return
        batch = len(w.finishes)
        seconds = decode_step_seconds(coef, batch, w.context)
        w.stepping = True
        w.busy_seconds += seconds
        w.request_seconds += seconds * batch
        push(now + seconds, _STEP_DONE, i, batch)

    for idx, r in enumerate(requests):
        push(r.arrival * time_scale, _ARRIVE, -1, idx)

    while events:
        now, _, kind, wi, idx = heapq.heappop(events)
        if kind == _ARRIVE:
            r = requests[idx]
            # a prefix queued or running on a worker counts as cached there (FIFO: it is written first), as
            # the router counts the prompts it has in prefill
            inflight = {f"prefill-{i}": cached_tokens(leading_run(r.hash_ids, w.inflight_blocks), r.input_length,
                                                      cfg.block_tokens) for i, w in enumerate(pre)}
            route = RouteInfo(r.input_length, cached_tokens(store.cached_blocks(r.hash_ids), r.input_length,
                                                            cfg.block_tokens), max(r.output_length, 1), inflight)
            views = [prefill_view(i, now) for i in range(len(pre))]
            chosen = policy.pick_prefill(views, route)
            p = int(chosen.url.rsplit("-", 1)[1])
            if cfg.decode_pick == "arrival":
                decode_of[idx] = pick_decode(route)
                dec[decode_of[idx]].assigned += 1
                dec[decode_of[idx]].assigned_tokens += r.input_length + 1
            estimate = model.prefill_seconds(r.input_length, route.cached_on(chosen), cfg.max_chunk_tokens)
            pre[p].inflight_blocks.update(r.hash_ids)
            pre[p].queue.append((idx, estimate))
            pre[p].queued_estimate += estimate
            if not pre[p].busy:
                start_prefill(p, now)
        elif kind == _PREFILL_DONE:
            r = requests[idx]
            store.write(r.hash_ids)
            pre[wi].inflight_blocks -= Counter(r.hash_ids)
            first_token[idx] = now
            pre[wi].busy = False
            if pre[wi].queue:
                start_prefill(wi, now)
            if cfg.decode_pick == "arrival":  # from assigned to waiting (or done) on its decode worker
                dec[decode_of[idx]].assigned -= 1
                dec[decode_of[idx]].assigned_tokens -= r.input_length + 1
            if r.output_length <= 1:
                finish[idx] = now
                continue
            if cfg.decode_pick == "prefill_done":
                decode_of[idx] = pick_decode(RouteInfo(r.input_length, 0, r.output_length))
            d = dec[decode_of[idx]]
            d.waiting.append(idx)
            d.waiting_tokens += r.input_length + 1
            if not d.stepping:
                start_step(decode_of[idx], now)
        else:  # a decode step ended: every running request gained a token
            w = dec[wi]
            w.steps += 1
            w.context += idx  # idx carries the step's batch size
            while w.finishes and w.finishes[0][0] <= w.steps:
                _, done = heapq.heappop(w.finishes)
                r = requests[done]
                finish[done] = now
                w.reserved -= r.input_length + r.output_length
                w.context -= r.input_length + r.output_length
            start_step(wi, now)

    arrivals = np.array([r.arrival * time_scale for r in requests])
    ft, fin = np.array(first_token), np.array(finish)
    outs = np.array([r.output_length for r in requests])
    multi = outs > 1
    return PolicyResult(policy_name, ft - arrivals, (fin[multi] - ft[multi]) / (outs[multi] - 1),
                        hits / sum(r.input_length for r in requests), [w.busy_seconds for w in pre],
                        [w.request_seconds for w in dec], int(outs.sum()), float(fin.max() - arrivals.min()))


COLUMNS = (("ttft_p50", "TTFT p50 s", "{:.2f}"), ("ttft_p90", "p90 s", "{:.2f}"), ("ttft_p99", "p99 s", "{:.2f}"),
           ("tpot_mean", "TPOT mean s", "{:.3f}"), ("tpot_p99", "TPOT p99 s", "{:.3f}"),
           ("hit_rate", "hit rate", "{:.1%}"), ("prefill_imbalance", "prefill imb.", "{:.2f}"),
           ("decode_imbalance", "decode imb.", "{:.2f}"), ("throughput_tok_s", "out tok/s", "{:.1f}"))


def format_table(results: Sequence[PolicyResult]) -> str:
    """Markdown table: one row per policy."""
    lines = ["| policy | " + " | ".join(h for _, h, _ in COLUMNS) + " |",
             "|---|" + "---:|" * len(COLUMNS)]
    for res in results:
        row = res.row()
        lines.append(f"| {res.policy} | " + " | ".join(fmt.format(row[k]) for k, _, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def run(cfg: SimConfig) -> tuple[str, list[PolicyResult]]:
    """Load, simulate every policy, and return (report text, results)."""
    path = resolve_trace(cfg.trace)
    if not path.is_file():
        raise FileNotFoundError(f"no trace at {path}; pass --trace FILE or set ${TRACE_ENV}")
    requests = load_trace(path, cfg.max_requests)
    model = CostModel(load_coefficients(cfg.coefficients))
    scale = cfg.time_scale if cfg.time_scale is not None else auto_time_scale(requests, cfg, model)
    results = [simulate(requests, p, cfg, model, scale) for p in cfg.policies]
    span = (requests[-1].arrival - requests[0].arrival) * scale
    head = (f"trace {path.name}: {len(requests)} requests over {span:.0f} s simulated (time scale {scale:.3g}"
            f"{'' if cfg.time_scale else f', prefill load {cfg.target_load:g}'}); "
            f"{cfg.prefill_workers} prefill + {cfg.decode_workers} decode workers (decode picked at "
            f"{cfg.decode_pick}); cost model "
            f"{dict(zip(TERMS, model.coef.tolist(), strict=True))}; ideal hit rate "
            f"{ideal_hit_rate(requests, cfg.block_tokens):.1%}")
    return head + "\n\n" + format_table(results), results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `deepinfer bench simulate` flags: one per SimConfig field."""
    from deepinfer.config import add_config_arguments

    add_config_arguments(parser, SimConfig)
