"""What a speculative verify step costs against a plain decode step: one sequence, 1..9 rows.

Speculative decoding verifies the last accepted token plus k drafted ones of a sequence as 1 + k rows of
one step. At batch 1 those rows take the whole-layer C path (`layers/fused_decode.py`) as long as there
are at most `max_rows()` of them, and the LM head multiplies its GGUF blocks for every row. Reading the
weights from memory costs the same for any row count, so a verify step should cost about one decode
step; this measures how near it is. For each row count it runs the step's parts on the default model
(embedding, the layer stack with attention over a context of `--context` tokens, the final norm and the
LM head), with the rows at consecutive positions of one sequence, as the engine's verify step lays
them out, and reports CPU milliseconds (`time.process_time`, one thread by default: on a shared
machine CPU time moves far less than wall time with the others' load), median over `--repeats`:

  layers   the fused layer stack (embedding, 30 layers: projections, attention, norms)
  attn     the part of `layers` that grows with the context: layers at `--context` minus layers at 16
  head     final norm + LM head (logits for every row, as the verify step needs)
  step     layers + head, and its ratio to the 1-row step

Compare builds by running it with PYTHONPATH pointing at each tree, interleaved::

    PYTHONPATH=. python3 benchmarks/verify_rows.py --threads 1 --repeats 15
    PYTHONPATH=/path/to/base python3 benchmarks/verify_rows.py --threads 1 --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import deepinfer  # before torch, for its OpenMP settings

# isort: split
import torch

from deepinfer import LLM


def _meta(rows: int, context: int, block_size: int, max_blocks: int) -> tuple[torch.Tensor, SimpleNamespace]:
    """Positions and attention metadata of `rows` new tokens of one sequence that already holds `context`
    tokens (KV blocks 0, 1, ... in order, so a position's cache slot is the position itself)."""
    positions = torch.arange(context, context + rows, dtype=torch.int64)
    table = torch.arange(max_blocks, dtype=torch.int64).repeat(rows, 1)
    meta = SimpleNamespace(prefills=0, num_decodes=rows, decode_context_lens=positions + 1,
                           decode_block_tables=table, slot_mapping=positions.clone())
    return positions, meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--context", type=int, default=512, help="tokens already in the sequence's KV cache")
    ap.add_argument("--max-rows", type=int, default=9)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="CPU time (both threads' sum, spin-waits included) or wall-clock time")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    llm = LLM(None, num_threads=args.threads, kv_cache_memory="64MiB", enable_prefix_caching=False)
    runner = llm.engine.core.runner
    model = runner.model
    fused = model.fused
    if fused is None:
        raise SystemExit("the default model did not get the whole-layer C path (no GGUF kernels here?)")
    caches = runner.kv_caches
    block_size = runner.block_size
    max_blocks = (args.context + args.max_rows) // block_size + 1
    if max_blocks > runner.num_blocks:
        raise SystemExit(f"--context {args.context} needs {max_blocks} KV blocks, the cache has {runner.num_blocks}")
    gen = torch.Generator().manual_seed(0)
    for k_cache, v_cache in caches:  # any finite values: the timing does not depend on them
        k_cache.copy_(torch.randn(k_cache.shape, generator=gen).to(k_cache.dtype))
        v_cache.copy_(torch.randn(v_cache.shape, generator=gen).to(v_cache.dtype))
    print(f"deepinfer from {deepinfer.__file__}; dtype {runner.dtype}, {args.threads} thread(s), "
          f"context {args.context}, C path up to {fused.max_rows} rows")

    def layers(rows: int, context: int) -> float:
        positions, meta = _meta(rows, context, block_size, max_blocks)
        ids = torch.randint(100, 20000, (rows,), generator=gen)
        if not fused.accepts(ids, meta):
            return float("nan")
        t = clock()
        fused.run(ids, positions, caches, meta)
        return clock() - t

    def head(rows: int) -> float:
        x = torch.randn(rows, model.config.hidden_size, generator=gen).to(runner.dtype)
        t = clock()
        model.compute_logits(model.norm(x, torch.zeros_like(x))[0])
        return clock() - t

    counts = list(range(1, args.max_rows + 1))
    times: dict[tuple[str, int], list[float]] = {(p, m): [] for p in ("layers", "short", "head") for m in counts}
    with torch.inference_mode():
        for _ in range(2):  # warm-up: first calls build the layer table and touch the buffers
            layers(1, args.context), head(1)
        for _ in range(args.repeats):  # row counts interleaved within each repeat
            for m in counts:
                times[("layers", m)].append(layers(m, args.context))
                times[("short", m)].append(layers(m, 16))
                times[("head", m)].append(head(m))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    step1 = med[("layers", 1)] + med[("head", 1)]
    print(f"{'rows':>4} {'layers':>8} {'attn':>7} {'head':>7} {'step':>8} {'x 1 row':>8}   ({args.clock} ms, median)")
    for m in counts:
        step = med[("layers", m)] + med[("head", m)]
        print(f"{m:>4} {med[('layers', m)]:8.2f} {med[('layers', m)] - med[('short', m)]:7.2f} "
              f"{med[('head', m)]:7.2f} {step:8.2f} {step / step1:8.2f}")


if __name__ == "__main__":
    main()
