"""Where a batched decode step spends its CPU time, measured so that other load on the machine barely moves it.

Wall-clock tok/s on a shared 2-core machine says more about the neighbours than about the engine. This
script runs the offline chat workload of `throughput.py` (or `--workload shared`; same prompts, greedy, ``ignore_eos``) with a
fixed torch thread count (default 1: no barrier partner to wait for, so CPU time is the work itself)
and reports CPU seconds (``time.process_time``) per decode step, split by phase.

``--clock wall`` times the phases by the wall clock instead (with 2 threads, CPU time also counts a thread
spinning while the other works).

Only the steps after the prompts' prefill count (``--skip-steps``). Phases:

* the decoder layers (embedding included), and inside them the four projections, the attention backend
  (KV cache writes + the paged decode kernel; on the batched C path of layers/batched_decode.py the KV
  writes happen in its rotary pass, so this is the kernel alone) and the glue: the rest (norms, rotary,
  KV writes there, SiLU*mul, embedding, the Python and dispatch between them); the MLP blocks row is
  only filled on the per-layer torch path;
* the LM head (its matmul and the float32 copy of the logits);
* the rest of `ModelRunner.run` (sampling), `ModelRunner.prepare` and the rest of `EngineCore.step`
  (scheduler, output processing).

The phases are timed by wrapping those methods of this process's engine (read-only timing; nothing else
changes). Then each projection of layer 0 and the LM head is timed alone at the step's row count
(oneDNN's packed weights through `Linear`, as the engine runs them), with its GFLOP/s, to show how near
the matmuls are to the core's bound. With one prompt (the single stream: every step takes the whole-layer
C path of `layers/fused_decode.py`), the projections are timed on the GGUF blocks, each layer's copy in
turn so that they come from memory, with the GB/s achieved. Usage::

    PYTHONPATH=. python3 benchmarks/decode_profile.py --num-prompts 64 --max-tokens 128 --threads 1
    PYTHONPATH=. python3 benchmarks/decode_profile.py --num-prompts 1 --max-tokens 128 --threads 1
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

import deepinfer  # noqa: F401 - before torch, for its OpenMP settings


def _timed(acc: collections.Counter, key: str, fn: Callable[..., Any], clock: Callable[[], float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += clock() - t
    return wrapper


def phase_profile(llm: Any, prompts: list[list[int]], warm: list[list[int]], max_tokens: int, skip: int,
                  clock: Callable[[], float] = time.process_time) -> float:
    """Prints where the decode steps' time goes; returns the run's tok/s (wall)."""
    from deepinfer import SamplingParams

    core = llm.engine.core
    model = core.runner.model
    acc: collections.Counter = collections.Counter()

    def _wrap(obj: Any, name: str, acc: collections.Counter, key: str) -> None:
        setattr(obj, name, _timed(acc, key, getattr(obj, name), clock))
    _wrap(core, "step", acc, "step")
    _wrap(core.runner, "run", acc, "run")
    _wrap(core.runner, "prepare", acc, "prepare")
    _wrap(model, "hidden_states", acc, "layers")
    _wrap(model, "compute_logits", acc, "lm_head")
    for layer in model.layers:  # instance attributes: only this model's modules are timed
        _wrap(layer.mlp, "forward", acc, "mlp")
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            _wrap(lin, "forward", acc, "layer_matmuls")
        if hasattr(layer.mlp.gate_up_proj, "silu_mul_into"):  # panels: gate_up with SiLU*mul in its tiles
            _wrap(layer.mlp.gate_up_proj, "silu_mul_into", acc, "layer_matmuls")
    _wrap(model.lm_head, "forward", acc, "lm_head_matmul")
    if model.fused is not None:  # the whole-layer C path of small decode steps (batch 1 lands here)
        # from the embedding to the final norm of the logits rows (older trees: to the last layer)
        _wrap(model.fused, "final_hidden" if hasattr(model.fused, "final_hidden") else "run", acc, "fused")
    for backend in {id(layer.self_attn.backend): layer.self_attn.backend for layer in model.layers}.values():
        _wrap(backend, "forward", acc, "attention")  # layers may share one backend object: wrap it once
        if hasattr(backend, "attend_cached_rows"):  # the batched path (layers/batched_decode.py)
            _wrap(backend, "attend_cached_rows", acc, "attention")
    counts: collections.Counter = collections.Counter()
    step = core.step
    start: dict[str, float] = {}

    def counted() -> Any:
        counts["steps"] += 1
        if counts["steps"] == skip + 1:  # the prefill steps are over: only 64-row decodes from here
            start.update(acc)
        return step()
    core.step = counted
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in warm], sp)
    acc.clear()
    counts.clear()
    start.clear()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    steps = counts["steps"] - skip
    for key in list(acc):
        acc[key] -= start.get(key, 0.0)
    rows = [
        ("decoder layers (embedding included)", acc["layers"]),
        ("  the layers' four matmuls (Linear.forward, silu_mul_into)", acc["layer_matmuls"]),
        ("  attention backend (KV write + paged decode; batched path: the kernel alone)", acc["attention"]),
        ("  glue: norms, rotary, KV write, SiLU*mul, embedding, Python between",
         acc["layers"] - acc["layer_matmuls"] - acc["attention"]),
        ("  (MLP blocks, per-layer torch path only)", acc["mlp"]),
        ("  whole layers in C (FusedDecoder, <= 8 rows)", acc["fused"]),
        ("LM head + float32 logits", acc["lm_head"]),
        ("  of which the LM head matmul", acc["lm_head_matmul"]),
        ("sampling (rest of ModelRunner.run)", acc["run"] - acc["layers"] - acc["lm_head"]),
        ("ModelRunner.prepare", acc["prepare"]),
        ("scheduler + outputs (rest of EngineCore.step)", acc["step"] - acc["run"] - acc["prepare"]),
    ]
    print(f"{len(prompts)} prompts x {max_tokens} tokens: {steps} steps, process CPU {cpu:.2f} s, "
          f"wall {wall:.2f} s ({len(prompts) * max_tokens / wall:.0f} tok/s wall)")
    print(f"{'CPU' if clock is time.process_time else 'wall'} ms per decode step, the {steps} steps after the first {skip} (total {1000 * acc['step'] / steps:.2f}):")
    for name, sec in rows:
        print(f"  {1000 * sec / steps:8.2f}  {100 * sec / acc['step']:5.1f}%  {name}")
    return len(prompts) * max_tokens / wall


def _weight_bytes(lin: Any, rows: int) -> int:
    """The bytes one call reads for its weight: the GGUF blocks (with the float32 scales / offsets the
    kernels keep) where the quantized path serves `rows`, else the dense weight."""
    from deepinfer.layers.gguf_kernels import max_rows

    q = lin.quantized
    if q is not None and rows <= max_rows():
        return sum(t.numel() * t.element_size() for t in (q.qs, q.d, q.mn) if t is not None)
    return lin.weight.numel() * lin.weight.element_size()


def gemm_profile(model: Any, rows: int, reps: int = 20) -> None:
    """Each projection alone at `rows` rows. At most max_rows() rows (the GGUF block kernels) every layer's
    copy is called in turn, so the weights come from memory as in a step (a 135M model's layer fits in
    L2/L3 and would otherwise stay cached), and the achieved GB/s of the blocks read is shown; above that,
    layer 0's weight is reused (the compute-bound oneDNN path: its GFLOP/s is the figure to read)."""
    import torch

    from deepinfer.layers.gguf_kernels import max_rows

    cold = rows <= max_rows()

    def copies(pick: Callable[[Any], Any]) -> list[Any]:
        return [pick(layer) for layer in model.layers] if cold else [pick(model.layers[0])]

    linears = [("qkv_proj", copies(lambda la: la.self_attn.qkv_proj)), ("o_proj", copies(lambda la: la.self_attn.o_proj)),
               ("gate_up_proj", copies(lambda la: la.mlp.gate_up_proj)), ("down_proj", copies(lambda la: la.mlp.down_proj)),
               ("lm_head", [model.lm_head])]
    n_layers = len(model.layers)
    total = 0.0
    print(f"matmuls at {rows} rows (CPU ms per call, best of 5 x {reps}; "
          f"{'each layer in turn: weights from memory' if cold else 'layer 0 repeated'}):")
    with torch.inference_mode():
        for name, lins in linears:
            lin = lins[0]
            x = torch.randn(rows, lin.in_features, dtype=lin.weight.dtype)
            lin(x)
            best = float("inf")
            for _ in range(5):
                t = time.process_time()
                for _ in range(reps):
                    for one in lins:
                        one(x)
                best = min(best, (time.process_time() - t) / (reps * len(lins)))
            per_step = best * (1 if name == "lm_head" else n_layers)
            total += per_step
            flops = 2 * rows * lin.in_features * lin.out_features
            print(f"  {name:13s} {lin.in_features:5d}x{lin.out_features:<6d} {1000 * best:7.3f} ms  "
                  f"{flops / best / 1e9:6.0f} GFLOP/s  {_weight_bytes(lin, rows) / best / 1e9:5.1f} GB/s  "
                  f"x{1 if name == 'lm_head' else n_layers} = {1000 * per_step:6.2f} ms")
    print(f"  all matmuls of one step: {1000 * total:.2f} ms CPU")


