"""Overload benchmark (issue #16): what the admission bound buys when more load arrives than a server carries.

Starts two real `deepinfer serve` on the default model: one with the limits on (`--max-waiting-requests`
small), one with them off (`--max-waiting-requests` very large), with the same `--max-num-seqs`, and loads
them in turn (one at a time, levels interleaved).
What a server carries is `--max-num-seqs` concurrent streams; each level offers k times that many client
streams (k = 0.5, 1, 2, 4), closed loop for `--duration` seconds: every client sends a streaming completion
as soon as its previous one ended, and waits the Retry-After of a 429 before trying again. Closed loops
measure each level against the machine's speed at that moment, which matters on a shared machine whose
speed drifts within minutes. It prints one side-by-side table:

    client streams, offered / admitted / served req/s (attempts, non-429 answers and completed streams per
    second of wall time), 429 rate, p50 / p99 end-to-end latency and p99 time to first token of the
    completed requests, 5xx and other failures, peak RSS of the server (HTTP process + engine process)

Example (about 4 minutes on 2 cores)::

    python benchmarks/overload.py --max-num-seqs 4 --max-waiting-requests 2 --duration 20
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import psutil

_WORD_TEXT = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word")
WORDS = _WORD_TEXT.split()


@dataclass
class Rec:
    status: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    ok: bool = False
    retry_after: float = 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, waiting: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "deepinfer.cli", "--log-level", "WARNING", "serve", "--port", str(port),
           "--max-num-seqs", str(args.max_num_seqs), "--max-waiting-requests", str(waiting),
           "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", "2048", "--kv-store", "none",
           *args.server_args.split()]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {' '.join(cmd)}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("server did not come up")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def rss_bytes(pid: int) -> int:
    try:
        p = psutil.Process(pid)
        return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)])
    except psutil.Error:
        return 0


async def one(c: httpx.AsyncClient, prompt: str, max_tokens: int) -> Rec:
    rec, t0 = Rec(), time.perf_counter()
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    try:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                rec.retry_after = float(r.headers.get("retry-after", 1))
                return rec
            async for line in r.aiter_lines():
                if line.startswith("data: ") and not rec.ttft:
                    rec.ttft = time.perf_counter() - t0
                if line == "data: [DONE]":
                    rec.ok = True
    except httpx.HTTPError:
        rec.status = rec.status or -1
        rec.ok = False
    rec.e2e = time.perf_counter() - t0
    return rec


def prompts(rng: random.Random, n: int, words: int) -> list[str]:
    return [f"request {rng.random():.6f}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


async def offer(base: str, pid: int, streams: int, args: argparse.Namespace, rng: random.Random) -> dict:
    """`streams` closed-loop clients for --duration seconds; the requests admitted by then are waited for."""
    peak = rss_bytes(pid)
    stop = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, rss_bytes(pid))
            await asyncio.sleep(0.2)

    sampler = asyncio.create_task(sample())
    recs: list[Rec] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, timeout=900, limits=limits) as c:
        await one(c, "warm up", 2)
        t0 = time.perf_counter()

        async def client() -> None:
            while time.perf_counter() - t0 < args.duration:
                rec = await one(c, prompts(rng, 1, args.prompt_words)[0], args.output_tokens)
                recs.append(rec)
                if rec.status == 429:
                    await asyncio.sleep(rec.retry_after)
                elif not rec.ok:
                    await asyncio.sleep(0.1)  # no busy loop on a failing server

        await asyncio.gather(*(client() for _ in range(streams)))
        wall = time.perf_counter() - t0
    stop.set()
    await sampler
    admitted = [r for r in recs if r.status != 429]
    served = [r for r in recs if r.ok]
    lat = sorted(r.e2e for r in served)
    ttft = sorted(r.ttft for r in served)
    return {"streams": streams, "offered": len(recs) / wall, "admitted": len(admitted) / wall,
            "served": len(served) / wall, "r429": 1 - len(admitted) / max(len(recs), 1),
            "p50": _pct(lat, 50), "p99": _pct(lat, 99), "ttft99": _pct(ttft, 99),
            "5xx": sum(r.status >= 500 for r in recs),
            "other": sum(not r.ok and r.status != 429 and r.status < 500 for r in recs),
            "rss": peak / 2**20, "wall": wall, "n": len(recs)}


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def run(args: argparse.Namespace) -> None:
    rows: dict[tuple[str, float], dict] = {}
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        # both servers up at once, their levels interleaved: the machine's drift hits both alike
        for label, waiting in (("on", args.max_waiting_requests), ("off", 10**9)):
            servers[label] = start_server(args, waiting)
        rng = random.Random(args.seed)
        for k in args.levels:
            for label, (proc, base) in servers.items():
                streams = max(1, round(k * args.max_num_seqs))
                rows[(label, k)] = asyncio.run(offer(base, proc.pid, streams, args, rng))
                print(f"limits {label} {k}x: {rows[(label, k)]}", file=sys.stderr, flush=True)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    print(f"machine load average at the end (1/5/15 min): {' / '.join(f'{x:.1f}' for x in os.getloadavg())} on "
          f"{os.cpu_count()} CPUs")
    print(f"--max-num-seqs {args.max_num_seqs}; limits on: --max-waiting-requests {args.max_waiting_requests}; "
          f"limits off: --max-waiting-requests 1000000000; {args.prompt_words}-word prompts, {args.output_tokens} "
          f"output tokens, {args.duration:.0f} s closed loop per level\n")
    head = ("| load | limits | client streams | offered req/s | admitted req/s | served req/s | 429 | p50 s | p99 s "
            "| p99 TTFT s | 5xx | other failures | peak RSS MiB |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for k in args.levels:
        for label in ("on", "off"):
            r = rows[(label, k)]
            print(f"| {k:g}x | {label} | {r['streams']} | {r['offered']:.2f} | {r['admitted']:.2f} | {r['served']:.2f} "
                  f"| {r['r429']:.0%} | {r['p50']:.2f} | {r['p99']:.2f} | {r['ttft99']:.2f} | {r['5xx']} | "
                  f"{r['other']} | {r['rss']:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-waiting-requests", type=int, default=2, help="The bound with limits on.")
    p.add_argument("--levels", type=float, nargs="+", default=[0.5, 1, 2, 4], help="Client streams / --max-num-seqs.")
    p.add_argument("--duration", type=float, default=20.0, help="Seconds of closed-loop load per level.")
    p.add_argument("--prompt-words", type=int, default=48)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--server-args", default="", help="More `deepinfer serve` flags (e.g. --model PATH).")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    os.environ.setdefault("DEEPINFER_KV_STORE", "none")
    run(args)


if __name__ == "__main__":
    main()
