"""Offline throughput with LoRA adapters: deepinfer against vLLM (CPU), side by side in one run.

Workloads (``throughput.py``'s chat prompts, tagged per run so no whole prompt is cached; greedy, ``ignore_eos``,
``--max-tokens`` each), both engines started with adapters enabled:

* ``base``  -- no adapter;
* ``one``   -- every prompt with adapter 0;
* ``mixed`` -- the prompts round-robin over ``--num-adapters`` adapters (``max_loras`` = that many, so all run
  together).

The adapters are random (rank ``--rank``, all seven projections, small weights so the text stays text), written
by peft itself (``save_pretrained``) on the HF copy of the default model. ``--rounds`` alternate the engines
(deepinfer's workloads, then vLLM's in its venv), each round timing every workload ``--repeats`` times after a
warm-up; the table takes the median of all timed runs of a workload. It prints tok/s, deepinfer / vLLM, each
engine's LoRA workloads over its own ``base``, and how many prompts' tokens the two engines agree on. With
``--check`` (default on), the first prompt of ``one`` is checked against peft's model of the same adapter.

Usage::

    HF_HUB_OFFLINE=1 VLLM_PYTHON=~/venvs/vllm/bin/python python benchmarks/lora.py --rounds 2 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
USER_ENV = dict(os.environ)

from throughput import build_runs, run_baseline  # noqa: E402 - a sibling script (its directory is on sys.path)

import deepinfer  # noqa: E402,F401 - before anything loads torch, so this process gets its OpenMP settings

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(model_dir: str, out: Path, count: int, rank: int) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(count):
        path = out / f"adapter{i}"
        if not (path / "adapter_model.safetensors").exists():
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS,
                                                    lora_dropout=0.0))
            gen = torch.Generator().manual_seed(100 + i)
            with torch.no_grad():
                for name, p in peft.named_parameters():
                    if "lora_" in name:
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.03)
            peft.save_pretrained(str(path))
        paths.append(path)
    return paths


def workloads(runs: list[list[list[int]]], count: int) -> dict[str, tuple[list[list[list[int]]], list[int | None]]]:
    n = len(runs[0])
    return {"base": (runs, [None] * n), "one": (runs, [0] * n), "mixed": (runs, [i % count for i in range(n)])}


def run_deepinfer(args: argparse.Namespace, loads: dict, paths: list[Path]) -> dict[str, dict[str, Any]]:
    from deepinfer import LLM, SamplingParams
    from deepinfer.lora import LoRARequest

    llm = LLM(dtype=args.dtype, kv_cache_memory=f"{args.kv_gib}GiB", max_model_len=2048, enable_lora=True,
              max_loras=len(paths), max_lora_rank=args.rank, max_cpu_loras=len(paths))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    requests = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    out = {}
    for name, (runs, chosen) in loads.items():
        lrs = [None if c is None else requests[c] for c in chosen]
        llm.generate(runs[0], params, lora_request=lrs)
        walls, ids = [], []
        for prompts in runs[1:]:
            t = time.perf_counter()
            res = llm.generate(prompts, params, lora_request=lrs)
            walls.append(time.perf_counter() - t)
            ids = [list(r.outputs[0].token_ids) for r in res]
        out[name] = {"walls": walls, "tokens": sum(map(len, ids)), "token_ids": ids}
        print(f"  deepinfer {name:6s} {out[name]['tokens'] / statistics.median(walls):7.1f} tok/s", file=sys.stderr,
              flush=True)
    del llm
    return out


def run_vllm(args: argparse.Namespace, loads: dict, paths: list[Path]) -> dict[str, dict[str, Any]]:
    spec = {"model": args.model_dir, "max_tokens": args.max_tokens, "ignore_eos": True, "dtype": args.dtype,
            "enforce_eager": args.vllm_eager, "enable_prefix_caching": True, "max_model_len": 2048,
            "kv_cache_gib": args.kv_gib, "return_token_ids": True,
            "lora": {"adapters": [{"name": f"adapter{i}", "path": str(p)} for i, p in enumerate(paths)],
                     "max_loras": len(paths), "max_lora_rank": args.rank},
            "workloads": [{"name": n, "runs": runs, "adapters": chosen} for n, (runs, chosen) in loads.items()]}
    env = dict(USER_ENV, HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{len(os.sched_getaffinity(0)) - 1}")
    res = run_baseline(args.vllm_python, "vllm_runner.py", spec, env, args.vllm_timeout, args.vllm_log)
    out = {}
    for name, w in res["workloads"].items():
        out[name] = {"walls": w["walls"], "tokens": w["generated_tokens"], "token_ids": w["token_ids"]}
        print(f"  vllm      {name:6s} {w['tok_per_s']:7.1f} tok/s", file=sys.stderr, flush=True)
    return out


def check_against_peft(args: argparse.Namespace, prompt: list[int], got: list[int], adapter: Path) -> bool:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    base.generation_config.eos_token_id = None
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=len(got), do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist() == got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="both engines' dtype (vLLM CPU's best here is float32 on an "
                    "AVX2 machine, bfloat16 where AVX-512 BF16 exists)")
    ap.add_argument("--kv-gib", type=float, default=2.0)
    ap.add_argument("--model-dir", default=os.environ.get("HF_MODEL_DIR"),
                    help="the default model's HF copy (default: deepinfer's conversion)")
    ap.add_argument("--adapter-dir", default=None, help="where the adapters are written (default: a temp dir)")
    ap.add_argument("--engines", default="deepinfer,vllm")
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"))
    ap.add_argument("--vllm-eager", action="store_true")
    ap.add_argument("--vllm-timeout", type=int, default=3600)
    ap.add_argument("--vllm-log", default=None)
    ap.add_argument("--no-check", dest="check", action="store_false")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from deepinfer.weights import resolve_model

    args.model_dir = args.model_dir or str(resolve_model(None).directory)
    engines = args.engines.split(",")
    if "vllm" in engines and not args.vllm_python:
        sys.exit("vLLM needs --vllm-python or $VLLM_PYTHON")
    adapter_root = Path(args.adapter_dir or tempfile.mkdtemp(prefix="deepinfer-lora-bench-"))
    paths = write_adapters(args.model_dir, adapter_root, args.num_adapters, args.rank)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    runs = build_runs(tok, args.num_prompts, args.repeats)["chat"]
    loads = workloads(runs, args.num_adapters)
    results: dict[str, dict[str, dict[str, Any]]] = {e: {} for e in engines}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for engine in engines:
            got = run_deepinfer(args, loads, paths) if engine == "deepinfer" else run_vllm(args, loads, paths)
            for name, w in got.items():
                acc = results[engine].setdefault(name, {"walls": [], "tokens": w["tokens"]})
                acc["walls"] += w["walls"]
                acc["token_ids"] = w["token_ids"]
    rate = {e: {n: w["tokens"] / statistics.median(w["walls"]) for n, w in res.items()} for e, res in results.items()}
    print(f"\n{args.num_prompts} chat prompts x {args.max_tokens} tokens, {args.num_adapters} adapters of rank "
          f"{args.rank} (all 7 projections), {args.dtype}; medians of {args.rounds} rounds x {args.repeats} runs\n")
    head = "| workload | " + " | ".join(f"{e} tok/s" for e in engines)
    head += " | deepinfer / vLLM | same tokens |" if len(engines) == 2 else " |"
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    for name in loads:
        row = f"| {name} | " + " | ".join(f"{rate[e][name]:.1f} ({rate[e][name] / rate[e]['base']:.2f} of base)"
                                          for e in engines)
        if len(engines) == 2:
            a, b = (results[e][name]["token_ids"] for e in engines)
            same = sum(x == y for x, y in zip(a, b, strict=True))
            row += f" | **{rate[engines[0]][name] / rate[engines[1]][name]:.2f}x** | {same}/{len(a)} |"
        else:
            row += " |"
        print(row)
    checked = None
    if args.check and "deepinfer" in engines:
        checked = check_against_peft(args, runs[-1][0], results["deepinfer"]["one"]["token_ids"][0], paths[0])
        print(f"\ndeepinfer's first `one` reply equals peft's: {checked}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "rates": rate, "walls": {
            e: {n: w["walls"] for n, w in res.items()} for e, res in results.items()}, "peft_check": checked},
            indent=1))


if __name__ == "__main__":
    main()
