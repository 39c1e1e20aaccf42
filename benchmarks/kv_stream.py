"""KV transfer overlap: how long a decode worker keeps a long prompt's request waiting after its first token.

Starts one local cluster (`deepinfer serve --prefill-workers 1 --decode-workers 1`, the default model
unless --model) and sends, one at a time, streamed /v1/completions with fresh random prompts of each
length (no cache hits). Per length, medians over --repeats requests of:

- TTFT: request sent -> first token (the prefill worker's first token, through the router);
- first -> second token: the KV that was not yet at the decode worker, plus its first decode step;
- the decode worker's `blocks_imported_before_decode` share (from its /internal/load counters).

Run it on two trees (e.g. before / after a change) with the same arguments to compare:

    PYTHONPATH=$PWD python benchmarks/kv_stream.py --lengths 512,1024,2000 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

import httpx

from deepinfer.cluster.launcher import free_port


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the cluster exited with {proc.returncode}")
        try:
            ws = httpx.get(f"{base}/internal/workers", timeout=2).json()["workers"]
            if ws and all(w["alive"] for w in ws):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise TimeoutError("the cluster did not come up")


def one(base: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    times = []
    start = time.monotonic()
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                times.append(time.monotonic())
    return times[0] - start, times[1] - times[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--lengths", default="512,1024,2000")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads-per-worker", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="The workers' step token budget (prefill chunk size); default: the engine's.")
    p.add_argument("--label", default="")
    args = p.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "deepinfer.cli", "--log-level", "WARNING", "serve", "--port", str(port),
           "--prefill-workers", "1", "--decode-workers", "1", "--num-threads", str(args.threads_per_worker),
           "--kv-store", "none", "--kv-cache-memory", "512MiB"]
    if args.model:
        cmd += ["--model", args.model]
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rng = random.Random(0)
    rows = []
    try:
        wait_ready(base, proc)
        decoder = next(w["url"] for w in httpx.get(f"{base}/internal/workers").json()["workers"]
                       if w["role"] == "decode")
        one(base, [rng.randrange(100, 40000) for _ in range(64)], 2)  # warm-up
        for n in map(int, args.lengths.split(",")):
            ttft, gap, early = [], [], []
            for _ in range(args.repeats):
                before = httpx.get(f"{decoder}/internal/load").json()
                a, b = one(base, [rng.randrange(100, 40000) for _ in range(n)], 4)
                after = httpx.get(f"{decoder}/internal/load").json()
                ttft.append(a)
                gap.append(b)
                got = after.get("blocks_imported", 0) - before.get("blocks_imported", 0)
                pre = after.get("blocks_imported_before_decode", 0) - before.get("blocks_imported_before_decode", 0)
                early.append(pre / got if got else float("nan"))
            rows.append((n, statistics.median(ttft), statistics.median(gap), statistics.median(early)))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(f"\n{args.label} (medians of {args.repeats}; one request at a time; 1P + 1D, "
          f"{args.threads_per_worker} thread(s) per worker, step token budget "
          f"{args.max_num_batched_tokens or 'default'})")
    print("| prompt tokens | TTFT s | first -> second token s | blocks imported before decode |")
    print("| --- | --- | --- | --- |")
    for n, a, b, e in rows:
        print(f"| {n} | {a:.3f} | {b:.3f} | {'n/a' if e != e else f'{100 * e:.0f}%'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
