"""Host work overlapped with the model thread vs strict step-by-step, side by side in one run.

Both engines are built from one config that differs only in `overlap_host_work`; each runs the
same workloads (greedy, ignore_eos, distinct random prompts) and reports generated tokens/s and the
model thread's idle gap between consecutive steps (mean and total, from `EngineCore`), then the
on/off ratios. Workloads: `batch` = `--num-prompts` prompts x `--max-tokens`, `single` = one prompt.

    HF_HUB_OFFLINE=1 python benchmarks/overlap.py --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hw_bounds  # noqa: E402 - a sibling module (the script's directory is on sys.path); it loads no torch

from deepinfer import LLM, SamplingParams  # noqa: E402


def run_once(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    core = llm.engine.core
    gaps0, n0 = core.idle_gap_seconds, core.num_idle_gaps
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    gaps = core.num_idle_gaps - n0
    return {"tok_s": tokens / wall, "gap_ms": 1000 * (core.idle_gap_seconds - gaps0) / max(gaps, 1),
            "gap_total_s": core.idle_gap_seconds - gaps0, "steps": gaps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in GGUF")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    hw_bounds.add_flag(ap)
    args = ap.parse_args()
    bounds = hw_bounds.RunBounds(args.model) if args.bounds else None  # before the engines, and again after
    dtype = None if args.dtype == "auto" else args.dtype

    rng = random.Random(0)
    workloads = {
        "batch": ([[rng.randrange(10, 40000) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)],
                  args.max_tokens),
        "single": ([[rng.randrange(10, 40000) for _ in range(args.prompt_len)]], args.max_tokens * 2),
    }
    results: dict[tuple[str, bool], list[dict[str, float]]] = {}
    for overlap in (False, True):
        llm = LLM(args.model, dtype=args.dtype, overlap_host_work="on" if overlap else "off", max_num_seqs=256)
        for name, (prompts, max_tokens) in workloads.items():
            run_once(llm, prompts[:2], 4)  # warm-up
            results[(name, overlap)] = [run_once(llm, prompts, max_tokens) for _ in range(args.repeats)]
        del llm
        gc.collect()

    if bounds is not None:
        bounds.remeasure()
        print(bounds.describe())
    print(f"{'workload':8s} {'overlap':>7s} {'tok/s':>8s} {'of bound':>9s} {'idle gap ms/step':>16s} {'steps':>6s}")
    for name in workloads:
        row = {}
        for overlap in (False, True):
            runs = results[(name, overlap)]
            tok = statistics.median(r["tok_s"] for r in runs)
            gap = statistics.median(r["gap_ms"] for r in runs)
            row[overlap] = (tok, gap)
            frac = bounds.of(tok, name == "single", dtype) if bounds is not None else "-"
            print(f"{name:8s} {str(overlap):>7s} {tok:8.1f} {frac:>9s} {gap:16.2f} {int(runs[0]['steps']):6d}")
        print(f"{name:8s} {'on/off':>7s} {row[True][0] / row[False][0]:7.2f}x "
              f"{row[True][1] / max(row[False][1], 1e-9):15.2f}x")
    print("load average at end:", os.getloadavg())


if __name__ == "__main__":
    main()
