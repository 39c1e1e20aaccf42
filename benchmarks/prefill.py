"""Prompt throughput: deepinfer vs vLLM CPU on prompts alone (max_tokens = 1), and where deepinfer's time goes.

guidellm's synthetic requests (`serve_compare.sh`: 158 prompt tokens, 64 output) make a server spend about
half its time prefilling, so a server's output rate at many streams is as much a prefill rate as a decode
rate. This runs the same prompts (random token ids, seeded: `--num-prompts` x `--prompt-len`) through both
engines, one after the other in one invocation (vLLM in its own venv through a subprocess of this script),
best of `--repeats` after a warm-up, and prints prompt tokens per second and the ratio. Then deepinfer once
more with its model's phases timed by the wall clock (the four layer matmuls, the attention kernel, the rest
of the layers: norms, rotary, KV writes, SiLU, Python), with the matmuls' GFLOP/s.

    PYTHONPATH=. VLLM_PYTHON=~/venvs/vllm/bin/python python3 benchmarks/prefill.py
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WALLS = "prefill.py walls: "


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def time_runs(run, args: argparse.Namespace) -> list[float]:
    run(prompts(10_000, args.num_prompts, args.prompt_len))  # warm-up
    walls = []
    for i in range(args.repeats):
        ps = prompts(i, args.num_prompts, args.prompt_len)
        t = time.perf_counter()
        run(ps)
        walls.append(time.perf_counter() - t)
    return walls


def vllm_walls(args: argparse.Namespace) -> list[float]:
    """In vLLM's venv (this script with --engine vllm)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(args.model_dir, dtype=args.vllm_dtype, max_num_seqs=args.num_prompts, enable_prefix_caching=False,
              max_model_len=2048)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    return time_runs(lambda ps: llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sp, use_tqdm=False),
                     args)


def deepinfer_walls(args: argparse.Namespace) -> tuple[list[float], dict[str, float]]:
    import decode_profile

    from deepinfer import LLM, SamplingParams

    llm = LLM(None, max_num_seqs=args.num_prompts, kv_cache_memory="2GiB", enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=1, temperature=0.0)

    def run(ps: list[list[int]]) -> None:
        llm.generate([{"prompt_token_ids": p} for p in ps], sp)

    walls = time_runs(run, args)
    core = llm.engine.core
    model = core.runner.model
    acc: collections.Counter = collections.Counter()

    def wrap(obj, name: str, key: str) -> None:
        setattr(obj, name, decode_profile._timed(acc, key, getattr(obj, name), time.perf_counter))

    projections = [lin for layer in model.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                             layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    wrap(model, "hidden_states", "layers")
    for lin in projections:
        wrap(lin, "forward", "matmuls")
    for backend in {id(la.self_attn.backend): la.self_attn.backend for la in model.layers}.values():
        wrap(backend, "forward", "attention")
        if hasattr(backend, "attend_cached_rows"):
            wrap(backend, "attend_cached_rows", "attention")
    steps0 = core.num_steps
    t = time.perf_counter()
    run(prompts(0, args.num_prompts, args.prompt_len))
    acc["wall"] = time.perf_counter() - t
    acc["steps"] = core.num_steps - steps0
    macs = sum(lin.in_features * lin.out_features for lin in projections)  # the dense weight may be released
    acc["matmul_gflops"] = 2 * macs * args.num_prompts * args.prompt_len / max(acc["matmuls"], 1e-9) / 1e9
    return walls, dict(acc)


def main() -> None:
    import hw_bounds  # a sibling module (main puts the script's directory on sys.path); it loads no torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=158, help="guidellm's synthetic prompts in serve_compare.sh")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"), help="default: $VLLM_PYTHON (none: no vLLM)")
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--model-dir", default=os.environ.get("HF_MODEL_DIR"),
                    help="HF copy of the default model for vLLM (default: $HF_MODEL_DIR, else deepinfer's conversion)")
    ap.add_argument("--engine", choices=["deepinfer", "vllm"], default="deepinfer", help=argparse.SUPPRESS)
    hw_bounds.add_flag(ap)
    args = ap.parse_args()
    if args.engine == "vllm":  # the subprocess: its walls as JSON on a line of their own (vLLM logs around it)
        print(WALLS + json.dumps(vllm_walls(args)), flush=True)
        return
    bounds = hw_bounds.RunBounds() if args.bounds else None  # before the engines, and again after

    tokens = args.num_prompts * args.prompt_len
    walls, phases = deepinfer_walls(args)
    rates = {"deepinfer": tokens / min(walls)}
    if args.vllm_python:
        if args.model_dir is None:
            from deepinfer.weights import resolve_model

            args.model_dir = str(resolve_model(None).directory)
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{len(os.sched_getaffinity(0)) - 1}")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        cmd = [args.vllm_python, __file__, "--engine", "vllm", "--model-dir", args.model_dir, "--vllm-dtype",
               args.vllm_dtype, "--num-prompts", str(args.num_prompts), "--prompt-len", str(args.prompt_len),
               "--repeats", str(args.repeats)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=HERE)
        if proc.returncode:
            sys.exit(f"vLLM failed:\n{proc.stderr[-3000:]}")
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(WALLS))
        rates["vllm"] = tokens / min(json.loads(line[len(WALLS):]))
    if bounds is not None:
        bounds.remeasure()
        print(bounds.describe())
    print(f"{args.num_prompts} prompts x {args.prompt_len} tokens, max_tokens 1, best of {args.repeats}:")
    for name, rate in rates.items():
        dtype = args.vllm_dtype if name == "vllm" else None
        frac = f"  {bounds.of(rate, False, dtype)} of the compute bound" if bounds is not None else ""
        print(f"  {name:10s} {rate:8.1f} prompt tok/s{frac}")
    if "vllm" in rates:
        print(f"  deepinfer / vLLM {rates['deepinfer'] / rates['vllm']:.2f}x")
    wall = phases["wall"]
    print(f"deepinfer's phases (one more run, wall clock, {phases['steps']:.0f} steps, {wall * 1e3:.0f} ms):")
    rest = phases.get("layers", 0.0) - phases.get("matmuls", 0.0) - phases.get("attention", 0.0)
    for name, sec in (("layer matmuls", phases.get("matmuls", 0.0)), ("attention", phases.get("attention", 0.0)),
                      ("rest of the layers", rest), ("outside the layers", wall - phases.get("layers", 0.0))):
        print(f"  {name:20s} {sec * 1e3:8.1f} ms  {100 * sec / wall:5.1f}%")
    print(f"  layer matmuls at {phases['matmul_gflops']:.0f} GFLOP/s")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
