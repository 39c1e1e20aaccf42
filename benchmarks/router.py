"""Routing policies side by side on one local cluster: round_robin, least_requests, deepinfer.

One run starts P prefill and D decode worker processes (sharing a KV store in a temp
directory), then, for each policy in turn (interleaved over --repeats rounds), a
`deepinfer router` process with that policy, and replays the same skewed workload through
it with streaming /v1/completions requests:

- `skewed`: many short prompts with a few huge ones among them (Poisson arrivals; one in ten is
  huge: `--huge-placement periodic` makes it every tenth request, which round-robin over an even
  number of workers sends to one worker every time; `random` draws each request huge with
  probability 0.1, so huge prompts sometimes arrive close together, as in real traffic);
- `sessions`: multi-turn sessions whose turns share a long prefix (each turn = the previous
  prompt + a new suffix), interleaved with short one-off prompts;
- `images`: short chat prompts, every fifth one with `--images-per-request` new random images (streaming
  /v1/chat/completions), on a vision-language model (default: `benchmarks/vision.py`'s SmolVLM-256M-shaped
  checkpoint, one 512 x 512 tile an image). The prefill workers run the vision tower (no encode workers);
  a tile costs as much as thousands of text tokens, so where the short prompts go decides their TTFT, which
  is reported apart from the image prompts' (`text_ttft_*`, `image_ttft_*`).

Each policy run uses its own cache salt, so no run reuses KV another run computed. Reported
per policy: TTFT p50 / p99, inter-token latency p50 / p99 (per streamed chunk), and load
imbalance max / mean over workers of (prefill) the estimated prefill seconds routed to each
and (decode) the KV tokens (prompt + max_tokens) routed to each; medians over repeats, ratios against round_robin.

    python benchmarks/router.py --model /path/to/model --workload skewed --repeats 3
    python benchmarks/router.py --workload images --decode-workers 1 --rate 0.8 --requests 40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from deepinfer.cluster.launcher import free_port, start_worker, stop_workers, worker_cpu_sets
from deepinfer.config import EngineConfig

POLICIES = ("round_robin", "least_requests", "deepinfer")


@dataclass
class Req:
    at: float  # seconds after the start
    prompt: list[int]
    max_tokens: int
    text: str = ""  # `images` workload: a chat prompt's text, and the seeds of its images
    images: tuple[int, ...] = ()


@dataclass
class Result:
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    error: str | None = None
    sent_at: float = 0.0  # wall clock (the router's routes carry the same clock)


def workload(kind: str, n: int, rate: float, seed: int, vocab: int, huge: int, small: int,
             max_tokens: int, huge_placement: str = "periodic", images_per_request: int = 2) -> list[Req]:
    rng = random.Random(seed)
    place = random.Random(seed + 1)  # its own stream, so `periodic` draws the same workload as it always did

    def ids(k: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(k)]

    t, out = 0.0, []
    if kind == "images":
        words = ("river", "lamp", "garden", "engine", "cloud", "market", "violin", "harbor", "pencil", "orbit")
        for i in range(n):
            t += rng.expovariate(rate)
            if i % 5 == 2:
                out.append(Req(t, [], max_tokens, f"Describe these pictures, number {i}.",
                               tuple(seed * 100_000 + i * 10 + j for j in range(images_per_request))))
            else:
                topic = " ".join(rng.choice(words) for _ in range(rng.randint(small // 8, small // 4)))
                out.append(Req(t, [], max_tokens, f"Request {i}: write one sentence about {topic}."))
        return out
    if kind == "skewed":
        for i in range(n):
            t += rng.expovariate(rate)
            is_huge = i % 10 == 3 if huge_placement == "periodic" else place.random() < 0.1
            size = huge if is_huge else rng.randint(small // 2, small)
            out.append(Req(t, ids(size), max_tokens))
        return out
    sessions = [ids(huge) for _ in range(max(1, n // 8))]  # each session's history grows turn by turn
    for i in range(n):
        t += rng.expovariate(rate)
        if i % 2 == 0:
            s = rng.randrange(len(sessions))
            sessions[s] = sessions[s] + ids(small // 2)
            out.append(Req(t, list(sessions[s]), max_tokens))
        else:
            out.append(Req(t, ids(rng.randint(small // 2, small)), max_tokens))
    return out


def _match_routes(reqs: list[Req], routes: list[dict], results: list[Result]) -> list[dict | None]:
    """The router's first routing decision for each request: the router logs them in the order it routes,
    which is arrival order except for near-simultaneous arrivals, so each request takes the first
    unclaimed decision for a prompt of its length (a swap among equal lengths changes nothing read here);
    a chat request (its length is the router's to know) the first unclaimed one routed after it was sent."""
    firsts = [r for r in routes if r["attempt"] == 0]
    taken = [False] * len(firsts)
    out: list[dict | None] = []
    for q, res in zip(reqs, results, strict=True):  # in arrival order
        def fits(r: dict, q: Req = q, res: Result = res) -> bool:
            return r["at"] >= res.sent_at - 0.01 if q.text else r["prompt_tokens"] == len(q.prompt)

        j = next((j for j, r in enumerate(firsts) if not taken[j] and fits(r)), None)
        if j is not None:
            taken[j] = True
        out.append(None if j is None else firsts[j])
    return out


def _placement(route: dict | None) -> tuple:
    if route is None:
        return (None, None, None, None, None)
    return (_port(route["prefill"]), round(route["prefill_queued_seconds"], 3), _port(route["decode"]),
            {_port(u): round(f, 3) for u, f in route.get("prefill_finishes", {}).items()},
            {_port(u): round(d.get("score", 0.0), 4) for u, d in route.get("decode_loads", {}).items()})


def _port(url: str) -> str:
    return url.rsplit(":", 1)[1]


def _image_url(seed: int) -> str:
    """A new random image (the size `benchmarks/vision.py` sends) as a PNG data URL."""
    import base64
    import io

    from vision import image

    buf = io.BytesIO()
    image(seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _request(req: Req, salt: str, model: str) -> tuple[str, dict]:
    """(path, body) of one streaming request: a completion of token ids, or a chat turn (`images` workload)."""
    body = {"max_tokens": req.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True, "cache_salt": salt}
    if not req.text:
        return "/v1/completions", {**body, "prompt": req.prompt}
    # new images in every run: the workers are shared by the runs, and keep encoded tiles by their digest
    run = zlib.crc32(salt.encode()) * 1_000_000
    content = [{"type": "image_url", "image_url": {"url": _image_url((run + s) % 2**32)}} for s in req.images]
    return "/v1/chat/completions", {**body, "model": model,
                                    "messages": [{"role": "user", "content": [*content, {"type": "text", "text": req.text}]}]}


def _has_token(event: dict) -> bool:
    """Whether a streamed event carries output (a chat stream opens with a role-only chunk)."""
    return any(c.get("text") or (c.get("delta") or {}).get("content") for c in event.get("choices", ()))


async def one(client: httpx.AsyncClient, base: str, at: float, path: str, body: dict, t0: float) -> Result:
    await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
    res = Result(sent_at=time.time())
    start = time.monotonic()
    last = None
    try:
        async with client.stream("POST", f"{base}{path}", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    res.error = line
                    return res
                if not _has_token(event):
                    continue
                now = time.monotonic()
                if last is None:
                    res.ttft = now - start
                else:
                    res.gaps.append(now - last)
                last = now
    except httpx.HTTPError as e:
        res.error = repr(e)
    return res


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def imbalance(values: list[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else float("nan")


def wait_healthy(base: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base} did not become healthy")


def run_policy(policy: str, args, prefill: list[str], decode: list[str], store: str, reqs: list[Req],
               salt: str) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "deepinfer.cli", "--log-level", "WARNING", "router", "--port", str(port),
           "--routing-policy", policy, "--kv-store", store, "--prefill", *prefill, "--decode", *decode,
           "--health-interval", "0.25"]
    if args.model:
        cmd += ["--model", args.model]
    router = subprocess.Popen(cmd)
    try:
        wait_healthy(base)
        while not all(w["alive"] for w in httpx.get(f"{base}/internal/workers").json()["workers"]):
            time.sleep(0.2)

        async def drive() -> list[Result]:
            async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10),
                                         limits=httpx.Limits(max_connections=None)) as client:
                model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
                requests = [_request(r, salt, model) for r in reqs]  # (images encoded before the clock starts)
                t0 = time.monotonic() + 0.2
                return await asyncio.gather(*(one(client, base, r.at, *q, t0) for r, q in zip(reqs, requests,
                                                                                              strict=True)))

        results = asyncio.run(drive())
        state = httpx.get(f"{base}/internal/workers", timeout=10).json()
        routes = _match_routes(reqs, httpx.get(f"{base}/internal/routes", timeout=10).json()["routes"], results)
    finally:
        router.terminate()
        router.wait(timeout=30)
    ok = [r for r in results if r.error is None and r.ttft is not None]
    ttft = [r.ttft for r in ok]
    gaps = [g for r in ok for g in r.gaps]
    ws = state["workers"]
    by_kind = {}
    if any(q.images for q in reqs):  # short prompts and image prompts apart
        for kind, has in (("text", False), ("image", True)):
            times = [r.ttft for q, r in zip(reqs, results, strict=True)
                     if bool(q.images) == has and r.error is None and r.ttft is not None]
            by_kind |= {f"{kind}_ttft_p50": pct(times, 0.5), f"{kind}_ttft_p99": pct(times, 0.99)}
    return {
        "policy": policy, "ok": len(ok), "errors": len(results) - len(ok),
        "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "itl_p50": pct(gaps, 0.5), "itl_p99": pct(gaps, 0.99),
        **by_kind,
        "prefill_imbalance": imbalance([w["prefill_seconds_routed"] for w in ws if w["role"] == "prefill"]),
        "decode_imbalance": imbalance([float(w["decode_tokens_routed"]) for w in ws if w["role"] == "decode"]),
        # every request: (arrival s, prompt tokens, TTFT s or None, prefill worker, its queued seconds as the
        # router saw them, decode worker, every prefill candidate's estimated finish, every decode candidate's
        # score (deepinfer), images), for reading what the tail is made of
        "requests": [(round(q.at, 3), route["prompt_tokens"] if q.text and route else len(q.prompt),
                      None if r.ttft is None else round(r.ttft, 3), *_placement(route), len(q.images))
                     for q, r, route in zip(reqs, results, routes, strict=True)],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Model (default: the default model).")
    p.add_argument("--workload", default="skewed", choices=["skewed", "sessions", "images"])
    p.add_argument("--images-per-request", type=int, default=2, help="images: images in every fifth request.")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=4.0, help="Mean arrivals per second.")
    p.add_argument("--huge", type=int, default=1500, help="Tokens of a huge prompt (sessions: of a shared prefix).")
    p.add_argument("--small", type=int, default=64, help="Tokens of a small prompt (at most).")
    p.add_argument("--huge-placement", default="periodic", choices=["periodic", "random"],
                   help="skewed: every tenth request huge, or each one with probability 0.1.")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prefill-workers", type=int, default=2)
    p.add_argument("--decode-workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--threads-per-worker", type=int, default=1)
    p.add_argument("--pin-workers", action="store_true",
                   help="Pin each worker to CPUs of its own, round-robin (as `serve --pin-workers`).")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    policies = args.policies.split(",")

    if args.workload == "images" and args.model is None:
        from vision import build_checkpoint

        args.model = str(build_checkpoint(Path.home() / ".cache/deepinfer/bench-smolvlm-256m-shape"))
    store = tempfile.mkdtemp(prefix="deepinfer-router-bench-")
    engine = EngineConfig.from_kwargs(model=args.model, num_threads=args.threads_per_worker, kv_store=store,
                                      kv_cache_memory="512MiB")
    prefill = [f"http://127.0.0.1:{free_port()}" for _ in range(args.prefill_workers)]
    decode = [f"http://127.0.0.1:{free_port()}" for _ in range(args.decode_workers)]
    roles = [(role, u) for role, us in (("prefill", prefill), ("decode", decode)) for u in us]
    cpu_sets = worker_cpu_sets(len(roles), args.threads_per_worker) if args.pin_workers else [None] * len(roles)
    procs = [start_worker(role, engine, int(u.rsplit(":", 1)[1]), cpus=cpus)
             for (role, u), cpus in zip(roles, cpu_sets, strict=True)]
    rows: dict[str, list[dict]] = {pol: [] for pol in policies}
    try:
        for u in prefill + decode:
            wait_healthy(u)
        from transformers import AutoConfig

        from deepinfer.weights import resolve_model

        vocab = AutoConfig.from_pretrained(str(resolve_model(args.model).directory)).get_text_config().vocab_size
        reqs = workload(args.workload, args.requests, args.rate, 0, vocab, args.huge, args.small, args.max_tokens,
                        args.huge_placement, args.images_per_request)
        for rep in range(args.repeats):
            for pol in policies:
                row = run_policy(pol, args, prefill, decode, store, reqs, salt=f"{pol}-{rep}-{os.getpid()}")
                rows[pol].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "requests"}), flush=True)
    finally:
        stop_workers(procs)
        shutil.rmtree(store, ignore_errors=True)  # every run's KV (each policy writes its own): gigabytes
    keys = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "prefill_imbalance", "decode_imbalance")
    kinds = ("text_ttft_p50", "text_ttft_p99", "image_ttft_p50", "image_ttft_p99")
    keys += kinds if args.workload == "images" else ()
    med = {pol: {k: statistics.median(r[k] for r in rows[pol]) for k in keys} for pol in policies}
    print(f"\nworkload={args.workload} requests={args.requests} rate={args.rate}/s huge={args.huge} "
          f"small<={args.small} placement={args.huge_placement} max_tokens={args.max_tokens} P={args.prefill_workers} D={args.decode_workers} "
          f"repeats={args.repeats} pin_workers={args.pin_workers} (medians; errors: {sum(r['errors'] for rs in rows.values() for r in rs)})")
    print("| policy | TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms | prefill imbalance | decode imbalance |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    ref = med.get("round_robin")
    for pol in policies:
        m = med[pol]
        ratio = f" ({m['ttft_p99'] / ref['ttft_p99']:.2f}x rr)" if ref and pol != "round_robin" else ""
        print(f"| {pol} | {m['ttft_p50']:.3f} | {m['ttft_p99']:.3f}{ratio} | {1000 * m['itl_p50']:.1f} | "
              f"{1000 * m['itl_p99']:.1f} | {m['prefill_imbalance']:.2f} | {m['decode_imbalance']:.2f} |")
    if args.workload == "images":
        print("\n| policy | short prompts' TTFT p50 / p99 s | image prompts' TTFT p50 / p99 s |\n| --- | --- | --- |")
        for pol in policies:
            m = med[pol]
            print(f"| {pol} | {m['text_ttft_p50']:.3f} / {m['text_ttft_p99']:.3f} | "
                  f"{m['image_ttft_p50']:.3f} / {m['image_ttft_p99']:.3f} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "runs": rows, "medians": med}, f, indent=2)
        from deepinfer.bench.plots import plot_after_run

        plot_after_run(args.json_out)  # TTFT / ITL per policy, next to the JSON
    return 0


if __name__ == "__main__":
    sys.exit(main())
