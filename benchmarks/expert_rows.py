"""What one expert matmul pair costs per row on this CPU: the basis of `SPLIT_ROWS` (`deepinfer/layers/ep_moe.py`).

An expert's SwiGLU MLP (gate/up [2I, H], down [H, I], `F.linear` as `RoutedExperts.compute` runs it) on n
rows, cycling over `--experts` experts so each call reads its weights from memory (as a decode step does:
16 experts x 3 MiB do not fit in cache). Prints the time per call for each n (best of 5 passes) and the
least-squares fit time(n) = read + n * per_row, whose ratio read / per_row is the number of rows that
costs as much as one more read of the weights: a replica's extra weight read pays once it takes that many
rows off another rank.

Run: PYTHONPATH=. python3 benchmarks/expert_rows.py   (defaults: the EPLB benchmark's experts, fp32, 1 thread)
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32, 48, 64])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    h, i, e = args.hidden, args.intermediate, args.experts
    w13, w2 = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    ms = []
    for n in args.rows:
        x = torch.randn(n, h)
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            for c in range(args.calls):
                g = F.linear(x, w13[c % e])
                F.linear(F.silu(g[:, :i]) * g[:, i:], w2[c % e])
            best = min(best, (time.perf_counter() - started) / args.calls)
        ms.append(1000 * best)
        print(f"{n:4d} rows: {ms[-1]:.3f} ms per expert call", flush=True)
    a = torch.stack([torch.ones(len(ms)), torch.tensor(args.rows, dtype=torch.float32)], dim=1)
    read, per_row = torch.linalg.lstsq(a, torch.tensor(ms)[:, None]).solution[:, 0].tolist()
    print(f"fit: {read:.3f} ms + n x {per_row:.4f} ms -> one weight read costs {read / per_row:.1f} rows")


if __name__ == "__main__":
    main()
