"""Cold start of an OpenAI-compatible server, side by side: seconds from launch until it answers /v1/models, and
until its first completion token, for deepinfer and vLLM on the same model (what autoscaling and a restart after
a crash cost a user).

Each repeat launches every engine once (the order alternates), polls until ready, sends one 1-token completion,
records the server's resident memory (process tree) and stops it. Prints the medians and deepinfer / vLLM ratios.

    VLLM_PYTHON=~/venvs/vllm/bin/python python benchmarks/startup.py --repeats 3 --json-out startup.json

deepinfer runs as `python -m deepinfer.cli serve` from whatever PYTHONPATH names first (`benchmarks/ab.py` runs
this script from two checkouts to compare them: `--engines deepinfer`); vLLM as its api_server (the CPU build),
on the default model's HF directory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil


def tree_rss(pid: int) -> int:
    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def command(engine: str, model_dir: str, port: int, dtype: str, vllm_eager: bool = False) -> tuple[list[str], dict]:
    env = dict(os.environ)
    if engine == "deepinfer":
        return [sys.executable, "-m", "deepinfer.cli", "serve", "--port", str(port), "--served-model-name", "m",
                "--dtype", dtype, "--kv-cache-memory", "2GiB"], env
    python = os.environ.get("VLLM_PYTHON")
    if not python:
        raise SystemExit("VLLM_PYTHON (the vLLM venv's python) is needed for --engines vllm")
    env.update(VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"), VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1")
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port", str(port),
            "--served-model-name", "m", "--dtype", dtype, *(["--enforce-eager"] if vllm_eager else [])], env


def one_start(engine: str, model_dir: str, port: int, dtype: str, log: Path, timeout: float,
              vllm_eager: bool = False) -> dict:
    cmd, env = command(engine, model_dir, port, dtype, vllm_eager)
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd="/tmp")
    base = f"http://127.0.0.1:{port}"
    try:
        ready = None
        while ready is None:
            if proc.poll() is not None:
                raise SystemExit(f"{engine} exited with {proc.returncode}; see {log}")
            if time.perf_counter() - started > timeout:
                raise SystemExit(f"{engine} not ready after {timeout} s; see {log}")
            try:
                if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                    ready = time.perf_counter() - started
            except httpx.HTTPError:
                time.sleep(0.1)
        rss = tree_rss(proc.pid)
        r = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 1,
                                                       "temperature": 0}, timeout=timeout)
        r.raise_for_status()
        first = time.perf_counter() - started
        return {"engine": engine, "ready_s": ready, "first_token_s": first, "rss_mib": rss / 2**20}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="deepinfer,vllm")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--port", type=int, default=8795)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM with --enforce-eager (no torch.compile at start).")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    from deepinfer.weights import resolve_model

    model_dir = str(resolve_model(None).directory)
    engines = args.engines.split(",")
    runs: list[dict] = []
    logs = Path("/tmp/startup-logs")
    logs.mkdir(exist_ok=True)
    for i in range(args.repeats):
        for engine in engines if i % 2 == 0 else engines[::-1]:
            run = one_start(engine, model_dir, args.port, args.dtype, logs / f"{engine}-{i}.log", args.timeout,
                            args.vllm_eager)
            runs.append(run)
            print(f"repeat {i + 1} {engine}: ready {run['ready_s']:.2f} s, first token {run['first_token_s']:.2f} s,"
                  f" RSS {run['rss_mib']:.0f} MiB", flush=True)
    summary = {}
    for engine in engines:
        mine = [r for r in runs if r["engine"] == engine]
        summary[engine] = {k: statistics.median(r[k] for r in mine) for k in ("ready_s", "first_token_s", "rss_mib")}
    print(f"\n| engine | ready (median of {args.repeats}) | first token | RSS when ready |")
    print("| --- | --- | --- | --- |")
    for engine, s in summary.items():
        print(f"| {engine} | {s['ready_s']:.2f} s | {s['first_token_s']:.2f} s | {s['rss_mib']:.0f} MiB |")
    if "deepinfer" in summary and "vllm" in summary:
        d, v = summary["deepinfer"], summary["vllm"]
        print(f"\ndeepinfer / vLLM: ready {d['ready_s'] / v['ready_s']:.2f}x the time, first token "
              f"{d['first_token_s'] / v['first_token_s']:.2f}x, RSS {d['rss_mib'] / v['rss_mib']:.2f}x")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"runs": runs, "summary": summary, "dtype": args.dtype,
                                                   "vllm_eager": args.vllm_eager}, indent=1))


if __name__ == "__main__":
    main()
