"""The persistent KV store under an agentic multi-turn workload and a scaled Mooncake trace replay.

Two workloads, each run with the KV store off and on (a fresh temporary store directory, deleted at the
end), same engine settings otherwise: a device pool and a host tier that together hold less than the
workload's live context, so without the store a returning prefix has often been evicted and is
recomputed, with it the evicted blocks are loaded from the store. ``--configs`` may add
``store_on_sync``: the store with `kv_store_prefetch` off (store reads on the engine thread);
``store_on_always``: the store writing every computed block (`kv_store_admit="always"`; ``store_on`` runs
the default admission, ``reused``: a block is written at its second use).

(a) agentic, session-paced: ``--sessions`` sessions of ``--turns`` turns. Turn 1 = a system prompt shared
    by all sessions (``--system-len`` tokens) + a per-session task (``--task-len``); each later turn = the
    previous prompt + the previous turn's output + new tool output (``--tool-len`` random tokens, +-25%).
    A session's next turn arrives ``--gap-min``..``--gap-max`` s (uniform) after its previous turn finished;
    session starts are staggered by ``--stagger`` s. Arrival times therefore depend on the run (closed
    loop per session); the prompts' token ids do not, except for the model's own (greedy) outputs.
    ``--agentic-preset`` picks the defaults of those flags and of ``--host-blocks`` (any flag given
    overrides its preset value; see PRESETS): ``long`` (default) = long resent histories with short
    appends, as agent traffic is (a large system prompt with tool definitions, then tool outputs of about
    a hundred tokens; histories reach ~3.3k tokens) and a 160-block host tier; ``short`` = the first
    configuration (histories reach ~1k tokens, no host tier).
(b) mooncake: the Mooncake conversation trace, lengths divided by ``--scale`` (a 512-token hash block
    becomes 512/scale tokens, generated from random.Random(hash_id) so equal hash ids give equal
    prefixes), output lengths divided by ``--scale`` and capped at ``--trace-max-output``, prompts longer
    than the engine's context keep their leading part. Which requests (``--trace-sample``):
    ``conversations`` (default) = every request, up to minute ``--trace-minutes``, of a seeded
    ``--conv-fraction`` sample of the conversations (keyed by their first two hash ids) -- sampling whole
    conversations divides the rate while keeping their reuse; ``head`` = the first ``--trace-requests``
    requests (little reuse: the trace's first minutes are mostly first turns). Open loop: a request is
    added at timestamp * ``--time-scale`` (default 1/15 for conversations, 2 for head).

Requests are random token ids, greedy, ignore_eos. TTFT = first output token time - the time the request
was added (its arrival). Reported per workload and store setting: the ideal input hit rate (an infinite
prefix cache over the prompts actually sent, in arrival order: leading 16-token blocks already seen in an
earlier request's prompt, or, for (a), its prompt + output; capped like the engine at prompt_len - 1),
the measured hit rate (sum of ``num_cached_tokens`` / sum of prompt tokens) split by tier, mean / p50 /
p99 TTFT, output tokens/s, wall time; then store-on / store-off TTFT ratios and gaps to the ideal.

TTFT is also split per request into wait (arrival -> first scheduled: queueing, and with the prefetcher
the store read) and run (first scheduled -> first token: the steps that prefill its new tokens, other
requests' work in those steps, and a synchronous store load), by where its prefix came from.

Usage::

    HF_HUB_OFFLINE=1 python benchmarks/agentic.py --json benchmarks/results/agentic.json
    python benchmarks/agentic.py --workloads agentic --agentic-preset short   # the first configuration
    python benchmarks/agentic.py --quick          # smoke: a few sessions and trace requests, a 128-block pool
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hw_bounds  # noqa: E402 - a sibling module (the script's directory is on sys.path); it loads no torch
import torch  # noqa: E402

from deepinfer.bench.simulate import DEFAULT_TRACE, TRACE_ENV, resolve_trace  # noqa: E402
from deepinfer.config import EngineConfig  # noqa: E402
from deepinfer.engine.engine import LLMEngine  # noqa: E402
from deepinfer.engine.runner import resolve_dtype  # noqa: E402
from deepinfer.engine.sampling_params import SamplingParams  # noqa: E402

BLOCK = 16
VOCAB = 49152  # SmolLM2; token ids are drawn from [10, VOCAB)


@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    at: float = 0.0  # arrival, seconds after start
    session: int = -1
    turn: int = 0
    added: float | None = None
    first: float | None = None
    done: float | None = None
    output: list[int] = field(default_factory=list)
    cached: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)
    core: Any = None  # the engine's Request: when it was first scheduled
    scheduled: float | None = None


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def ideal_hits(reqs: list[Req], with_output: bool) -> int:
    """Prompt tokens an infinite prefix cache would serve, requests taken in arrival order."""
    seen: set[tuple[int, ...]] = set()
    hits = 0
    for r in sorted(reqs, key=lambda r: r.added or 0.0):
        cap = (len(r.prompt) - 1) // BLOCK
        n = 0
        while n < cap and tuple(r.prompt[:(n + 1) * BLOCK]) in seen:
            n += 1
        hits += n * BLOCK
        # KV exists for the prompt and every output token but the last
        seq = r.prompt + (r.output[:-1] if with_output else [])
        for b in range(1, len(seq) // BLOCK + 1):
            seen.add(tuple(seq[:b * BLOCK]))
    return hits


PRESETS = {"long": dict(sessions=10, turns=8, system_len=2048, task_len=256, tool_len=96, output_len=24, host_blocks=160),
           "short": dict(sessions=12, turns=5, system_len=256, task_len=96, tool_len=160, output_len=12, host_blocks=0)}
CONFIGS = ("store_off", "store_on", "store_on_sync", "store_on_always")


def block_token_bytes(dtype: str) -> int:
    """SmolLM2-135M KV bytes per token (layers x KV heads x head dim x (K, V)) in the dtype `dtype` resolves to."""
    return 30 * 3 * 64 * 2 * resolve_dtype(dtype, torch.device("cpu")).itemsize


def make_engine(args: argparse.Namespace, store: Path | None, prefetch: bool = True,
                admit: str = "auto") -> LLMEngine:
    block = BLOCK * block_token_bytes(args.dtype)
    host = args.host_cache_memory or str(args.host_blocks * block)
    kwargs = dict(model=args.model, dtype=args.dtype, kv_cache_memory=str(args.device_blocks * block),
                  host_cache_memory=host, kv_store=str(store) if store else "none",
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                  profile_cost_model=False, kv_store_prefetch=prefetch, kv_store_admit=admit)
    engine = LLMEngine(EngineConfig.from_kwargs(**kwargs))
    rng = random.Random(12345)  # warm-up: first-call kernel costs, no prefix shared with the workload
    warm = _tokens(rng, 40)
    engine.add_request(warm, SamplingParams(max_tokens=2, ignore_eos=True), request_id="warmup",
                       prompt_token_ids=warm)
    while engine.has_unfinished():
        engine.step()
    return engine


def _record(engine: LLMEngine, live: dict[str, Req]) -> list[Req]:
    """One engine step; returns the requests that finished."""
    outs = engine.step()
    t = time.monotonic()
    finished = []
    for out in outs:
        r = live.get(out.request_id)
        if r is None:
            continue
        if r.first is None and out.outputs[0].token_ids:
            r.first = t
            r.scheduled = r.core.first_scheduled_time
            r.cached = out.num_cached_tokens
            r.by_tier = dict(out.num_cached_tokens_by_tier)
        if out.finished:
            r.done = t
            r.output = list(out.outputs[0].token_ids)
            finished.append(live.pop(out.request_id))
    return finished


def _add(engine: LLMEngine, r: Req, live: dict[str, Req]) -> None:
    # (a)'s sessions are agent traffic and say so, as the README asks agents to (retention class "agent":
    # its blocks are stored at once under the default admission); the trace's requests keep the default
    engine.add_request(r.prompt, SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True),
                       request_id=r.rid, prompt_token_ids=r.prompt,
                       retention_class="agent" if r.session >= 0 else None)
    r.added = time.monotonic()
    r.core = engine.core.scheduler.requests[r.rid]
    live[r.rid] = r


def run_agentic(engine: LLMEngine, args: argparse.Namespace) -> tuple[list[Req], float]:
    rng = random.Random(args.seed)
    system = _tokens(rng, args.system_len)
    tasks = [_tokens(rng, args.task_len) for _ in range(args.sessions)]
    tools = [[_tokens(rng, max(1, round(args.tool_len * rng.uniform(0.75, 1.25)))) for _ in range(args.turns)]
             for _ in range(args.sessions)]
    gaps = [[rng.uniform(args.gap_min, args.gap_max) for _ in range(args.turns)] for _ in range(args.sessions)]
    # next arrival per session: (time, session, turn, prompt)
    pending = [(s * args.stagger, s, 0, system + tasks[s]) for s in range(args.sessions)]
    live: dict[str, Req] = {}
    done: list[Req] = []
    start = time.monotonic()
    while pending or live:
        now = time.monotonic() - start
        pending.sort(key=lambda p: p[0])
        while pending and pending[0][0] <= now:
            at, s, turn, prompt = pending.pop(0)
            r = Req(f"s{s}t{turn}", prompt, args.output_len, at, s, turn)
            _add(engine, r, live)
        if not live:
            time.sleep(max(0.0, pending[0][0] - (time.monotonic() - start)))
            continue
        for r in _record(engine, live):
            done.append(r)
            if r.turn + 1 < args.turns:
                s, nxt = r.session, r.turn + 1
                pending.append((r.done - start + gaps[s][nxt], s, nxt, r.prompt + r.output + tools[s][nxt]))
    return done, time.monotonic() - start


def load_trace(args: argparse.Namespace) -> list[Req]:
    per_hash = 512 // args.scale
    time_scale = args.time_scale if args.time_scale is not None else (2.0 if args.trace_sample == "head" else 1 / 15)
    with open(resolve_trace(args.trace)) as f:
        records = [json.loads(line) for line in f]
    if args.trace_sample == "head":
        records = records[:args.trace_requests]
    else:  # whole conversations (keyed by their first two hash ids), a seeded sample of them
        records = [r for r in records if r["timestamp"] < args.trace_minutes * 60_000]
        keys = sorted({tuple(r["hash_ids"][:2]) for r in records})
        rng = random.Random(args.seed)
        chosen = {k for k in keys if rng.random() < args.conv_fraction}
        records = [r for r in records if tuple(r["hash_ids"][:2]) in chosen]
    reqs = []
    for i, rec in enumerate(records):
        n = max(1, rec["input_length"] // args.scale)
        prompt: list[int] = []
        for h in rec["hash_ids"]:
            prompt += _tokens(random.Random(h), per_hash)
        prompt = prompt[:n]
        out = max(1, min(args.trace_max_output, rec["output_length"] // args.scale))
        reqs.append(Req(f"m{i}", prompt, out, rec["timestamp"] * time_scale / 1000))
    return reqs


def run_trace(engine: LLMEngine, args: argparse.Namespace) -> tuple[list[Req], float]:
    pending = load_trace(args)
    for r in pending:  # the few prompts longer than the (pool-limited) context keep their leading part
        r.prompt = r.prompt[:engine.max_model_len - r.max_tokens - 1]
    live: dict[str, Req] = {}
    done: list[Req] = []
    start = time.monotonic()
    while pending or live:
        now = time.monotonic() - start
        while pending and pending[0].at <= now:
            _add(engine, pending.pop(0), live)
        if not live:
            time.sleep(max(0.0, pending[0].at - (time.monotonic() - start)))
            continue
        done += _record(engine, live)
    return done, time.monotonic() - start


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def breakdown(reqs: list[Req]) -> dict[str, dict[str, float]]:
    """Mean TTFT, wait, run (ms), prefilled and cached tokens, by where the prefix came from: `tier` = partly
    loaded from the host tier or the store, `device` = all of it on the device, `miss` = nothing cached."""
    groups: dict[str, list[Req]] = {"tier": [], "device": [], "miss": []}
    for r in reqs:
        key = "tier" if r.by_tier.get("host", 0) + r.by_tier.get("store", 0) else "device" if r.cached else "miss"
        groups[key].append(r)
    out = {}
    for key, rs in groups.items():
        if rs:
            mean = statistics.fmean
            out[key] = {"n": len(rs), "ttft_ms": 1000 * mean(r.first - r.added for r in rs),
                        "wait_ms": 1000 * mean(r.scheduled - r.added for r in rs),
                        "run_ms": 1000 * mean(r.first - r.scheduled for r in rs),
                        "new_tokens": mean(len(r.prompt) - r.cached for r in rs), "cached_tokens": mean(r.cached for r in rs)}
    return out


def measure(workload: str, config: str, args: argparse.Namespace) -> dict[str, float]:
    store_on = config != "store_off"
    store = Path(tempfile.mkdtemp(prefix="agentic-kvstore-", dir=args.store_dir)) if store_on else None
    try:
        engine = make_engine(args, store, prefetch=config != "store_on_sync",
                             admit="always" if config == "store_on_always" else "auto")
        try:
            reqs, wall = (run_agentic if workload == "agentic" else run_trace)(engine, args)
            stats = engine.stats()
        finally:
            engine.close()
            del engine
            gc.collect()
    finally:
        if store is not None:
            shutil.rmtree(store, ignore_errors=True)
    prompt_tokens = sum(len(r.prompt) for r in reqs)
    ttft = [r.first - r.added for r in reqs]
    tiers = {t: sum(r.by_tier.get(t, 0) for r in reqs) for t in ("device", "host", "store")}
    res = {
        "requests": len(reqs), "prompt_tokens": prompt_tokens,
        "ideal_hit_pct": 100 * ideal_hits(reqs, workload == "agentic") / prompt_tokens,
        "hit_pct": 100 * sum(r.cached for r in reqs) / prompt_tokens,
        **{f"hit_{t}_pct": 100 * n / prompt_tokens for t, n in tiers.items()},
        "ttft_mean_ms": 1000 * statistics.fmean(ttft), "ttft_p50_ms": 1000 * _pct(ttft, 50), "ttft_p99_ms": 1000 * _pct(ttft, 99),
        "output_tok_per_s": sum(len(r.output) for r in reqs) / wall,
        "prefill_tok_per_s": (prompt_tokens - sum(r.cached for r in reqs)) / wall,
        "wall_s": wall, "preemptions": stats["num_preemptions"], "store_written_blocks": stats.get("kv_store_written_blocks", 0),
        "tier_stats": {k: v for k, v in stats.items() if k.startswith("kv_") and isinstance(v, int | float)},
        "breakdown": breakdown(reqs)}
    slow = sorted(reqs, key=lambda r: r.added - r.first)[:3]
    res["slowest"] = [(r.rid, len(r.prompt), r.cached, round(1000 * (r.first - r.added))) for r in slow]
    print(f"  {workload} {config}: {res['requests']} req, hit {res['hit_pct']:.1f}% "
          f"(ideal {res['ideal_hit_pct']:.1f}%), TTFT mean {res['ttft_mean_ms']:.0f} ms, wall {wall:.1f} s; "
          f"slowest (id, prompt, cached, TTFT ms): {res['slowest']}", flush=True)
    for key, b in res["breakdown"].items():
        print(f"    {key:6s} n={b['n']:3d}  TTFT {b['ttft_ms']:6.0f} ms = wait {b['wait_ms']:6.0f} + run "
              f"{b['run_ms']:6.0f}; prefilled {b['new_tokens']:5.0f} tokens, cached {b['cached_tokens']:5.0f}")
    if (ts := res["tier_stats"]).get("kv_prefetch_requests"):
        print(f"    prefetch: {ts['kv_prefetch_requests']:.0f} requests, {ts['kv_prefetch_store_blocks']:.0f} store "
              f"blocks, read {1000 * ts['kv_prefetch_read_seconds'] / ts['kv_prefetch_requests']:.1f} ms each")
    return res


ROWS = [(label, key, "{:.1f}" if key.endswith("pct") or key in ("output_tok_per_s", "wall_s") else "{:.0f}")
        for label, key in [
            ("requests", "requests"), ("prompt tokens", "prompt_tokens"),
            ("ideal hit % (infinite cache)", "ideal_hit_pct"), ("measured hit %", "hit_pct"),
            ("  from device %", "hit_device_pct"), ("  from host %", "hit_host_pct"),
            ("  from store %", "hit_store_pct"), ("TTFT mean (ms)", "ttft_mean_ms"), ("TTFT p50 (ms)", "ttft_p50_ms"),
            ("TTFT p99 (ms)", "ttft_p99_ms"), ("output tokens/s", "output_tok_per_s"),
            ("prefilled tokens/s", "prefill_tok_per_s"), ("wall (s)", "wall_s"), ("preemptions", "preemptions"),
            ("store blocks written", "store_written_blocks")]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the built-in SmolLM2 GGUF)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device-blocks", type=int, default=320, help="device KV pool in 16-token blocks")
    p.add_argument("--host-blocks", type=int, default=None, help="host tier in blocks (default: the preset's)")
    p.add_argument("--host-cache-memory", default=None, help="host tier in bytes; overrides --host-blocks")
    p.add_argument("--store-dir", default=None, help="parent of the temporary store directory (default: $TMPDIR)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--workloads", default="agentic,mooncake")
    p.add_argument("--configs", default="store_off,store_on",
                   help=f"comma-separated, of {', '.join(CONFIGS)} (the first two are compared)")
    p.add_argument("--agentic-preset", choices=sorted(PRESETS), default="long",
                   help="defaults of the (a) workload flags left unset and of --host-blocks")
    p.add_argument("--seed", type=int, default=0)
    for name in ("sessions", "turns", "system_len", "task_len", "tool_len", "output_len"):  # (a), see PRESETS
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    p.add_argument("--gap-min", type=float, default=2.0)
    p.add_argument("--gap-max", type=float, default=5.0)
    p.add_argument("--stagger", type=float, default=0.5)
    p.add_argument("--trace", default=None,
                   help=f"(b) the Mooncake trace jsonl (default: ${TRACE_ENV} if set, else the shared trace "
                        f"{DEFAULT_TRACE}, relative to the working directory: a checkout's root)")
    p.add_argument("--trace-requests", type=int, default=120)
    p.add_argument("--scale", type=int, default=16, help="(b) lengths divided by this (must divide 512)")
    p.add_argument("--time-scale", type=float, default=None,
                   help="(b) arrival times multiplied by this (default: 2 for head, 1/15 for conversations)")
    p.add_argument("--trace-sample", choices=["conversations", "head"], default="conversations",
                   help="(b) head: the first --trace-requests requests; conversations: every request of a "
                        "--conv-fraction sample of the conversations starting in the first --trace-minutes")
    p.add_argument("--conv-fraction", type=float, default=0.04)
    p.add_argument("--trace-minutes", type=float, default=20.0)
    p.add_argument("--trace-max-output", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="smoke run: 4 sessions x 3 turns, 20 trace requests")
    p.add_argument("--json", default=None, help="also write the results to this file")
    hw_bounds.add_flag(p)
    args = p.parse_args()
    for name, value in PRESETS[args.agentic_preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    configs = args.configs.split(",")
    if any(c not in CONFIGS for c in configs) or configs[:2] != ["store_off", "store_on"]:
        p.error(f"--configs must start with store_off,store_on; known: {', '.join(CONFIGS)}")
    if args.quick:
        args.sessions, args.turns, args.trace_requests, args.gap_min, args.gap_max = 4, 3, 20, 0.5, 1.0
        args.device_blocks, args.system_len, args.task_len = 128, min(args.system_len, 256), min(args.task_len, 96)
    if 512 % args.scale:
        p.error("--scale must divide 512")

    bounds = hw_bounds.RunBounds(args.model) if args.bounds else None  # before the engines, and again after
    results: dict[str, dict[str, dict[str, float]]] = {}
    for workload in args.workloads.split(","):
        results[workload] = {cfg: measure(workload, cfg, args) for cfg in configs}
        if args.json:  # after each workload, so an interrupted run keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "results": results}, f, indent=2)
    if args.json:
        from deepinfer.bench.plots import plot_after_run

        plot_after_run(args.json)  # hit rate by tier, TTFT and tok/s per configuration, next to the JSON
    if bounds is not None:
        bounds.remeasure()
        print(f"\n{bounds.describe()}")
    sample = (f"first {args.trace_requests} requests" if args.trace_sample == "head" else
              f"{args.conv_fraction:g} of the conversations of the first {args.trace_minutes:g} min")
    time_scale = args.time_scale if args.time_scale is not None else (2.0 if args.trace_sample == "head" else 1 / 15)
    print(f"\ndevice pool {args.device_blocks} blocks ({args.device_blocks * BLOCK} tokens), host tier "
          f"{args.host_cache_memory or f'{args.host_blocks} blocks'}; KV {block_token_bytes(args.dtype)} B/token; agentic ({args.agentic_preset}): {args.sessions} sessions x {args.turns} "
          f"turns, system {args.system_len} + task {args.task_len}, tool {args.tool_len} +-25%, output "
          f"{args.output_len}, gaps {args.gap_min:g}-{args.gap_max:g} s; mooncake: {sample}, lengths / "
          f"{args.scale}, arrival times x {time_scale:.3g}")
    for workload, res in results.items():
        off, on = res["store_off"], res["store_on"]
        print(f"\n{workload:30s}" + "".join(f"{c:>14s}" for c in res) + f"{'on/off':>8s}")
        for label, key, fmt in ROWS:
            ratio = on[key] / off[key] if off[key] else float("nan")
            print(f"{label:30s}" + "".join(f"{fmt.format(r[key]):>14s}" for r in res.values()) + f"{ratio:8.2f}")
        print(f"{'gap to ideal (points)':30s}" + "".join(f"{r['ideal_hit_pct'] - r['hit_pct']:14.1f}" for r in res.values()))
        if bounds is not None:  # the tokens computed (prompt tokens not served from a cache, and outputs)
            dtype = None if args.dtype == "auto" else args.dtype
            print(f"{'computed tok/s, of bound':30s}" + "".join(
                f"{bounds.of(r['prefill_tok_per_s'] + r['output_tok_per_s'], False, dtype):>14s}" for r in res.values()))
        for cfg, r in res.items():
            if cfg != "store_off":
                print(f"TTFT off/{cfg} (x better): mean {off['ttft_mean_ms'] / r['ttft_mean_ms']:.2f}, p50 "
                      f"{off['ttft_p50_ms'] / r['ttft_p50_ms']:.2f}, p99 {off['ttft_p99_ms'] / r['ttft_p99_ms']:.2f}")


if __name__ == "__main__":
    main()
