"""Standalone vLLM (CPU) offline throughput runner used as a baseline by
``benchmarks/throughput.py``.

Run it with the *vLLM venv's* python (it must not import deepinfer)::

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \\
    VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 \\
    "$VLLM_PYTHON" benchmarks/baselines/vllm_runner.py spec.json

``spec.json`` (only ``model`` and ``workloads``/``prompts`` are required)::

    {"model": "path/to/hf-model-dir",
     "workloads": [{"name": "chat", "prompts": [[1, 2, 3], ...]},
                   {"name": "x", "runs": [warmup_prompts, rep1_prompts, ...]}],
     "max_tokens": 128, "ignore_eos": true, "dtype": "float32",
     "enforce_eager": false, "repeats": 3, "warmup": true,
     "max_num_seqs": 256, "max_num_batched_tokens": null,
     "enable_prefix_caching": true, "max_model_len": 2048,
     "kv_cache_gib": 4, "return_token_ids": false, "contention": 0,
     "lora": {"adapters": [{"name": "a", "path": "..."}], "max_loras": 4, "max_lora_rank": 8}}

With ``lora``, a workload may give ``adapters``: per prompt the index of the adapter it runs with (null: the base
model), the same for the warm-up and every repeat.

``contention`` N > 0: every second timed run (the 2nd, 4th, ...) has N processes spinning beside
it (``benchmarks/spinners.py``); the caller splits the walls into quiet and contended.

A workload gives either ``prompts`` (used for the warm-up and every repeat) or
``runs`` (``runs[0]`` is the warm-up, ``runs[1:]`` the timed repeats).

The last stdout line is a JSON object: ``{"engine": "vllm", "load_s": ...,
"workloads": {name: {"generated_tokens", "wall_s", "tok_per_s", "walls",
"num_prompts", "prompt_tokens"[, "token_ids"]}}}``.  Generation is greedy
(temperature 0); ``wall_s`` is the median over ``repeats`` timed runs.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/spinners.py (standard library only)
from spinners import spinning  # noqa: E402


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        ncpu = len(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{ncpu - 1}"

    from vllm import LLM, SamplingParams

    workloads = spec.get("workloads") or [{"name": "default", "prompts": spec["prompts"]}]
    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "dtype": spec.get("dtype", "float32"),
        "enforce_eager": bool(spec.get("enforce_eager", False)),
        "max_num_seqs": int(spec.get("max_num_seqs", 256)),
        "enable_prefix_caching": bool(spec.get("enable_prefix_caching", True)),
        "max_model_len": int(spec.get("max_model_len", 2048)),
        "kv_cache_memory_bytes": int(float(spec.get("kv_cache_gib", 4)) * 2**30),
        "seed": 0,
    }
    if spec.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = int(spec["max_num_batched_tokens"])
    if spec.get("skip_tokenizer_init"):
        kwargs["skip_tokenizer_init"] = True
    lora = spec.get("lora")
    lora_requests: list[Any] = []
    if lora:
        from vllm.lora.request import LoRARequest

        kwargs.update(enable_lora=True, max_loras=int(lora.get("max_loras", 1)),
                      max_lora_rank=int(lora.get("max_lora_rank", 16)))
        lora_requests = [LoRARequest(a["name"], i + 1, a["path"]) for i, a in enumerate(lora["adapters"])]

    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t0

    params = SamplingParams(
        max_tokens=int(spec.get("max_tokens", 128)),
        temperature=0.0,
        ignore_eos=bool(spec.get("ignore_eos", True)),
        detokenize=False,
    )
    repeats = max(1, int(spec.get("repeats", 3)))  # only for workloads given as "prompts"
    results: dict[str, Any] = {}
    for wl in workloads:
        if "runs" in wl:
            runs = [[{"prompt_token_ids": list(p)} for p in ps] for ps in wl["runs"]]
            warm, timed = runs[0], runs[1:]
        else:
            warm = [{"prompt_token_ids": list(p)} for p in wl["prompts"]]
            timed = [warm] * repeats
        chosen = wl.get("adapters")
        adapters = None if chosen is None else [None if i is None else lora_requests[i] for i in chosen]
        if spec.get("warmup", True):
            llm.generate(warm, params, use_tqdm=False, lora_request=adapters)
        walls: list[float] = []
        ntok = 0
        outs: list[Any] = []
        contention = int(spec.get("contention", 0))
        for i, prompts in enumerate(timed):
            if spec.get("reset_prefix_cache", False):
                llm.reset_prefix_cache()
            with spinning(contention if i % 2 else 0):
                t = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False, lora_request=adapters)
                walls.append(time.perf_counter() - t)
            ntok = sum(len(o.outputs[0].token_ids) for o in outs)
        wall = statistics.median(walls)
        res: dict[str, Any] = {
            "num_prompts": len(timed[-1]),
            "prompt_tokens": sum(len(p["prompt_token_ids"]) for p in timed[-1]),
            "generated_tokens": ntok,
            "wall_s": wall,
            "tok_per_s": ntok / wall if wall > 0 else 0.0,
            "walls": walls,
        }
        if spec.get("return_token_ids"):
            res["token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
        results[wl["name"]] = res
        print(f"[vllm_runner] {wl['name']}: {res['tok_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return {
        "engine": "vllm",
        "dtype": str(llm.llm_engine.model_config.dtype),  # resolved ("auto" -> what vLLM picked)
        "enforce_eager": kwargs["enforce_eager"],
        "load_s": load_s,
        "workloads": results,
    }


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: vllm_runner.py SPEC.json")
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    result = _run(spec)
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
