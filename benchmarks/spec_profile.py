"""How far the start-up price of verification moves from one engine start to the next.

The adaptive draft length reads the price of a step of R rows, T(R), from a table the engine seeds at start
with a short profile of synthetic verification steps (`deepinfer/engine/spec/step_price.py`). Past the C
decode path's rows no served step corrects an entry while nothing drafts there, so at batch 8 the profile's
T(16) / T(8) decides whether code edits draft at all. This script starts the engine `--starts` times and
prints, per start, T(R) / T(c) (c: the C path's rows) from the table and from the profile's own entries,
then each ratio's spread over the starts; with `--alternate N`, N rounds of steps of c, 2c and 4c rows in
turn (each round's ratios measured seconds apart, so no slow spell lies between its steps): the ratios the
profile should find. Usage::

    PYTHONPATH=. python3 benchmarks/spec_profile.py --starts 5 --alternate 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepinfer import LLM  # noqa: E402
from deepinfer.engine.spec.step_price import profile_rows  # noqa: E402

ROWS = (1, 2, 4, 8, 9, 10, 12, 16, 17, 24, 32, 33, 40, 48)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in GGUF")
    ap.add_argument("--starts", type=int, default=5)
    ap.add_argument("--k-max", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=32, help="as spec.py's largest batch")
    ap.add_argument("--alternate", type=int, default=0, help="rounds of c, 2c, 4c-row steps after the starts")
    args = ap.parse_args()

    spec = {"method": "ngram", "num_speculative_tokens": args.k_max, "adaptive": True}
    tables: dict[int, list[float]] = {r: [] for r in ROWS}
    llm = None
    for start in range(args.starts):
        llm = LLM(args.model, speculative_config=spec, kv_cache_memory="768MiB", max_num_seqs=args.max_num_seqs)
        price = llm.engine.core.speculator.policy.price
        c = price.c_path_rows or 8
        table = price.table(max(ROWS))
        profiled = {r: min(v) for r, v in price._profile.items()}
        for r in ROWS:
            tables[r].append(table[r] / table[c])
        print(f"start {start}: C path {price.c_path_rows} rows, {len(profiled)} counts profiled up to {max(profiled)}")
        print("  table    T(R)/T(c): " + " ".join(f"{r}:{table[r] / table[c]:.2f}" for r in ROWS))
        print("  profiled T(R)/T(c): " + " ".join(f"{r}:{profiled[r] / profiled[c]:.2f}" for r in ROWS if r in profiled))
        if start < args.starts - 1:
            del llm
    print("spread over starts (min - max, median): " + " ".join(
        f"{r}:{min(v):.2f}-{max(v):.2f} ({statistics.median(v):.2f})" for r, v in tables.items()))
    if args.alternate and llm is not None:
        core = llm.engine.core
        c = core.speculator.policy.price.c_path_rows or 8
        ratios: dict[int, list[float]] = {2 * c: [], 4 * c: []}
        for _ in range(args.alternate):
            ref = profile_rows(core.runner, core.kv, [c], args.k_max)[0][1]
            for r in ratios:
                ratios[r].append(profile_rows(core.runner, core.kv, [r], args.k_max)[0][1] / ref)
        print(f"alternating steps ({args.alternate} rounds), median T(R)/T({c}): " + " ".join(
            f"{r}:{statistics.median(v):.2f} (quartiles {statistics.quantiles(v, n=4)[0]:.2f}-"
            f"{statistics.quantiles(v, n=4)[2]:.2f})" for r, v in ratios.items()))


if __name__ == "__main__":
    main()
