"""When each request of a closed batch finishes: fixed k = 5, the adaptive draft length without the
closed batch's weights, and with them (`FinishBalance`, what `LLM.generate` runs).

`spec.py` reads a closed batch's tokens per second: its tokens over its last request's finish. This
prints, per run, every engine's wall time and its requests' finish times (seconds from the call), and at
the end each engine's median wall time over the runs after each start's first (the first prefills the
prompts; later runs hit the prefix cache) and the ratios. The engine without the weights is the same
engine with `FinishBalance.weights` replaced by one that weighs nothing (a probe's shortcut). Usage::

    PYTHONPATH=. python3 benchmarks/spec_finish.py --workload code_edit --batch 8 --starts 3 --repeats 4
"""

from __future__ import annotations

import argparse
import statistics
import time

from spec import build_workloads

from deepinfer import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="code_edit", choices=["code_edit", "json", "chat"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    common = dict(kv_cache_memory="768MiB", max_num_seqs=args.batch)
    adaptive = {"method": "ngram", "num_speculative_tokens": 16, "adaptive": True}
    walls: dict[str, list[float]] = {}
    for start in range(args.starts):
        engines = {
            "k5": LLM(None, speculative_config={"method": "ngram", "num_speculative_tokens": 5, "adaptive": False},
                      **common),
            "unweighted": LLM(None, speculative_config=adaptive, **common),
            "weighted": LLM(None, speculative_config=adaptive, **common),
        }
        engines["unweighted"].engine.core.speculator.balance.weights = lambda requests, now: None
        prompts = build_workloads(engines["k5"], args.batch)[args.workload]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        for llm in engines.values():
            llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4))
        for rep in range(args.repeats):
            for name, llm in engines.items():
                stats = llm.engine.stats()
                began, clock = time.perf_counter(), time.monotonic()
                outs = llm.generate(prompts, params)
                wall = time.perf_counter() - began
                after = llm.engine.stats()
                drafted = after.get("spec_draft_tokens", 0) - stats.get("spec_draft_tokens", 0)
                kept = after.get("spec_accepted_tokens", 0) - stats.get("spec_accepted_tokens", 0)
                ends = sorted(o.metrics["now"] - clock for o in outs)
                print(f"start {start + 1} run {rep + 1} {name:10s} wall {wall:.3f} s, drafted {drafted}, kept {kept}; "
                      "finishes " + " ".join(f"{e:.2f}" for e in ends), flush=True)
                if rep:
                    walls.setdefault(name, []).append(wall)
        for llm in engines.values():
            llm.close()
    med = {name: statistics.median(w) for name, w in walls.items()}
    print(f"\n{args.workload} b={args.batch}, max_tokens {args.max_tokens}, {args.starts} starts x {args.repeats - 1} runs "
          "(each start's first left out): median wall " + ", ".join(f"{n} {m:.3f} s" for n, m in med.items()))
    print(f"throughput ratios (wall inverted): weighted / unweighted {med['unweighted'] / med['weighted']:.3f}, "
          f"weighted / k5 {med['k5'] / med['weighted']:.3f}, unweighted / k5 {med['k5'] / med['unweighted']:.3f}")


if __name__ == "__main__":
    main()
