"""Closed-loop streaming load client for any OpenAI-compatible server (deepinfer, vLLM, ...).

``--concurrency`` workers each keep one streaming request in flight until ``--num-requests``
have been sent.  Prompts are ~``--prompt-tokens`` words from a fixed word list (deterministic per
``--seed``; an optional common ``--shared-prefix-tokens`` head exercises prefix caching), and every
request asks for exactly ``--output-tokens`` (``max_tokens`` + ``ignore_eos``).

Per request it records TTFT, inter-token latency (gaps between content chunks; a chunk may carry
more than one token), end-to-end latency and the usage chunk's token counts.  A request counts as
failed on an HTTP error, an in-band error event, a missing ``[DONE]`` or usage chunk, or fewer
tokens than asked; the failure count is printed and the exit status is 1 when it is non-zero.

``--contention N`` keeps N processes spinning (``python -c "while True: pass"``) beside the server for
the timed part of each run (not the warm-up): the co-located-load case of issue #22. Run once without
and once with it (or ``--compare`` two server commands under it) to see what the load costs.

Prompts repeat for a given seed: change ``--seed`` between runs against one live server, or the
prefix cache will serve whole prompts from the previous run.

Examples::

    python benchmarks/serve_load.py --base-url http://127.0.0.1:8000 --concurrency 16 --num-requests 64
    python benchmarks/serve_load.py --compare --labels deepinfer,vllm --base-url http://127.0.0.1:8011 \\
        --server-cmd "deepinfer serve --port 8011 --kv-cache-memory 1GiB" \\
        --server-cmd "HF_HUB_OFFLINE=1 $VLLM_PYTHON -m vllm.entrypoints.openai.api_server \\
            --model $HF_MODEL_DIR --port 8011 --dtype float32"

(``$VLLM_PYTHON``: the vLLM venv's python; ``$HF_MODEL_DIR``: an HF copy of the model, e.g. deepinfer's
own conversion of the default model; see BENCHMARKS.md. ``--server-cmd`` runs through a shell.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import hw_bounds  # sibling modules: the script's directory is on sys.path
from spinners import spinning

_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word "
    "business issue side kind head house service friend father power hour game line end member law car "
    "city community name president team minute idea kid body information back parent face others level "
    "office door health person art war history party result change morning reason research girl guy "
    "moment air teacher force education river market garden window music paper light color"
)
WORDS = _WORD_TEXT.split()


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0


def make_prompts(n: int, prompt_tokens: int, shared: int, seed: int) -> list[str]:
    """``n`` prompts of ~``prompt_tokens`` words; the first ``shared`` words are common to all."""
    rng = random.Random(seed)
    head = [rng.choice(WORDS) for _ in range(min(shared, prompt_tokens))]
    out = []
    for i in range(n):  # "request {i}:" is 3 + len(str(i)) tokens for SmolLM2/Llama-style tokenizers
        tail = max(prompt_tokens - len(head) - 3 - len(str(i)), 0)
        out.append(" ".join([*head, f"request {i}:", *(rng.choice(WORDS) for _ in range(tail))]))
    return out


def pct(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); nan for an empty list."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, model: str, prompt: str,
                      max_tokens: int) -> Result:
    chat = args.endpoint == "chat"
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": args.temperature}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    url = "/v1/chat/completions" if chat else "/v1/completions"
    r = Result()
    done = False
    last = t0 = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                r.error = f"HTTP {resp.status_code}: {text}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    r.error = f"error event: {str(obj['error'])[:200]}"
                    return r
                if obj.get("usage"):
                    r.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
                    r.output_tokens = obj["usage"].get("completion_tokens", 0)
                for ch in obj.get("choices") or []:
                    text = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                    if text:
                        now = time.perf_counter()
                        if r.ttft == 0.0:
                            r.ttft = now - t0
                        else:
                            r.itls.append(now - last)
                        last = now
    except Exception as e:  # noqa: BLE001 - any transport/parse failure counts as a failed request
        r.error = f"{type(e).__name__}: {e}"[:200]
        return r
    r.e2e = time.perf_counter() - t0
    if not done:
        r.error = "stream ended without [DONE]"
    elif r.output_tokens == 0:
        r.error = "no usage chunk"
    elif r.output_tokens < max_tokens:
        r.error = f"short output: {r.output_tokens} < {max_tokens} tokens"
    r.ok = not r.error
    return r


async def first_model(client: httpx.AsyncClient) -> str:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


def session_cpu(sid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the processes in session `sid` (a server started with
    ``start_new_session``), by role: "engine" for multiprocessing children (deepinfer's engine process),
    "frontend" for the rest (the HTTP server; a shell wrapper adds ~0)."""
    tick = os.sysconf("SC_CLK_TCK")
    totals = {"frontend": 0.0, "engine": 0.0}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) != sid:  # fields after "(comm)": state, ppid, pgrp, session, ...
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        role = "engine" if b"multiprocessing" in cmdline else "frontend"
        totals[role] += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return totals


