"""Standalone llama.cpp (``llama-cpp-python``) offline runner used as a baseline by
``benchmarks/throughput.py`` (issue #22: single stream against llama.cpp on the same GGUF).

Run it with the python of a venv that has ``llama-cpp-python`` (it must not import deepinfer)::

    "$LLAMACPP_PYTHON" benchmarks/baselines/llamacpp_runner.py spec.json

``spec.json``::

    {"gguf": "path/to/model.gguf", "n_threads": 2, "n_ctx": 2048, "max_tokens": 128,
     "contention": 0, "workloads": [{"name": "single", "runs": [warmup_prompts, rep1_prompts, ...]}]}

Prompts are token ids (the caller tokenizes with the model's HF tokenizer, so every engine gets the
same ids). llama.cpp's Python binding decodes one sequence at a time: a run's prompts go one after the
other, each from an empty context (``reset``), greedy (top-k 1), never stopping at EOS, exactly
``max_tokens`` new tokens. Every prompt is first evaluated in one ``eval`` call; ``decode_only`` (set
it where ``eval`` of a longer prompt crashes, as issue #22 saw on one machine) evaluates only the
prompt's first token, so only the decode rate is comparable.

The last stdout line is a JSON object shaped like ``vllm_runner.py``'s: ``{"engine": "llamacpp",
"load_s", "dtype", "workloads": {name: {"generated_tokens", "wall_s", "tok_per_s", "walls",
"num_prompts", "prompt_tokens", "token_ids", "decode_s_per_token"}}}``.
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


def _generate(llm: Any, prompt: list[int], max_tokens: int, decode_only: bool) -> tuple[list[int], float]:
    """Greedy `max_tokens` tokens after `prompt`; returns them and the seconds spent after the prompt."""
    llm.reset()
    llm.eval(prompt[:1] if decode_only else prompt)
    out: list[int] = []
    t = time.perf_counter()
    for _ in range(max_tokens):
        tok = int(llm.sample(top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0))
        out.append(tok)
        llm.eval([tok])
    return out, time.perf_counter() - t


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    from llama_cpp import Llama

    n_threads = int(spec.get("n_threads") or len(os.sched_getaffinity(0)))
    t0 = time.perf_counter()
    llm = Llama(model_path=spec["gguf"], n_ctx=int(spec.get("n_ctx", 2048)), n_threads=n_threads,
                n_threads_batch=n_threads, n_batch=512, verbose=False)
    load_s = time.perf_counter() - t0
    max_tokens = int(spec.get("max_tokens", 128))
    decode_only = bool(spec.get("decode_only", False))
    contention = int(spec.get("contention", 0))
    results: dict[str, Any] = {}
    for wl in spec["workloads"]:
        warm, timed = wl["runs"][0], wl["runs"][1:]
        for p in warm:
            _generate(llm, p, max_tokens, decode_only)
        walls: list[float] = []
        decode_per_token: list[float] = []
        outs: list[list[int]] = []
        for i, prompts in enumerate(timed):
            with spinning(contention if i % 2 else 0):
                t = time.perf_counter()
                outs, decode_s = [], 0.0
                for p in prompts:
                    ids, d = _generate(llm, p, max_tokens, decode_only)
                    outs.append(ids)
                    decode_s += d
                walls.append(time.perf_counter() - t)
                decode_per_token.append(decode_s / (max_tokens * len(prompts)))
        ntok = sum(map(len, outs))
        wall = statistics.median(walls)
        results[wl["name"]] = {
            "num_prompts": len(timed[-1]), "prompt_tokens": sum(map(len, timed[-1])), "generated_tokens": ntok,
            "wall_s": wall, "tok_per_s": ntok / wall, "walls": walls, "token_ids": outs,
            "decode_s_per_token": statistics.median(decode_per_token),
        }
        print(f"[llamacpp_runner] {wl['name']}: {ntok / wall:.1f} tok/s", file=sys.stderr, flush=True)
    return {"engine": "llamacpp", "dtype": "gguf", "n_threads": n_threads, "decode_only": decode_only,
            "load_s": load_s, "workloads": results}


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: llamacpp_runner.py SPEC.json")
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    result = _run(spec)
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
