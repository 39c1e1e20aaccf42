"""Before / after: one benchmark script run from two checkouts, alternating, with the median ratio.

Each round runs the script once with `PYTHONPATH=<checkout A>` and once with `<checkout B>` (order
flipped every round, so drift on a noisy machine hits both), each writing JSON to the path put in
place of `{json}`. Every numeric leaf of the JSON that is the same key in both is reported as
median(A), median(B) and median(B) / median(A). The script itself comes from checkout B.

    git worktree add /tmp/before <old commit>
    python benchmarks/ab.py --a /tmp/before --b . --rounds 3 -- \\
        benchmarks/throughput.py --engines deepinfer --repeats 1 --json-out {json}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def numeric_leaves(obj: Any, prefix: str = "") -> dict[str, float]:
    """{"a.b.0.c": value} for every int / float leaf (booleans left out)."""
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(numeric_leaves(v, f"{prefix}{k}."))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(numeric_leaves(v, f"{prefix}{i}."))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out[prefix.rstrip(".")] = float(obj)
    return out


def run_once(checkout: Path, script: list[str], out: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve())}
    cmd = [sys.executable, *[a.replace("{json}", str(out)) for a in script]]
    # from a directory holding no `deepinfer`: a process the script starts with `python -m deepinfer.cli` (workers,
    # routers) puts its working directory before PYTHONPATH, so from a checkout both sides ran that checkout's code
    subprocess.run(cmd, env=env, check=True, cwd=out.parent)
    return numeric_leaves(json.loads(out.read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=Path, required=True, help="the 'before' checkout (its root)")
    ap.add_argument("--b", type=Path, required=True, help="the 'after' checkout (its root)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--match", default="", help="report only keys containing this text")
    ap.add_argument("--json-out", type=Path, help="write every run's numbers and the ratios here")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- script and its arguments ({json} = output)")
    args = ap.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        ap.error("give the benchmark script after --")
    script[0] = str((args.b / script[0]).resolve()) if not Path(script[0]).is_absolute() else script[0]
    runs: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
                print(f"round {r + 1}/{args.rounds}: {side}", file=sys.stderr, flush=True)
                runs[side].append(run_once(getattr(args, side), script, Path(tmp) / f"{side}{r}.json"))
    keys = [k for k in runs["a"][0] if args.match in k and all(k in x for x in runs["a"] + runs["b"])]
    ratios = {}
    print(f"{'metric':60s} {'A (median)':>12s} {'B (median)':>12s} {'B/A':>7s}")
    for k in keys:
        a = statistics.median(x[k] for x in runs["a"])
        b = statistics.median(x[k] for x in runs["b"])
        ratios[k] = b / a if a else float("nan")
        print(f"{k:60s} {a:12.4g} {b:12.4g} {ratios[k]:7.3f}")
    if args.json_out:
        args.json_out.write_text(json.dumps({"a": str(args.a), "b": str(args.b), "script": script,
                                             "runs": runs, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
