"""Soak test: mixed API load against one `deepinfer serve` for a long time, watching for leaks.

Owns the long-running leak check of issue #16: ``--concurrency`` client loops each send one request
after another, drawn from a fixed mix (chat, completions, Responses, Anthropic Messages; streaming
and not; clients that hang up mid-stream; ``response_format`` json_schema; function tools with
``tool_choice: required``), for ``--duration`` seconds. Every ``--sample-every`` seconds it records
the resident memory (psutil RSS) of the server process and of the engine process (the server's
child that runs the engine loop), and ``deepinfer:kv_cache_blocks_used`` from /metrics; the table
is printed as it grows. At the end it waits for the load to drain and checks the server is back to
0 KV blocks in use, then prints the least-squares RSS slope (MiB/hour, warm-up samples excluded),
requests by kind and errors by kind. Exit status 1 when any request failed in a way its kind does
not allow (a deliberate disconnect is not a failure) or blocks stay in use after the drain.

Each request is checked, not only its status: a stream must end with its API's terminal event
(``[DONE]``, ``response.completed``, ``message_stop``), structured output must parse as JSON with
the schema's keys, a required tool choice must produce a tool call whose arguments parse.

Examples::

    python benchmarks/soak.py --duration 1200                         # starts its own server
    python benchmarks/soak.py --base-url http://127.0.0.1:8000 --server-pid 1234 --duration 600
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

_WORD_TEXT = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city")
WORDS = _WORD_TEXT.split()

SYSTEMS = [  # a few shared prefixes, so the prefix cache and the store see both hits and misses
    "You are a helpful assistant. Answer briefly and precisely.",
    "You are a careful travel agent. You always check dates and cities twice before you answer anything.",
    "You are a librarian who knows every book ever written and recommends one at a time.",
]

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

KINDS = ["chat", "chat_stream", "completions", "completions_stream", "responses", "responses_stream",
         "messages", "messages_stream", "disconnect", "json_schema", "tools"]


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120)))


class Failure(Exception):
    """A request that did not end the way its kind requires."""


async def _sse(client: httpx.AsyncClient, url: str, body: dict, stop_after: int | None = None) -> list[str]:
    """POST a streaming request; return its `data:` payloads (and `event:` names as 'event:NAME')."""
    out: list[str] = []
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise Failure(f"http_{r.status_code}")
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                out.append(line[6:])
            elif line.startswith("event: "):
                out.append("event:" + line[7:])
            if stop_after is not None and len(out) >= stop_after:
                return out  # leaving the context closes the connection mid-stream
    return out


async def _post(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    r = await client.post(url, json=body)
    if r.status_code != 200:
        raise Failure(f"http_{r.status_code}")
    return r.json()


def _check_openai_stream(events: list[str]) -> None:
    if not events or events[-1] != "[DONE]":
        raise Failure("stream_without_done")
    if any('"error"' in e for e in events):
        raise Failure("stream_error_event")


async def one_request(client: httpx.AsyncClient, base: str, model: str, kind: str, rng: random.Random) -> None:
    system = rng.choice(SYSTEMS)
    user = _prompt(rng)
    max_tokens = rng.randint(4, 48)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    chat = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": rng.choice([0, 0.8])}
    if kind == "chat":
        d = await _post(client, f"{base}/v1/chat/completions", chat)
        if d["choices"][0]["message"].get("content") is None:
            raise Failure("no_content")
    elif kind == "chat_stream":
        _check_openai_stream(await _sse(client, f"{base}/v1/chat/completions", {**chat, "stream": True}))
    elif kind == "completions":
        d = await _post(client, f"{base}/v1/completions", {"model": model, "prompt": system + " " + user,
                                                          "max_tokens": max_tokens})
        if d["usage"]["completion_tokens"] < 1:
            raise Failure("no_tokens")
    elif kind == "completions_stream":
        _check_openai_stream(await _sse(client, f"{base}/v1/completions", {
            "model": model, "prompt": system + " " + user, "max_tokens": max_tokens, "stream": True}))
    elif kind in ("responses", "responses_stream"):
        body = {"model": model, "instructions": system, "input": user, "max_output_tokens": max_tokens,
                "store": False}
        if kind == "responses":
            d = await _post(client, f"{base}/v1/responses", body)
            if d.get("status") not in ("completed", "incomplete"):
                raise Failure(f"responses_status_{d.get('status')}")
        else:
            events = await _sse(client, f"{base}/v1/responses", {**body, "stream": True})
            if not any(e in ("event:response.completed", "event:response.incomplete") for e in events):
                raise Failure("responses_stream_unfinished")
    elif kind in ("messages", "messages_stream"):
        body = {"model": model, "system": system, "messages": [{"role": "user", "content": user}],
                "max_tokens": max_tokens}
        if kind == "messages":
            d = await _post(client, f"{base}/v1/messages", body)
            if d.get("type") != "message":
                raise Failure("messages_bad_type")
        else:
            events = await _sse(client, f"{base}/v1/messages", {**body, "stream": True})
            if "event:message_stop" not in events:
                raise Failure("messages_stream_unfinished")
    elif kind == "disconnect":
        # a client that hangs up after a few chunks of a long answer: the server must free its KV
        await _sse(client, f"{base}/v1/chat/completions",
                   {**chat, "max_tokens": 400, "ignore_eos": True, "stream": True}, stop_after=rng.randint(1, 6))
    elif kind == "json_schema":
        d = await _post(client, f"{base}/v1/chat/completions", {
            **chat, "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user", "content": "Plan a trip: which city, how many days? " + user}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}})
        choice = d["choices"][0]
        if choice["finish_reason"] == "stop":  # a length cut leaves JSON unfinished, legitimately
            obj = json.loads(choice["message"]["content"])
            if set(obj) != {"city", "days"} or not isinstance(obj["days"], int):
                raise Failure("json_schema_violated")
    elif kind == "tools":
        d = await _post(client, f"{base}/v1/chat/completions", {
            **chat, "max_tokens": 64, "tools": TOOLS, "tool_choice": "required",
            "messages": [{"role": "user", "content": "What is the weather in Paris? " + user}]})
        choice = d["choices"][0]
        if choice["finish_reason"] == "tool_calls":
            for call in choice["message"]["tool_calls"]:
                json.loads(call["function"]["arguments"])
        elif choice["finish_reason"] != "length":
            raise Failure(f"tools_finish_{choice['finish_reason']}")
    else:
        raise ValueError(kind)


def _metric(text: str, name: str) -> float | None:
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    return total if found else None


def _engine_children(server: psutil.Process) -> list[psutil.Process]:
    out = []
    for p in server.children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            pass
    return out


def _rss_mib(procs: list[psutil.Process]) -> float:
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):  # an engine that just died has no RSS to add
            total += p.memory_info().rss
    return total / 2**20


def slope_per_hour(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over ts (seconds), per hour."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    return 3600 * sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var if var else 0.0


async def soak(args: argparse.Namespace, base: str, server: psutil.Process) -> int:
    async with httpx.AsyncClient(timeout=args.request_timeout) as c:
        model = (await c.get(f"{base}/v1/models")).json()["data"][0]["id"]
    counts: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    deadline = started + args.duration
    kinds = args.kinds.split(",") if args.kinds else KINDS

    async def worker(i: int) -> None:
        rng = random.Random(args.seed * 1000 + i)
        limits = httpx.Limits(max_connections=2)
        async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
            while time.monotonic() < deadline:
                kind = rng.choice(kinds)
                counts[kind] += 1
                try:
                    await one_request(client, base, model, kind, rng)
                except Failure as e:
                    errors[f"{kind}:{e}"] += 1
                except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
                    errors[f"{kind}:{type(e).__name__}"] += 1

    async def sampler() -> None:
        print(f"{'t_s':>6} {'server_MiB':>10} {'engine_MiB':>10} {'blocks':>6} {'requests':>8} {'errors':>6}",
              flush=True)
        async with httpx.AsyncClient(timeout=30) as client:
            while True:
                t = time.monotonic() - started
                try:
                    blocks = _metric((await client.get(f"{base}/metrics")).text, "deepinfer:kv_cache_blocks_used")
                except httpx.HTTPError:
                    blocks = None
                s = {"t": t, "server_mib": _rss_mib([server]), "engine_mib": _rss_mib(_engine_children(server)),
                     "blocks": blocks, "requests": sum(counts.values()), "errors": sum(errors.values())}
                samples.append(s)
                print(f"{t:6.0f} {s['server_mib']:10.1f} {s['engine_mib']:10.1f} {blocks!s:>6} "
                      f"{s['requests']:8d} {s['errors']:6d}", flush=True)
                if time.monotonic() >= deadline:
                    return
                await asyncio.sleep(min(args.sample_every, max(0.0, deadline - time.monotonic()) + 0.01))

    sampling = asyncio.create_task(sampler())
    await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
    await sampling
    # drained: every request has returned; blocks held by requests must be back to 0 (prefix-cached blocks
    # are free-but-cached, not in use). A disconnect is noticed on the next write, so allow a moment.
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(40):
            final_blocks = _metric((await client.get(f"{base}/metrics")).text, "deepinfer:kv_cache_blocks_used")
            if final_blocks == 0:
                break
            await asyncio.sleep(0.5)
    warm = [s for s in samples if s["t"] >= args.warmup] or samples
    ts = [s["t"] for s in warm]
    report = {
        "duration_s": args.duration, "concurrency": args.concurrency,
        "requests": dict(counts), "errors": dict(errors), "final_blocks_used": final_blocks,
        "server_rss_mib": {"start": warm[0]["server_mib"], "end": warm[-1]["server_mib"],
                           "max": max(s["server_mib"] for s in samples),
                           "slope_mib_per_hour": slope_per_hour(ts, [s["server_mib"] for s in warm])},
        "engine_rss_mib": {"start": warm[0]["engine_mib"], "end": warm[-1]["engine_mib"],
                           "max": max(s["engine_mib"] for s in samples),
                           "slope_mib_per_hour": slope_per_hour(ts, [s["engine_mib"] for s in warm])},
        "max_blocks_used": max((s["blocks"] or 0) for s in samples),
        "samples": samples,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 1 if errors or final_blocks != 0 else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", help="an already running server (else one is started)")
    ap.add_argument("--server-pid", type=int, help="pid of that server's process (for RSS sampling)")
    ap.add_argument("--server-args", default="--kv-cache-memory 256MiB --max-model-len 2048",
                    help="extra `deepinfer serve` flags when starting one")
    ap.add_argument("--kv-store", default="tmp", help="store dir for a started server: 'tmp' (a fresh temp dir, "
                    "removed at the end), 'none', or a path")
    ap.add_argument("--duration", type=float, default=1200.0, help="seconds of load")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--sample-every", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds left out of the slope")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--kinds", default="", help=f"comma list from {','.join(KINDS)} (default all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the report (with every sample) as JSON here")
    args = ap.parse_args()

    if args.base_url:
        if not args.server_pid:
            ap.error("--base-url needs --server-pid (RSS is sampled from that process and its children)")
        return asyncio.run(soak(args, args.base_url.rstrip("/"), psutil.Process(args.server_pid)))

    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store_dir = tempfile.mkdtemp(prefix="soak-kvstore-") if args.kv_store == "tmp" else args.kv_store
    cmd = [sys.executable, "-m", "deepinfer.cli", "--log-level", "WARNING", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--kv-store", store_dir, *args.server_args.split()]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("server did not become healthy")
            time.sleep(0.5)
        return asyncio.run(soak(args, base, psutil.Process(proc.pid)))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        if args.kv_store == "tmp":
            shutil.rmtree(store_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
