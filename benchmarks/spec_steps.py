"""Speculation's overhead where it drafts little: no speculation vs a speculative config on one workload of
`spec.py`, many interleaved repeats, with each run's model time, host time between steps and the model
time of every step shape.

`spec.py`'s table takes medians of a few repeats; on a 2-core machine one run of the same engine moves by
+-10% from the next, so a row whose adaptive engine verified no drafts at all (json b=8 at 0.87x in session
16) needs more repeats than that table can afford to tell a cost of the speculator from noise. Here two
engines alternate for `--repeats` runs (ABBA order) and the summary prints the median of each engine's
tok/s (the first, cold pair left out), the median of the pairwise ratios, and per step shape (D<rows> a
decode-phase step, P<tokens> a step with a prefill chunk) the median model-runner time, so a slower step
kind or more host time per step shows up on its own.

    HF_HUB_OFFLINE=1 python benchmarks/spec_steps.py --workload json --batch 8 --repeats 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hw_bounds  # noqa: E402
from spec import build_workloads, run_once  # noqa: E402

from deepinfer import LLM  # noqa: E402
from deepinfer.engine import core as engine_core  # noqa: E402


def record_steps(log: list) -> None:
    """Wrap `EngineCore._apply` (every finished step passes through it) to append (shape, model seconds,
    run start, run end) of each step to `log`."""
    apply = engine_core.EngineCore._apply

    def recording(self, inflight):
        out = apply(self, inflight)
        result, plan = inflight.future.result(), inflight.plan
        prefill = any(i.num_new_tokens > 1 and not i.draft_token_ids for i in plan.scheduled)
        log.append((("P" if prefill else "D") + str(plan.num_tokens), result.seconds, result.run_started,
                    result.run_ended))
        return out

    engine_core.EngineCore._apply = recording


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="json", choices=["code_edit", "json", "chat"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 16, '
                    '"adaptive": true}', help="the second engine's (the first runs without speculation)")
    hw_bounds.add_flag(ap)
    args = ap.parse_args()
    bounds = hw_bounds.RunBounds() if args.bounds else None  # before the engines, and again after

    log: list = []
    record_steps(log)
    common = dict(kv_cache_memory="768MiB", max_num_seqs=max(args.batch, 8))
    engines = {"none": LLM(None, **common),
               "spec": LLM(None, speculative_config=json.loads(args.speculative_config), **common)}
    for llm in engines.values():
        run_once(llm, ["Hello"], 4)
    prompts = build_workloads(engines["none"], args.batch)[args.workload]
    rates: dict[str, list[float]] = defaultdict(list)
    runs: dict[str, list[tuple[float, float]]] = defaultdict(list)  # (model s, host s between steps)
    shapes: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rep in range(args.repeats):
        for name in (["none", "spec"] if rep % 2 == 0 else ["spec", "none"]):
            log.clear()
            rate, *_ = run_once(engines[name], prompts, args.max_tokens)
            model = sum(s[1] for s in log)
            host = sum(b[2] - a[3] for a, b in zip(log, log[1:], strict=False))
            print(f"{name:5s} {rate:7.1f} tok/s  model {model * 1e3:6.0f} ms  between steps {host * 1e3:5.0f} ms  "
                  f"steps {len(log)}", flush=True)
            if rep:  # the first pair is cold (allocations, first grammar, caches)
                rates[name].append(rate)
                runs[name].append((model, host))
                for shape, seconds, *_ in log:
                    shapes[name][shape].append(seconds)
    if not rates["none"]:
        return
    pairs = [s / n for s, n in zip(rates["spec"], rates["none"], strict=True)]
    if bounds is not None:
        bounds.remeasure()
        print(f"\n{bounds.describe()}; of the {'memory' if args.batch == 1 else 'compute'} bound: none "
              f"{bounds.of(statistics.median(rates['none']), args.batch == 1)}, spec "
              f"{bounds.of(statistics.median(rates['spec']), args.batch == 1)}")
    print(f"\n{args.workload} b={args.batch}, {args.repeats - 1} warm pairs: median tok/s none "
          f"{statistics.median(rates['none']):.1f}, spec {statistics.median(rates['spec']):.1f}, ratio of medians "
          f"{statistics.median(rates['spec']) / statistics.median(rates['none']):.3f}, median pairwise ratio "
          f"{statistics.median(pairs):.3f} (min {min(pairs):.3f}, max {max(pairs):.3f})")
    for name in ("none", "spec"):
        model = statistics.median(m for m, _ in runs[name]) * 1e3
        host = statistics.median(h for _, h in runs[name]) * 1e3
        cells = " ".join(f"{k}:{len(v)}x{statistics.median(v) * 1e3:.1f}"
                         for k, v in sorted(shapes[name].items(), key=lambda kv: (kv[0][0], int(kv[0][1:]))))
        print(f"{name:5s} median model {model:.0f} ms, between steps {host:.0f} ms | shape:steps x median ms {cells}")


if __name__ == "__main__":
    main()
