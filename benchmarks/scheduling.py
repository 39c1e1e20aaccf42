"""Scheduling under a mixed workload: ``--scheduler tokens`` vs ``--scheduler compute``, same arrivals.

Workload (open loop: arrival times are fixed in wall-clock seconds from the start, the same for both
policies; random token ids, distinct per request so there are no prefix-cache hits; greedy, ignore_eos):

* ``--streams`` steady decode streams: short prompts at t=0, each generating ``--stream-tokens`` tokens;
* ``--bursts`` bursts, every ``--burst-interval`` s from ``--first-burst`` s: ``--long-per-burst`` long
  prompts of ``--long-len`` tokens, then ``--short-per-burst`` short prompts of ``--short-len`` tokens
  arriving ``--short-delay`` s later, behind the long ones. Burst prompts generate ``--burst-tokens``.

The offline engine (``LLMEngine.step`` in a loop) timestamps every token. Reported per policy:
inter-token latency p50/p99 (gaps between consecutive tokens of a request), TTFT p50/p99 of the short
and of the long burst prompts, throughput, and the cost model's step-time prediction error (median
|predicted - measured| / measured over the run's steps, each predicted before it joined the fit);
then compute / tokens ratios. Both engines are built the same way (start-up profile included).

Usage::

    HF_HUB_OFFLINE=1 python benchmarks/scheduling.py                 # default model, default sizes
    python benchmarks/scheduling.py --streams 2 --stream-tokens 8 --bursts 1 --long-len 256   # smoke
    python benchmarks/scheduling.py --runs compute@inf,compute --short-delay 0   # the first-token stretch
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from deepinfer.config import EngineConfig  # noqa: E402
from deepinfer.engine.engine import LLMEngine  # noqa: E402
from deepinfer.engine.sampling_params import SamplingParams  # noqa: E402


@dataclass
class Arrival:
    rid: str
    kind: str  # stream | long | short
    at: float  # seconds after start
    prompt: list[int]
    max_tokens: int
    added: float | None = None
    token_times: list[float] = field(default_factory=list)


def make_workload(args: argparse.Namespace, vocab: int) -> list[Arrival]:
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    work = [Arrival(f"stream{i}", "stream", 0.0, prompt(args.stream_len), args.stream_tokens)
            for i in range(args.streams)]
    for b in range(args.bursts):
        t = args.first_burst + b * args.burst_interval
        work += [Arrival(f"long{b}.{i}", "long", t, prompt(args.long_len), args.burst_tokens)
                 for i in range(args.long_per_burst)]
        work += [Arrival(f"short{b}.{i}", "short", t + args.short_delay, prompt(args.short_len), args.burst_tokens)
                 for i in range(args.short_per_burst)]
    return sorted(work, key=lambda a: a.at)


def run(policy: str, args: argparse.Namespace) -> dict[str, float]:
    """`policy`: tokens, compute, or compute@X (compute with --first-token-stretch X)."""
    scheduler, _, stretch = policy.partition("@")
    kwargs = dict(model=args.model, scheduler=scheduler, max_num_batched_tokens=args.max_num_batched_tokens,
                  max_num_seqs=args.max_num_seqs, kv_cache_memory=args.kv_cache_memory, dtype=args.dtype,
                  enable_prefix_caching=False)
    if stretch:
        kwargs["first_token_stretch"] = float(stretch)
    if args.step_time_budget_ms is not None:
        kwargs["step_time_budget_ms"] = args.step_time_budget_ms
    engine = LLMEngine(EngineConfig.from_kwargs(**kwargs))
    work = make_workload(args, engine.vocab_size)
    by_id = {a.rid: a for a in work}
    # warm-up outside the measurement: first-call costs of the kernels
    engine.add_request([11, 12, 13], SamplingParams(max_tokens=2, ignore_eos=True), request_id="warmup")
    while engine.has_unfinished():
        engine.step()
    cm = engine.core.cost_model
    seen_obs, errors, steps = cm.num_observations, [], 0
    pending = list(work)
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0].at <= now:
            a = pending.pop(0)
            engine.add_request(a.prompt, SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True),
                               request_id=a.rid, prompt_token_ids=a.prompt)
            a.added = time.perf_counter()
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0].at - (time.perf_counter() - start)))
            continue
        outs = engine.step()
        t = time.perf_counter()
        steps += 1
        if cm.num_observations > seen_obs:
            seen_obs = cm.num_observations
            errors.append(abs(cm.last_error))
        for out in outs:
            a = by_id[out.request_id]
            new = len(out.outputs[0].token_ids) - len(a.token_times)
            a.token_times.extend([t] * new)
    wall = time.perf_counter() - start
    stats = engine.stats()
    del engine
    gc.collect()

    def pct(xs: list[float], q: float) -> float:
        if not xs:
            return float("nan")
        xs = sorted(xs)
        return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]

    itl = [b - a for w in work for a, b in zip(w.token_times, w.token_times[1:], strict=False)]
    ttft = {k: [w.token_times[0] - w.added for w in work if w.kind == k and w.token_times] for k in ("short", "long")}
    generated = sum(len(w.token_times) for w in work)
    return {
        "itl_p50_ms": 1000 * pct(itl, 50), "itl_p99_ms": 1000 * pct(itl, 99),
        "ttft_short_p50_ms": 1000 * pct(ttft["short"], 50), "ttft_short_p99_ms": 1000 * pct(ttft["short"], 99),
        "ttft_long_p50_ms": 1000 * pct(ttft["long"], 50), "ttft_long_p99_ms": 1000 * pct(ttft["long"], 99),
        "output_tok_per_s": generated / wall,
        "total_tok_per_s": (generated + sum(len(w.prompt) for w in work)) / wall,
        "wall_s": wall, "steps": steps,
        "step_pred_err_median": statistics.median(errors) if errors else float("nan"),
        "step_budget_ms": 1000 * stats["step_time_budget_seconds"],
    }


ROWS = [
    ("ITL p50 (ms)", "itl_p50_ms"), ("ITL p99 (ms)", "itl_p99_ms"),
    ("TTFT short p50 (ms)", "ttft_short_p50_ms"), ("TTFT short p99 (ms)", "ttft_short_p99_ms"),
    ("TTFT long p50 (ms)", "ttft_long_p50_ms"), ("TTFT long p99 (ms)", "ttft_long_p99_ms"),
    ("output tokens/s", "output_tok_per_s"), ("total tokens/s", "total_tok_per_s"),
    ("wall (s)", "wall_s"), ("steps", "steps"),
    ("step-time pred. error (median)", "step_pred_err_median"), ("step time budget (ms)", "step_budget_ms"),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the built-in SmolLM2 GGUF)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--step-time-budget-ms", type=float, default=None, help="compute policy budget (default: auto)")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-len", type=int, default=32)
    p.add_argument("--stream-tokens", type=int, default=160)
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--first-burst", type=float, default=1.0)
    p.add_argument("--burst-interval", type=float, default=5.0)
    p.add_argument("--long-per-burst", type=int, default=2)
    p.add_argument("--long-len", type=int, default=1500)
    p.add_argument("--short-per-burst", type=int, default=4)
    p.add_argument("--short-len", type=int, default=48)
    p.add_argument("--short-delay", type=float, default=0.2)
    p.add_argument("--burst-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", default="tokens,compute",
                   help="Runs, the first one the reference of the ratios: tokens, compute, or compute@X "
                        "(--first-token-stretch X, e.g. compute@inf for the step-time budget alone).")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args()

    names = args.runs.split(",")
    results = {name: run(name, args) for name in names}
    ref = results[names[0]]
    print(f"\n{'metric':32s} " + " ".join(f"{n:>14s}" for n in names) + " " +
          " ".join(f"{n + '/' + names[0]:>22s}" for n in names[1:]))
    for label, key in ROWS:
        ratios = [results[n][key] / ref[key] if ref[key] else float("nan") for n in names[1:]]
        print(f"{label:32s} " + " ".join(f"{results[n][key]:14.3f}" for n in names) + " " +
              " ".join(f"{r:22.2f}" for r in ratios))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