async def run_load(args: argparse.Namespace, server_sid: int | None = None) -> dict[str, Any]:
    """Run the configured load against ``args.base_url``; return the summary dict. With `server_sid` (the
    session of a server this script started) it also reports the server's CPU time per output token."""
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    async with httpx.AsyncClient(base_url=args.base_url, limits=limits, timeout=timeout) as client:
        model = args.model or await first_model(client)
        if args.warmup:
            warm = make_prompts(args.warmup, args.prompt_tokens, 0, args.seed + 1_000_003)
            await asyncio.gather(*(one_request(client, args, model, p, 4) for p in warm))
        prompts = make_prompts(args.num_requests, args.prompt_tokens, args.shared_prefix_tokens, args.seed)
        results: list[Result] = []
        pending = iter(prompts)

        async def worker() -> None:
            for p in pending:  # one shared iterator: each prompt goes to exactly one worker
                results.append(await one_request(client, args, model, p, args.output_tokens))

        with spinning(args.contention):
            cpu0 = session_cpu(server_sid) if server_sid is not None else None
            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            wall = time.perf_counter() - t0
        cpu = {k: v - cpu0[k] for k, v in session_cpu(server_sid).items()} if cpu0 is not None else None
    good = [r for r in results if r.ok]
    ttfts = [r.ttft for r in good]
    itls = [x for r in good for x in r.itls]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    reasons = Counter(r.error.split(":")[0] for r in results if not r.ok)
    out_tokens = sum(r.output_tokens for r in good)
    return {
        "model": model, "base_url": args.base_url, "endpoint": args.endpoint, "concurrency": args.concurrency,
        "num_requests": args.num_requests, "prompt_tokens_target": args.prompt_tokens,
        "output_tokens_target": args.output_tokens, "shared_prefix_tokens": args.shared_prefix_tokens,
        "seed": args.seed, "contention": args.contention, "wall_s": wall, "completed": len(good),
        "failed": len(results) - len(good),
        "failure_reasons": dict(reasons),
        "failure_examples": [r.error for r in results if not r.ok][:3],
        "mean_prompt_tokens": sum(r.prompt_tokens for r in good) / max(len(good), 1),
        "ttft_p50_ms": pct(ttfts, 50) * 1e3, "ttft_p90_ms": pct(ttfts, 90) * 1e3,
        "ttft_p99_ms": pct(ttfts, 99) * 1e3,
        "itl_p50_ms": pct(itls, 50) * 1e3, "itl_p99_ms": pct(itls, 99) * 1e3,
        "tpot_p50_ms": pct(tpots, 50) * 1e3,
        "e2e_p50_s": pct([r.e2e for r in good], 50), "e2e_p99_s": pct([r.e2e for r in good], 99),
        "output_tok_per_s": out_tokens / wall, "requests_per_s": len(good) / wall,
        # prompt and output tokens alike: a prompt token costs the matmuls a decoded one does
        "all_tok_per_s": (out_tokens + sum(r.prompt_tokens for r in good)) / wall,
        # CPU time the server spent per 1000 output tokens (NaN when the server was not started here):
        # unlike wall-clock rates it barely moves with other load on the machine
        **{f"cpu_ms_per_token_{role}": (cpu[role] * 1e3 / max(out_tokens, 1)) if cpu else float("nan")
           for role in ("frontend", "engine")},
        "requests": [asdict(r) | {"itls": None, "itl_count": len(r.itls)} for r in results],
    }


