"""Closed batch under different prefill policies / step-time budgets, side by side in one run.

N prompts of P random tokens, each generating T tokens (greedy, ignore_eos), all submitted at
once to the offline engine; prints wall time and output tokens/s per configuration and the
ratio to `--scheduler tokens`. Shows what the compute policy's step-time budget costs in
throughput when every step is full.

    HF_HUB_OFFLINE=1 python benchmarks/budget_sweep.py --budgets 75,auto
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hw_bounds  # noqa: E402 - a sibling module (the script's directory is on sys.path); it loads no torch

from deepinfer import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=158)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--budgets", default="75,auto", help="comma list of ms values or 'auto' for --scheduler compute")
    hw_bounds.add_flag(ap)
    args = ap.parse_args()
    bounds = hw_bounds.RunBounds(args.model) if args.bounds else None  # before the engines, and again after
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 40000) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    configs = [("compute", None if b == "auto" else float(b)) for b in args.budgets.split(",")] + [("tokens", None)]
    rows = []
    for sched, budget in configs:
        llm = LLM(args.model, scheduler=sched, max_num_seqs=max(args.num_prompts, 1), step_time_budget_ms=budget)
        llm.generate(prompts[:2], SamplingParams(max_tokens=2))
        steps0 = llm.engine.core.num_steps
        started = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True))
        wall = time.perf_counter() - started
        used = llm.engine.core.scheduler.step_time_budget
        rows.append((sched, budget, used, wall, args.num_prompts * args.max_tokens / wall,
                     llm.engine.core.num_steps - steps0))
        del llm
        gc.collect()
    base = rows[-1][4]
    if bounds is not None:
        bounds.remeasure()
        print(bounds.describe())
    print(f"{'policy':8s} {'budget ms':>10s} {'wall s':>7s} {'out tok/s':>9s} {'of bound':>9s} {'steps':>6s} "
          f"{'vs tokens':>9s}")
    for sched, budget, used, wall, tps, steps in rows:
        label = "-" if sched == "tokens" else f"{1000 * used:.0f}" + ("" if budget is not None else " (auto)")
        frac = bounds.of(tps, False) if bounds is not None else "-"
        print(f"{sched:8s} {label:>10s} {wall:7.2f} {tps:9.1f} {frac:>9s} {steps:6d} {tps / base:8.2f}x")


if __name__ == "__main__":
    main()