def main() -> None:
    import hw_bounds  # sibling scripts
    from throughput import build_runs  # the same chat prompts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time is the work itself)")
    ap.add_argument("--model", default=None, help="deepinfer model (default: its built-in GGUF)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="phases in CPU time (both threads' sum, spin-waits included) or wall-clock time")
    ap.add_argument("--skip-steps", type=int, default=4, help="first steps left out (the prompts' prefill)")
    ap.add_argument("--workload", choices=["chat", "shared"], default="chat",
                    help="throughput.py's prompts: chat, or the same after a common ~400-token system prompt")
    hw_bounds.add_flag(ap)
    args = ap.parse_args()

    bounds = hw_bounds.RunBounds(args.model) if args.bounds else None  # before the engine, and again after

    from deepinfer import LLM

    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads, enable_prefix_caching=True,
              max_num_seqs=max(256, args.num_prompts))
    runs = build_runs(llm.get_tokenizer(), args.num_prompts, 1)[args.workload]
    print(f"dtype {llm.engine.core.runner.dtype}, {args.threads} thread(s), workload {args.workload}")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    rate = phase_profile(llm, runs[1], runs[0], args.max_tokens, args.skip_steps, clock)
    if bounds is not None:
        bounds.remeasure()
        print(f"{rate:.0f} tok/s wall: {bounds.of(rate, False, str(llm.engine.core.runner.dtype).removeprefix('torch.'))} "
              f"of the bound ({bounds.describe()})")
    gemm_profile(llm.engine.core.runner.model, args.num_prompts)


if __name__ == "__main__":
    main()