METRICS = [
    ("completed", "completed", "{:.0f}"), ("failed", "failed", "{:.0f}"),
    ("mean_prompt_tokens", "prompt tokens (mean)", "{:.1f}"),
    ("ttft_p50_ms", "TTFT p50 (ms)", "{:.1f}"), ("ttft_p90_ms", "TTFT p90 (ms)", "{:.1f}"),
    ("ttft_p99_ms", "TTFT p99 (ms)", "{:.1f}"), ("itl_p50_ms", "ITL p50 (ms)", "{:.2f}"),
    ("itl_p99_ms", "ITL p99 (ms)", "{:.2f}"), ("tpot_p50_ms", "TPOT p50 (ms)", "{:.2f}"),
    ("e2e_p50_s", "E2E p50 (s)", "{:.3f}"), ("e2e_p99_s", "E2E p99 (s)", "{:.3f}"),
    ("output_tok_per_s", "output tok/s", "{:.1f}"), ("requests_per_s", "requests/s", "{:.3f}"),
    ("all_tok_per_s", "prompt + output tok/s", "{:.1f}"),
    ("cpu_ms_per_token_frontend", "CPU ms/token frontend", "{:.3f}"),
    ("cpu_ms_per_token_engine", "CPU ms/token engine", "{:.3f}"),
]


def print_summary(s: dict[str, Any]) -> None:
    print(f"model={s['model']} url={s['base_url']} endpoint={s['endpoint']} concurrency={s['concurrency']} "
          f"requests={s['num_requests']} prompt~{s['prompt_tokens_target']} output={s['output_tokens_target']} "
          f"shared_prefix={s['shared_prefix_tokens']} wall={s['wall_s']:.2f}s contention={s.get('contention', 0)}")
    for key, name, fmt in METRICS:
        print(f"  {name:<22} {fmt.format(s[key])}")
    if s["failed"]:
        print(f"  FAILED REQUESTS: {s['failed']} {s['failure_reasons']} e.g. {s['failure_examples']}")


def print_compare(labels: list[str], sums: list[dict[str, Any]]) -> None:
    a, b = labels
    print(f"\n{'metric':<22} {a:>14} {b:>14} {a + '/' + b:>14}")
    for key, name, fmt in METRICS:
        va, vb = sums[0][key], sums[1][key]
        ratio = f"{va / vb:.3f}" if vb else "-"
        print(f"{name:<22} {fmt.format(va):>14} {fmt.format(vb):>14} {ratio:>14}")


