"""Float32 (or bfloat16) products at the default model's shapes: oneDNN's packed weights against `panel_gemm.c`.

For each projection shape of SmolLM2-135M (and its LM head) and each row count, both kernels multiply the
same activations with `--copies` distinct random weights in turn (30 by default, like the 30 layers: the
weights then come from memory, as in a decode step), interleaved within each repeat. Prints the median
wall-clock ms per product, GFLOP/s and the ratio oneDNN / panel (> 1: the panel kernel is faster); for
bfloat16 also the panel kernel with its next-panel prefetch requests (`panel_matmul(prefetch=True)`, off in
the engine) and the ratio prefetch / panel (> 1: the engine's choice, no requests, is faster here); on a CPU with
AMX, where the panel kernel runs on AMX tiles (and ignores the requests), its AVX-512 BF16 vector tiles instead
(`panel_gemm_bf16_vector`) and the ratio vector / AMX::

    PYTHONPATH=. python3 benchmarks/panel_gemm.py --threads 2 --repeats 7
    PYTHONPATH=. python3 benchmarks/panel_gemm.py --threads 2 --repeats 7 --dtype bfloat16   # AVX-512 BF16 CPUs
"""

from __future__ import annotations

import argparse
import statistics
import time

import deepinfer  # noqa: F401 - before torch, for its OpenMP settings

# isort: split
import torch

from deepinfer.layers.cpu_kernels import load_library
from deepinfer.layers.linear import pack_panels, padded_rows, panel_matmul

SHAPES = {"qkv_proj": (576, 960), "o_proj": (576, 576), "gate_up_proj": (576, 3072), "down_proj": (1536, 576),
          "lm_head": (576, 49152)}


def _onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    m = x.shape[0]
    rows = padded_rows(m)
    if rows != m:
        x = torch.cat([x, x.new_zeros((rows - m, x.shape[1]))])
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")[:m]


def _vector(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    y = torch.empty((x.shape[0], panels.shape[0] * panels.shape[2]), dtype=x.dtype)
    load_library().panel_gemm_bf16_vector(x.data_ptr(), x.shape[0], x.shape[1], panels.data_ptr(), None,
                                          y.data_ptr(), y.shape[1], 0)
    return y


def _product(kernel: str, x: torch.Tensor, packed: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    if kernel == "onednn":
        return _onednn(x, packed)
    if kernel == "vector":
        return _vector(x, panels)
    return panel_matmul(x, panels, prefetch=kernel == "prefetch")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[9, 16, 32, 64, 128, 512, 2048])
    ap.add_argument("--copies", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    lib = load_library()
    if lib is None:
        raise SystemExit("the CPU kernels are unavailable here (x86-64 with AVX2 and gcc needed)")
    preferred = lib.panel_gemm_bf16_preferred() if dtype == torch.bfloat16 else lib.panel_gemm_preferred()
    bf16 = dtype == torch.bfloat16
    other = ("vector" if lib.amx_tiles_granted() else "prefetch") if bf16 else None
    print(f"{args.threads} thread(s), {args.dtype}; panel kernel preferred on this CPU: {bool(preferred)}"
          + (f"; bf16 panels on AMX tiles: {other == 'vector'}" if bf16 else ""))
    print(f"{'shape':14s} {'rows':>5s} {'oneDNN ms':>10s} {'GFLOP/s':>8s} {'panel ms':>9s} {'GFLOP/s':>8s} {'ratio':>6s}"
          + (f" {other + ' ms':>11s} {other + ' / panel':>16s}" if bf16 else ""))
    gen = torch.Generator().manual_seed(0)
    for name, (k, n) in SHAPES.items():
        copies = 1 if name == "lm_head" else args.copies
        weights = [(torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype) for _ in range(copies)]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
        panels = [pack_panels(w) for w in weights]
        del weights
        for m in args.rows:
            if name == "lm_head" and m > 128:
                continue  # the LM head runs on the last token of each sequence only
            x = torch.randn(m, k, generator=gen).to(dtype)
            times: dict[str, list[float]] = {"onednn": [], "panel": [], **({other: []} if other else {})}
            for key in times:  # warm-up: oneDNN builds its primitive for the shape
                _product(key, x, packed[0], panels[0])
            for _ in range(args.repeats):
                for key in times:
                    t = time.perf_counter()
                    for i in range(copies):
                        _product(key, x, packed[i], panels[i])
                    times[key].append((time.perf_counter() - t) / copies)
            a, b = statistics.median(times["onednn"]), statistics.median(times["panel"])
            flop = 2.0 * m * k * n
            extra = ""
            if other:
                c = statistics.median(times[other])
                extra = f" {c * 1e3:11.3f} {c / b:15.2f}x"
            print(f"{name:14s} {m:5d} {a * 1e3:10.3f} {flop / a / 1e9:8.1f} {b * 1e3:9.3f} {flop / b / 1e9:8.1f} "
                  f"{a / b:5.2f}x" + extra)


if __name__ == "__main__":
    main()
