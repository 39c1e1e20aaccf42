"""The paged decode attention kernel alone (`paged_attention.c`), in CPU milliseconds per decode step.

A decode step of the offline chat workload at 64 rows, attention only: every layer's call of the C
kernel over that layer's own KV cache (so the KV of the step is not cache-resident, as in the engine),
one torch/OpenMP thread, `time.process_time` (CPU time: other load on a shared machine barely moves
it). Block tables are scattered over the pool like the engine's. The default shape is SmolLM2-135M's
(9 query heads over 3 kv heads, head size 64, 30 layers, bf16, 16-token blocks) with contexts of
40-105 tokens (the chat workload's); `--context 300,420` stands for the shared-prefix workload's
longer sequences. Prints the median of `--repeats` steps, each the sum over the layers. Run it once per
build with `PYTHONPATH` at each checkout, interleaved, to compare two builds of the kernel::

    PYTHONPATH=. python3 benchmarks/attn_kernel.py --repeats 15

With more than one thread, CPU time counts a thread that waits for its partner as busy, so a kernel
that leaves a thread idle looks no cheaper: `--wall` times the steps by the clock instead (a single long
sequence, where the work splits across threads or not: `--batch 1 --context 1900,1900 --threads 2 --wall`).
A few short sequences' KV fits in the caches, where the engine's never stays: between two layers it reads
that layer's weights (2.2 MB for SmolLM2-135M's Q4_1 blocks, 96 MB a step). `--between-mb 2.2` reads that
much of a 256 MB buffer before each layer's call, outside the timed calls, so the KV comes from memory as in a
decode step (`--batch 1 --context 140,140 --threads 2 --wall --between-mb 2.2`: a single stream's step).
`--rows-per-seq R` gives each sequence R rows at consecutive positions over its one block table, the shape of a
verification step's drafts or a prompt chunk's tokens (`--batch 1 --rows-per-seq 4 --context 300,300`).
`--shared-prefix N` gives every sequence the same blocks for its first N tokens (full blocks; a common system
prompt from the prefix cache), each context then N + a length drawn from `--context`. On AMX CPUs bf16 calls take
`paged_attention_amx.c`; `--vector` times the vector kernel beside it in the same run (interleaved steps) and
prints the ratio (the shared-prefix workload's steps:
`--shared-prefix 432 --context 30,160 --threads 2 --wall --vector`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from deepinfer.layers import cpu_kernels  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", default="40,105", help="lo,hi: context lengths drawn uniformly in [lo, hi]")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--wall", action="store_true", help="wall-clock time instead of CPU time")
    ap.add_argument("--rows-per-seq", type=int, default=1,
                    help="rows per sequence at consecutive positions sharing its block table (a verification "
                         "step's drafts or a prompt chunk's tokens): the sequence's context is the last row's")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="tokens at the start of every context whose blocks all sequences share")
    ap.add_argument("--vector", action="store_true",
                    help="also time the vector kernel (paged_decode_attention_vector) and print the ratio")
    ap.add_argument("--between-mb", type=float, default=0.0,
                    help="MB of another buffer read before each layer's call, untimed (the weights' traffic)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    lib = cpu_kernels.load_library()
    if lib is None:
        raise SystemExit("the C kernels are unavailable on this machine")
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    lo, hi = (int(x) for x in args.context.split(","))
    bs, kvh, d = args.block_size, args.kv_heads, args.head_dim
    shared = args.shared_prefix // bs  # blocks every table starts with
    lens = shared * bs + torch.randint(lo, hi + 1, (args.batch,), generator=gen)
    blocks = int(((lens + bs - 1) // bs).sum()) + 8
    perm = torch.randperm(blocks, generator=gen)
    need = int(((lens + bs - 1) // bs).max())
    tables = torch.zeros(args.batch, need, dtype=torch.long)
    used = shared
    for b, n in enumerate(lens.tolist()):
        nb = (n + bs - 1) // bs
        tables[b, :shared] = perm[:shared]
        tables[b, shared:nb] = perm[used:used + nb - shared]
        used += nb - shared
    caches = [(torch.randn(blocks, bs, kvh, d, generator=gen).to(dtype),
               torch.randn(blocks, bs, kvh, d, generator=gen).to(dtype)) for _ in range(args.layers)]
    if args.rows_per_seq > 1:  # each sequence's rows: its table, contexts ending at its length
        r = args.rows_per_seq
        tables = tables.repeat_interleave(r, dim=0)
        lens = (lens[:, None] - torch.arange(r - 1, -1, -1)[None, :]).reshape(-1).clamp(min=1)
    rows = len(lens)
    q = torch.randn(rows, args.heads, d, generator=gen).to(dtype)
    out = torch.empty_like(q)
    code = cpu_kernels.dtype_code(dtype)

    clock = time.perf_counter if args.wall else time.process_time
    chunk = int(args.between_mb * 2**20) // 4
    traffic = torch.ones(max(64 * 2**20, chunk), dtype=torch.float32) if chunk else None
    at = 0

    def step(kernel=lib.paged_decode_attention) -> float:
        nonlocal at
        total = 0.0
        for k, v in caches:
            if traffic is not None:  # another layer's weights pass through the caches
                if at + chunk > traffic.numel():
                    at = 0
                traffic[at:at + chunk].sum()
                at += chunk
            t = clock()
            rc = kernel(q.data_ptr(), out.data_ptr(), k.data_ptr(), v.data_ptr(),
                                            tables.data_ptr(), need, lens.data_ptr(), rows, args.heads, kvh,
                                            d, bs, d ** -0.5, code, 0, None)
            total += clock() - t
            if rc != 0:
                raise RuntimeError("the kernel rejected its arguments")
        return total * 1e3

    kernels = {"paged_decode_attention": lib.paged_decode_attention}
    if args.vector:
        kernels["vector kernel"] = lib.paged_decode_attention_vector
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(3):
        for kernel in kernels.values():
            step(kernel)
    for _ in range(args.repeats):  # interleaved, so that drift on a noisy machine hits both
        for name, kernel in kernels.items():
            times[name].append(step(kernel))
    tokens = int(lens.sum()) * kvh * args.layers
    shape = (f"{args.dtype} B={args.batch}x{args.rows_per_seq} ctx {args.shared_prefix // bs * bs}+{lo}-{hi} "
             f"H={args.heads}/{kvh} D={d} layers={args.layers}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{shape} {name}: median {med:.2f} ms {'wall' if args.wall else 'CPU'} per step (min {min(ts):.2f}), "
              f"{med * 1e6 / tokens:.2f} ns per (token, kv head)")
    if args.vector:
        ratio = statistics.median(times["vector kernel"]) / statistics.median(times["paged_decode_attention"])
        print(f"vector / paged_decode_attention: {ratio:.2f}x")


if __name__ == "__main__":
    main()