def wait_health(base_url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before becoming healthy")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{base_url}/health not ready after {timeout:.0f}s")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT, then SIGTERM, then SIGKILL the server's own process group (started by us)."""
    for sig, wait in ((signal.SIGINT, 20.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue


def run_with_server(args: argparse.Namespace, cmd: str, label: str) -> dict[str, Any]:
    try:
        httpx.get(f"{args.base_url}/health", timeout=2.0)
        raise RuntimeError(f"something already listens on {args.base_url}; stop it or change the port")
    except httpx.TransportError:
        pass
    log = tempfile.NamedTemporaryFile(prefix=f"serve_load_{label}_", suffix=".log", delete=False)  # noqa: SIM115
    print(f"[{label}] starting: {cmd}\n[{label}] log: {log.name}", flush=True)
    proc = subprocess.Popen(cmd, shell=True, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.monotonic()
        wait_health(args.base_url, proc, args.server_timeout)
        print(f"[{label}] healthy after {time.monotonic() - t0:.1f}s", flush=True)
        summary = asyncio.run(run_load(args, proc.pid))
    finally:
        stop_server(proc)
        log.close()
    summary["label"], summary["server_cmd"] = label, cmd
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    p.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent streaming workers")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128, help="approximate prompt length (words)")
    p.add_argument("--output-tokens", type=int, default=64, help="exact output length (ignore_eos)")
    p.add_argument("--shared-prefix-tokens", type=int, default=0, help="common prompt head, in words")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--contention", type=int, default=0,
                   help="processes kept spinning beside the server during the timed load (co-located load)")
    p.add_argument("--warmup", type=int, default=1, help="untimed 4-token requests sent first")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--server-cmd", action="append", default=[],
                   help="shell command starting a server on --base-url (repeat twice with --compare)")
    p.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for /health")
    p.add_argument("--compare", action="store_true", help="run two --server-cmd one after the other")
    p.add_argument("--pairs", type=int, default=1,
                   help="with --compare: run the two servers this many times, alternating which goes first, and "
                        "print per-pair ratios and their medians")
    p.add_argument("--labels", default=None, help="comma-separated names for the --server-cmd runs")
    p.add_argument("--json-out", default=None, help="write the summary (or both, with --compare) here")
    p.add_argument("--bounds-model", default="", help="the model whose FLOPs per token divide the machine's matmul "
                   "FLOP/s for the fraction of the compute bound (default: the built-in GGUF; 'none': no bounds)")
    p.add_argument("--bounds-dtype", default="auto",
                   help="the servers' dtype for that bound (auto: deepinfer's default on this machine)")
    args = p.parse_args(argv)
    if args.compare and len(args.server_cmd) != 2:
        p.error("--compare needs exactly two --server-cmd")
    if not args.compare and len(args.server_cmd) > 1:
        p.error("more than one --server-cmd needs --compare")
    if min(args.concurrency, args.num_requests, args.prompt_tokens, args.output_tokens) < 1:
        p.error("--concurrency, --num-requests, --prompt-tokens and --output-tokens must be >= 1")
    args.base_url = args.base_url.rstrip("/").removesuffix("/v1")
    return args


def default_label(cmd: str) -> str:
    words = [w for w in shlex.split(cmd) if "=" not in w and w not in ("nice", "-n", "env") and not w.isdigit()]
    return os.path.basename(words[0]) if words else "server"


PAIR_METRICS = ["output_tok_per_s", "itl_p50_ms", "ttft_p50_ms", "cpu_ms_per_token_frontend",
                "cpu_ms_per_token_engine"]


def print_pairs(labels: list[str], pairs: list[list[dict[str, Any]]]) -> None:
    """Per pair B / A for each metric, then the median of those ratios (the noise-robust summary)."""
    a, b = labels
    print(f"\n{b} / {a} per pair (order alternates: odd pairs ran {a} first, even pairs {b} first)")
    print(f"{'pair':<6}" + "".join(f"{m:>28}" for m in PAIR_METRICS))
    ratios: dict[str, list[float]] = {m: [] for m in PAIR_METRICS}
    for i, (sa, sb) in enumerate(pairs, 1):
        row = []
        for m in PAIR_METRICS:
            r = sb[m] / sa[m] if sa[m] else float("nan")
            ratios[m].append(r)
            row.append(f"{sa[m]:.3f} -> {sb[m]:.3f} ({r:.3f})")
        print(f"{i:<6}" + "".join(f"{c:>28}" for c in row))
    print(f"{'median':<6}" + "".join(f"{statistics.median(v):>28.3f}" for v in ratios.values()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bounds = None  # the machine measured before the runs and again after (benchmarks/hw_bounds.py)
    if args.bounds_model != "none":
        bounds = hw_bounds.RunBounds(args.bounds_model or None)
        print(bounds.describe(), flush=True)
    labels = args.labels.split(",") if args.labels else [default_label(c) for c in args.server_cmd]
    if len(labels) != len(args.server_cmd) or (args.compare and labels[0] == labels[1]):
        labels = [chr(65 + i) for i in range(len(args.server_cmd))]
    sums: list[dict[str, Any]] = []
    pairs: list[list[dict[str, Any]]] = []
    if args.server_cmd:
        for pair in range(args.pairs if args.compare else 1):
            order = [0, 1] if pair % 2 == 0 else [1, 0]  # alternate who goes first: drift hits both
            runs: list[dict[str, Any]] = [{}, {}]
            for i in order if args.compare else [0]:
                cmd, label = args.server_cmd[i], labels[i]
                try:
                    runs[i] = run_with_server(args, cmd, label)
                except (RuntimeError, TimeoutError) as e:
                    print(f"[{label}] error: {e}", file=sys.stderr)
                    return 2
                print(f"[{label}]", end=" ")
                print_summary(runs[i])
            pairs.append(runs if args.compare else runs[:1])
            sums.extend(pairs[-1])
    else:
        sums.append(asyncio.run(run_load(args)))
        print_summary(sums[0])
    if args.compare:
        print_compare(labels, pairs[-1])
        if len(pairs) > 1:
            print_pairs(labels, pairs)
    if bounds is not None:
        bounds.remeasure()
        dtype = None if args.bounds_dtype == "auto" else args.bounds_dtype
        print(f"\nprompt + output tokens per second over the compute bound ({bounds.describe()}):")
        for i, s in enumerate(sums):
            label = labels[i % len(labels)] if args.server_cmd else args.base_url
            s["of_compute_bound"] = bounds.value(s["all_tok_per_s"], False, dtype)
            print(f"  {label}: {s['all_tok_per_s']:.1f} tok/s, {s['of_compute_bound']:.2f} of the bound")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(pairs if args.compare and len(pairs) > 1 else sums if args.compare else sums[0], f, indent=2)
        from deepinfer.bench.plots import plot_after_run

        plot_after_run(args.json_out)  # TTFT distribution per server, next to the JSON
    failed = sum(s["failed"] for s in sums)
    print(f"failed requests: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
