"""Memory kept per distinct matmul shape: RSS growth over 400 row counts of SmolLM2-135M's four
projection shapes (bf16), run the way deepinfer's packed path runs them, unbucketed vs bucketed.

oneDNN (through torch) keeps memory for every new shape it runs. The primitive cache's limit
(`ONEDNN_PRIMITIVE_CACHE_CAPACITY`) and `malloc_trim` give part of it back, not all of it, so a
server whose prefill steps bring a new row count almost every step grows. `layers/linear.py` runs
packed products at bucketed row counts (`padded_rows`), which bounds the number of shapes.

    python benchmarks/shape_memory.py                                   # every mode, one process each
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 python benchmarks/shape_memory.py --modes packed
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys

MODES = ("packed", "packed_same_rows", "packed_bucketed", "dense")


def measure(mode: str, num_rows: int) -> str:
    import psutil
    import torch
    import torch.nn.functional as F

    from deepinfer.layers.linear import padded_rows

    proc = psutil.Process()

    def rss() -> float:
        return proc.memory_info().rss / 2**20

    shapes = [(576, 576 * 3), (576, 576), (576, 1536 * 2), (1536, 576)]  # (in, out): qkv, o, gate_up, down
    weights = [torch.randn(n, k, dtype=torch.bfloat16) for k, n in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    x = torch.randn(4096, 1536, dtype=torch.bfloat16)

    def run(m: int) -> None:
        if mode == "packed_bucketed":
            m = padded_rows(m)
        for (k, _), w, pw in zip(shapes, weights, packed, strict=True):
            xi = x[:m, :k].contiguous()
            if mode == "dense":
                F.linear(xi, w)
            else:
                torch.ops.mkldnn._linear_pointwise(xi, pw, None, "none", [], "")

    run(9)
    base = rss()
    rows = [200] * num_rows if mode == "packed_same_rows" else range(17, 17 + num_rows)
    for m in rows:
        run(m)
    grown = rss() - base
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    cap = os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "default (1024)")
    return f"{mode:18s} primitive cache {cap:15s} +{grown:6.0f} MiB; after malloc_trim +{rss() - base:6.0f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--rows", type=int, default=400, help="how many row counts (17, 18, ...)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one mode in this process
    args = ap.parse_args()
    if args.one:
        print(measure(args.one, args.rows), flush=True)
        return
    print(f"{args.rows} row counts x 4 projection shapes of SmolLM2-135M, bf16, one fresh process per mode")
    for mode in args.modes.split(","):
        subprocess.run([sys.executable, __file__, "--one", mode, "--rows", str(args.rows)], check=True)


if __name__ == "__main__":
    main()
