"""Engines that stop drafting: start the adaptive engine several times and watch what each start's
speculator has learnt after every run of one workload (its calibration factor, pooled keep rates, step
prices, and whether any step past the C decode path has been served).

An adaptive engine learns only from what it verifies: one whose first run left it pessimistic (a low
calibration or pooled rate), or whose start-up profile priced the steps past the C path far too high,
may choose no drafts for every later run. `--profile-factor F` replays the second case: each start's
profiled seconds past the C path are multiplied by F before its first run (a slow spell during the
profile). A start counts as stopped when a run after its first drafts fewer tokens than 5% of the tokens
the run generates (code edits draft 40-70% of them at batch 8; a workload that rarely repeats itself,
chat, stays under it anyway). Usage::

    PYTHONPATH=. python3 benchmarks/spec_stuck.py --starts 8 --runs 3
    PYTHONPATH=. python3 benchmarks/spec_stuck.py --starts 2 --runs 3 --profile-factor 2.0
"""

from __future__ import annotations

import argparse
import time

from spec import build_workloads

from deepinfer import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="code_edit", choices=["code_edit", "json", "chat"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--starts", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile-factor", type=float, default=1.0,
                    help="multiply each start's profiled seconds past the C decode path by this (1: as measured)")
    args = ap.parse_args()
    config = {"method": "ngram", "num_speculative_tokens": 16, "adaptive": True}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    stopped: list[int] = []
    for start in range(args.starts):
        llm = LLM(None, speculative_config=config, kv_cache_memory="768MiB", max_num_seqs=args.batch)
        spec = llm.engine.core.speculator
        price = spec.policy.price
        if args.profile_factor != 1.0:
            for rows, seconds in price._profile.items():
                if rows > price.c_path_rows:
                    price._profile[rows] = [s * args.profile_factor for s in seconds]
            price._table = None
        prompts = build_workloads(llm, args.batch)[args.workload]
        llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4))
        for run in range(args.runs):
            before = llm.engine.stats()
            began = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - began
            after = llm.engine.stats()
            drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
            kept = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            generated = sum(len(o.outputs[0].token_ids) for o in outs)
            if run and drafted < 0.05 * generated and start + 1 not in stopped:
                stopped.append(start + 1)
            served = sorted(r for r in price._samples if r > price.c_path_rows)
            print(f"start {start + 1} run {run + 1}: wall {wall:.2f} s, drafted {drafted}, kept {kept}; calibration "
                  f"{spec.calibration.factor:.2f}, pooled rates {[round(r, 2) for r in spec.pool.rates[:3]]}; "
                  f"T(8) {price.seconds(8) * 1e3:.1f} T(9) {price.seconds(9) * 1e3:.1f} "
                  f"T(16) {price.seconds(16) * 1e3:.1f} ms; served past the C path: {len(served)} counts", flush=True)
        llm.close()
    print(f"\n{args.workload} b={args.batch}, profile factor {args.profile_factor}: {len(stopped)} of {args.starts} "
          "starts stopped drafting in a run after their first (drafted under 5% of the tokens generated)"
          + (f": starts {stopped}" if stopped else ""))


if __name__ == "__main__":
    main()
