"""Draft-length policies compared without timing noise: each decode-phase step priced by a fixed table of
measured step costs by row count, summed over a run (batch 1, `spec.py`'s prompts, greedy).

On a shared 2-core machine the CPU time of one `spec.py` row moved +-10% between repeats (engines that
verified no drafts at all measured 0.93-1.13x of no speculation), which hides policy changes of a few
percent. Here the engines run for real (proposals, acceptance, the policy's choices) but their cost is
the sum over decode steps of T(rows), T from `spec_rows.py --num-threads 1`'s CPU column (default: the
AVX2 / float32 machine of session 16, ms): a policy that picks better row counts scores better whatever
the machine's load. Prefill and host time are left out (the same for every engine).

    OMP_NUM_THREADS=1 PYTHONPATH=. python3 benchmarks/spec_modeled.py --workload code_edit --ks 3 5

`--fixed-price` also prices the adaptive engine's choices by the table (no live measurements): the score
of the policy alone, free of the live table's noise (whose row costs move with the machine's load).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))  # spec.py's prompts and timing

import spec  # noqa: E402

from deepinfer import LLM  # noqa: E402
from deepinfer.engine.spec import speculator  # noqa: E402

# spec_rows.py --num-threads 1, CPU ms by rows 1..17 (session 16, AVX2 + FMA, float32, one thread)
AVX2_FP32_MS = [17.10, 20.95, 24.98, 28.10, 33.93, 38.80, 45.19, 50.99, 98.42, 98.47, 102.21, 107.32, 107.78,
                114.45, 114.52, 122.50, 185.40]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="code_edit", choices=["code_edit", "json", "chat"])
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 5], help="fixed draft lengths to compare")
    ap.add_argument("--k-max", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--table-ms", type=float, nargs="+", default=AVX2_FP32_MS, help="T(1), T(2), ... in ms")
    ap.add_argument("--fixed-price", action="store_true",
                    help="the adaptive engine prices verification by the same table (seeded, never updated, no "
                         "host time) instead of its live measurements: scores the policy alone")
    args = ap.parse_args()
    table = args.table_ms
    rows_seen: list[int] = []
    observe = speculator.Speculator.observe_step

    def logged(self, num_rows: int, *a, **kw) -> None:
        rows_seen.append(num_rows)
        observe(self, num_rows, *a, **kw)

    speculator.Speculator.observe_step = logged  # type: ignore[method-assign]
    in_call_done = speculator.Speculator.in_call_done

    def logged_calls(self, verdicts, steps) -> None:
        # a speculating C call's steps (batch 1 runs in them since session 31) never reach observe_step
        rows_seen.extend(rows for rows, _ in steps)
        in_call_done(self, verdicts, steps)

    speculator.Speculator.in_call_done = logged_calls  # type: ignore[method-assign]
    configs = {**{f"k={k}": {"method": "ngram", "num_speculative_tokens": k, "adaptive": False} for k in args.ks},
               "adaptive": {"method": "ngram", "num_speculative_tokens": args.k_max, "adaptive": True}}
    none_ms = none_tokens = 0.0
    results = {}
    for name, cfg in configs.items():
        llm = LLM(None, speculative_config=cfg, kv_cache_memory="256MiB", max_num_seqs=32, num_threads=1)
        if args.fixed_price and cfg["adaptive"]:
            _fix_price(llm.engine.core.scheduler.speculator.policy.price, table)
        spec.run_once(llm, ["Hello"], 4)
        ms = tokens = 0.0
        for i in range(4):
            rows_seen.clear()
            prompt = [spec.build_workloads(llm, 4)[args.workload][i]]
            *_, outs = spec.run_once(llm, prompt, args.max_tokens)
            n = len(outs[0])
            tokens += n
            ms += sum(table[min(r, len(table)) - 1] for r in rows_seen)
            if not results:  # no speculation: one row per token after the prefill's
                none_ms += (n - 1) * table[0]
                none_tokens += n
        results[name] = ms / tokens
        llm.close()
    base = none_ms / none_tokens
    print(f"{args.workload} b=1, modeled ms per token: none {base:.2f}  "
          + "  ".join(f"{name} {v:.2f} ({base / v:.2f}x)" for name, v in results.items()))


def _fix_price(price, table: list[float]) -> None:
    """Replace a StepPrice's profile by `table` (extended past its end by its last row's cost) and stop it
    learning: no measured steps, no host time."""
    price._samples.clear()
    price._profile.clear()
    price.seed([(r, (table[min(r, len(table)) - 1]) / 1e3) for r in range(1, 4 * len(table)) for _ in range(5)])
    price.observe = lambda *a, **kw: None
    price.observe_host = lambda *a, **kw: None
    price.host_seconds = price.draft_host_seconds = 0.0


if __name__ == "__main__":
    main()
