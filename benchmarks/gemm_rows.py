"""The GGUF block kernels at 1..8 rows: one pass over every layer weight of the default model, and its LM head.

The layer weights of SmolLM2-135M (210 Q4_1 matrices, 80 MB) are far larger than the caches, so each pass
reads them from memory, as a decode step does; the weights are read once per call whatever the row count, so
extra rows should cost only their arithmetic. The kernels are called directly (`lib.q4_1_gemm` /
`lib.q8_0_gemm` with preallocated inputs and outputs), so the Python around `QuantizedWeight.matmul` is not
in the numbers. Reports CPU ms per pass (`time.process_time`, one thread: on a shared machine CPU time moves
far less than wall time with the others' load), median and minimum over `--repeats`, row counts
interleaved within each repeat, and the ratio of each median to the 1-row one. `--in-cache` adds a pass
over one layer weight repeated (cache-resident) beside them. Compare builds by running it
with PYTHONPATH pointing at each tree, interleaved::

    OMP_NUM_THREADS=1 PYTHONPATH=. python3 benchmarks/gemm_rows.py --repeats 15
    OMP_NUM_THREADS=1 PYTHONPATH=/path/to/base python3 benchmarks/gemm_rows.py --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import time

import deepinfer  # before torch, for its OpenMP settings

# isort: split
import torch

from deepinfer.layers.gguf_kernels import QuantizedWeight, load_library, read_quantized_tensors
from deepinfer.weights import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--in-cache", action="store_true",
                    help="also time a pass over one layer weight repeated as many times as there are layer "
                         "weights (it stays in L2 / L3): near the from-memory rate, the kernel is bound by its "
                         "instructions rather than by memory")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = load_library()
    if lib is None:
        raise SystemExit("the CPU kernels are unavailable here")
    blocks = read_quantized_tensors(default_model_path())
    layers = [w for name, w in blocks.items() if name.startswith("blk.")]
    sets = {"layers": layers, "head": [blocks["token_embd.weight"]]}
    if args.in_cache:
        resident = next(w for w in layers if w.kind == "q4_1")
        sets["cached"] = [resident] * len(layers)
    dtype = getattr(torch, args.dtype)
    code = 1 if dtype == torch.bfloat16 else 0
    counts = list(range(1, 9))
    widest = max(w.k for ws in sets.values() for w in ws)
    scratch = torch.empty(8 * widest * 2 + 64, dtype=torch.float32)

    def call(w: QuantizedWeight, x: torch.Tensor, y: torch.Tensor) -> None:
        if w.kind == "q4_1":
            lib.q4_1_gemm(x.data_ptr(), x.shape[0], w.k, w.qs.data_ptr(), w.d.data_ptr(), w.mn.data_ptr(),
                          y.data_ptr(), w.n, scratch.data_ptr(), code)
        else:
            lib.q8_0_gemm(x.data_ptr(), x.shape[0], w.k, w.qs.data_ptr(), w.d.data_ptr(), y.data_ptr(), w.n,
                          scratch.data_ptr(), code)

    gen = torch.Generator().manual_seed(0)
    print(f"deepinfer from {deepinfer.__file__}; {args.dtype}, {args.threads} thread(s); CPU ms per pass "
          "(median / min), ratio of medians to 1 row")
    for label, ws in sets.items():
        xs = {m: {w.k: torch.randn(m, w.k, generator=gen).to(dtype) for w in ws} for m in counts}
        ys = {m: {w.n: torch.empty(m, w.n, dtype=dtype) for w in ws} for m in counts}
        times: dict[int, list[float]] = {m: [] for m in counts}
        for _ in range(args.repeats):
            for m in counts:
                t = time.process_time()
                for w in ws:
                    call(w, xs[m][w.k], ys[m][w.n])
                times[m].append(time.process_time() - t)
        mb = sum(w.qs.numel() + 4 * w.d.numel() + (4 * w.mn.numel() if w.mn is not None else 0) for w in ws) / 1e6
        one = statistics.median(times[1])
        cells = "  ".join(f"{m}: {statistics.median(times[m]) * 1e3:.2f}/{min(times[m]) * 1e3:.2f} "
                          f"x{statistics.median(times[m]) / one:.2f}" for m in counts)
        print(f"{label:>6} ({len(ws)} weights, {mb:.0f} MB; 1 row {mb / 1e3 / one:.1f} GB/s of CPU time)  {cells}")


if __name__ == "__main__":
    main()
