"""The price of verification rows: measured step time by row count next to the adaptive engine's table.

Runs synthetic verification steps (one request of up to 1 + K_MAX rows per row block, as the start-up
profile does, `engine/spec/step_price.py`) of R rows through the real runner, several times each in
alternating order, and prints the fastest wall time and the fastest thread CPU time per R beside the
engine's price table T(R) (profiled at its start). On CPU the table should show the C decode path's rows
(up to `max_rows()`) and then the batched path's staircase (rows taken in blocks: flat within a block, a
jump at its first row); a table that ramps where the measurement steps misprices exactly the rows the
policy chooses between.

    HF_HUB_OFFLINE=1 python benchmarks/spec_rows.py                 # torch's threads (idle machine)
    HF_HUB_OFFLINE=1 python benchmarks/spec_rows.py --num-threads 1 # shared machine: read the CPU column
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from deepinfer import LLM  # noqa: E402
from deepinfer.engine.request import Request  # noqa: E402
from deepinfer.engine.sampling_params import SamplingParams  # noqa: E402
from deepinfer.engine.scheduler import ScheduledRequest, SchedulerOutput  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--k-max", type=int, default=16)
    ap.add_argument("--rows", type=int, nargs="+",
                    default=[*range(1, 36), 40, 47, 48, 49, 50, 63, 64, 65, 96, 97, 128, 129])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--num-threads", type=int, default=None)
    args = ap.parse_args()
    llm = LLM(args.model, kv_cache_memory="768MiB", max_num_seqs=32, num_threads=args.num_threads,
              speculative_config={"method": "ngram", "num_speculative_tokens": args.k_max, "adaptive": True})
    core = llm.engine.core
    runner, kv, price = core.runner, core.kv, core.speculator.policy.price
    ids = itertools.count()
    context = 128

    def step(rows: int) -> tuple[float, float]:
        plan = SchedulerOutput()
        left = rows
        while left > 0:
            n = min(left, 1 + args.k_max)
            req = Request(f"rows-{next(ids)}", [1] * (context + 1), SamplingParams(temperature=0.0, max_tokens=1))
            req.num_computed_tokens = context
            plan.scheduled.append(ScheduledRequest(req, n, context, [1] * (n - 1)))
            left -= n
        plan.scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        for s in plan.scheduled:
            kv.allocate(s.request, context + s.num_new_tokens)
        wall, cpu = time.perf_counter(), time.thread_time()
        runner.execute(plan, kv.group_tables)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        for s in plan.scheduled:
            kv.free(s.request)
        return wall, cpu

    table = price.table(max(args.rows))
    best: dict[int, list[float]] = {}
    for rep in range(args.repeats + 1):  # the first pass warms up each row count (oneDNN primitives)
        for rows in args.rows if rep % 2 else list(reversed(args.rows)):
            wall, cpu = step(rows)
            if rep:
                b = best.setdefault(rows, [wall, cpu])
                b[0], b[1] = min(b[0], wall), min(b[1], cpu)
    print(f"threads={args.num_threads}, k_max={args.k_max}, C path rows={price.c_path_rows}, "
          f"fastest of {args.repeats}; T: the engine's start-up table")
    print("| rows | wall ms | CPU ms | T(R) ms | wall / wall(1) |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        wall, cpu = best[rows]
        print(f"| {rows} | {1e3 * wall:.2f} | {1e3 * cpu:.2f} | {1e3 * table[rows]:.2f} | {wall / best[args.rows[0]][0]:.2f} |")
    llm.close()


if __name__ == "__main__":
    main()
