"""Fault campaign (issue #16): real servers, real processes, a real store on disk, faults injected under load.

Owns the end-to-end fault cases and their verdicts. Each case starts what it needs (`deepinfer serve`, or a
prefill/decode cluster), runs closed-loop load (``--concurrency`` clients, streaming and non-streaming
greedy completions over prompts that share prefixes), injects one fault while requests are in flight,
and classifies every request:

    ok      completed, and its text equals a clean reference run (the offline `LLM`, same model and dtype)
    error   ended with a clear error: an HTTP error status with an error body, or an error event in the stream
    wrong   completed with other text than the reference            -- a failure
    lost    ended without an error and without finishing           -- a failure
    hung    did not end within the request timeout                 -- a failure

and then checks that nothing leaks (0 KV blocks in use on every live engine, no KV transfer held) and that
the system still serves (or, after the engine died, refuses at once with 503). Cases:

    engine_kill          kill -9 the engine process of `deepinfer serve`: /health 503, requests end, new ones 503
    engine_kill_store    kill -9 the engine while it writes the store; a new server on that store serves every
                         prompt right (nothing loaded from a half-written object)
    prefill_kill         kill -9 a prefill worker of a 2P+2D cluster under load
    decode_kill          kill -9 a decode worker of a 2P+2D cluster under load
    decode_kill_transfer kill -9 the decode worker a long prompt's KV is streaming to (1P+2D, chunked prefill)
    store_full           the store on a 2 MiB tmpfs (needs root to mount; else skipped): writes fail, serving goes on
    store_slow           every store read delayed (a sitecustomize hook in the server's processes wraps the
                         real store's reads with a sleep): store hits still right, nothing stalls for good
    store_corrupt        bytes flipped in every segment file of a filled store; a new server must recompute
    transfer_corrupt     bytes flipped on the KV transfer wire (a proxy on 127.0.0.2 in front of the decode
                         worker's KV port): the receiver's checksum drops the rest, output stays right

Usage::

    python benchmarks/chaos.py                       # every case, default model
    python benchmarks/chaos.py --cases engine_kill,store_corrupt --model path/to/model --json out.json

Exit status 1 if any case failed. `tests/test_chaos.py` runs the cases with a tiny model.
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
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from deepinfer.cluster.auth import token_headers  # noqa: E402
from deepinfer.config import CLUSTER_TOKEN_ENV  # noqa: E402
from tests.server_utils import CLUSTER_TOKEN, cluster_workers, free_port, metric  # noqa: E402

BLOCK = 16
# the store cases check what one pass of requests leaves in the store: every computed block is written
# (a unified server's default, reused, writes a block at its second use)
WRITE_ALL = ("--kv-store-admit", "always")


# ---------------------------------------------------------------------------------------------- load


@dataclass
class Outcome:
    kind: str  # ok | error | wrong | lost | hung
    stream: bool
    detail: str = ""
    seconds: float = 0.0


@dataclass
class CaseResult:
    name: str
    outcomes: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    skipped: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.failures

    def check(self, cond: bool, what: str) -> None:
        if not cond:
            self.failures.append(what)

    def as_dict(self) -> dict:
        return {"name": self.name, "passed": self.passed, "skipped": self.skipped, "outcomes": dict(self.outcomes),
                "failures": self.failures, "facts": self.facts, "seconds": round(self.seconds, 1)}


def make_prompts(n: int, seed: int = 0, long: int = 0) -> list[list[int]]:
    """Token-id prompts: a third share a 64-token head, a third share a 32-token head, the rest are unique."""
    rng = random.Random(seed)
    heads = [[rng.randrange(100, 49000) for _ in range(64)], [rng.randrange(100, 49000) for _ in range(32)]]
    out = []
    for i in range(n):
        head = heads[i % 3] if i % 3 < 2 else []
        tail = [rng.randrange(100, 49000) for _ in range(long or rng.randint(20, 150))]
        out.append(head + tail)
    return out


def reference_texts(model: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """Greedy texts from a clean offline engine (no store, no faults)."""
    from deepinfer import LLM, SamplingParams

    with LLM(model, dtype="float32", kv_cache_memory="256MiB", profile_cost_model=False, kv_store="none") as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


async def one_request(client: httpx.AsyncClient, base: str, prompt: list[int], max_tokens: int, stream: bool,
                      expected: str | None, timeout: float) -> Outcome:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    started = time.monotonic()

    async def run() -> Outcome:
        if not stream:
            r = await client.post(f"{base}/v1/completions", json=body)
            if r.status_code != 200:
                try:
                    msg = r.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    return Outcome("lost", False, f"HTTP {r.status_code} without an error body")
                return Outcome("error", False, f"HTTP {r.status_code}: {msg[:80]}")
            d = r.json()
            text, n = d["choices"][0]["text"], d["usage"]["completion_tokens"]
            if n != max_tokens:
                return Outcome("lost", False, f"200 with {n}/{max_tokens} tokens")
            return Outcome("ok" if expected is None or text == expected else "wrong", False,
                           "" if text == expected else f"{text[:40]!r} != {(expected or '')[:40]!r}")
        text, done, error = "", False, ""
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                try:
                    msg = r.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    return Outcome("lost", True, f"HTTP {r.status_code} without an error body")
                return Outcome("error", True, f"HTTP {r.status_code}: {msg[:80]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                d = json.loads(data)
                if "error" in d:
                    error = str(d["error"].get("message", d["error"]))[:80]
                    continue
                for ch in d.get("choices", []):
                    text += ch.get("text", "")
        if error:
            return Outcome("error", True, f"stream error event: {error}")
        if not done:
            return Outcome("lost", True, "stream ended without [DONE] or an error event")
        return Outcome("ok" if expected is None or text == expected else "wrong", True,
                       "" if text == expected else f"{text[:40]!r} != {(expected or '')[:40]!r}")

    try:
        out = await asyncio.wait_for(run(), timeout)
    except TimeoutError:
        out = Outcome("hung", stream, f"no end after {timeout:.0f}s")
    except httpx.TransportError as e:  # the server itself went away mid-request: visible, not silent
        out = Outcome("error", stream, f"connection: {type(e).__name__}")
    out.seconds = time.monotonic() - started
    return out


class Load:
    """`concurrency` clients sending requests one after another until `stop()`; every outcome is kept."""

    def __init__(self, base: str, prompts: list[list[int]], refs: list[str] | None, max_tokens: int,
                 concurrency: int, timeout: float = 120.0) -> None:
        self.base, self.prompts, self.refs, self.max_tokens = base, prompts, refs, max_tokens
        self.concurrency, self.timeout = concurrency, timeout
        self.outcomes: list[Outcome] = []
        self.in_flight = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        async def client(i: int) -> None:
            rng = random.Random(i)
            async with httpx.AsyncClient(timeout=self.timeout + 5) as c:
                k = i
                while not self._stop.is_set():
                    j = k % len(self.prompts)
                    k += self.concurrency
                    self.in_flight += 1
                    out = await one_request(c, self.base, self.prompts[j], self.max_tokens, rng.random() < 0.5,
                                            self.refs[j] if self.refs else None, self.timeout)
                    self.in_flight -= 1
                    self.outcomes.append(out)
        await asyncio.gather(*(client(i) for i in range(self.concurrency)))

    def start(self) -> Load:
        self._thread.start()
        return self

    def wait_for(self, cond: Callable[[], bool], timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout + 30)

    def run_once(self) -> None:
        """Send every prompt once (concurrently) and wait."""
        async def main() -> None:
            sem = asyncio.Semaphore(self.concurrency)
            async with httpx.AsyncClient(timeout=self.timeout + 5) as c:
                async def one(j: int) -> None:
                    async with sem:
                        self.outcomes.append(await one_request(
                            c, self.base, self.prompts[j], self.max_tokens, j % 2 == 0,
                            self.refs[j] if self.refs else None, self.timeout))
                await asyncio.gather(*(one(j) for j in range(len(self.prompts))))
        asyncio.run(main())


def record(res: CaseResult, outcomes: list[Outcome], allowed: tuple[str, ...] = ("ok", "error")) -> None:
    for o in outcomes:
        res.outcomes[f"{o.kind}{'_stream' if o.stream else ''}"] += 1
    bad = [o for o in outcomes if o.kind not in allowed]
    res.check(not bad, f"{len(bad)} requests ended badly: {[(o.kind, o.detail) for o in bad[:5]]}")
    errors = Counter(o.detail for o in outcomes if o.kind == "error")
    if errors:
        res.facts["errors"] = dict(errors.most_common(6))


# ---------------------------------------------------------------------------------------------- processes


@contextlib.contextmanager
def serve(*args: str, env: dict[str, str] | None = None, log: Path | None = None,
          timeout: float = 300.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """`deepinfer serve` (or a cluster) on a free port; yields (base URL, process)."""
    port = free_port()
    cmd = [sys.executable, "-m", "deepinfer.cli", "--log-level", "WARNING", "serve", "--host", "127.0.0.1",
           "--port", str(port), *args]
    yield from _process(cmd, f"http://127.0.0.1:{port}", env, log, timeout)


def _process(cmd: list[str], base: str | None, env: dict[str, str] | None, log: Path | None,
             timeout: float) -> Iterator[tuple[str, subprocess.Popen]]:
    out = open(log, "a") if log else subprocess.DEVNULL  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    try:
        if base is not None:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"exited with {proc.returncode}: {' '.join(cmd)}")
                try:
                    if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not healthy: {' '.join(cmd)}")
                time.sleep(0.5)
        yield base or "", proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log:
            out.close()


def engine_process(server: subprocess.Popen) -> psutil.Process:
    kids = [p for p in psutil.Process(server.pid).children()
            if "resource_tracker" not in " ".join(p.cmdline())]
    if len(kids) != 1:
        raise RuntimeError(f"expected one engine process, found {kids}")
    return kids[0]


def blocks_in_use(base: str, timeout: float = 20.0) -> float:
    """deepinfer:kv_cache_blocks_used once it reaches 0, or its last value after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        used = metric(base, "deepinfer:kv_cache_blocks_used")
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.3)


def internal_headers() -> dict[str, str]:
    """The cluster token header for `/internal/*` (the servers this script starts take the token from
    $DEEPINFER_CLUSTER_TOKEN, as the test suite's do; without one every check passes)."""
    return token_headers(os.environ.get(CLUSTER_TOKEN_ENV))


def settled_workers(base: str, timeout: float = 30.0) -> list[str]:
    """Live workers of a cluster that still hold anything after `timeout` (running requests, KV in use,
    transfers pending, imported blocks held): [] when all are clean."""
    deadline = time.monotonic() + timeout
    while True:
        dirty = []
        for w in cluster_workers(base):
            if not w["alive"]:
                continue
            try:
                ld = httpx.get(f"{w['url']}/internal/load", timeout=5, headers=internal_headers()).json()
            except httpx.HTTPError:
                continue  # died since the router last looked
            held = {k: ld[k] for k in ("num_running", "transfers_pending", "kv_blocks_held", "kv_usage") if ld[k]}
            if held:
                dirty.append(f"{w['role']} {w['url']}: {held}")
        if not dirty or time.monotonic() > deadline:
            return dirty
        time.sleep(0.3)


# ---------------------------------------------------------------------------------------------- cases


@dataclass
class Ctx:
    model: str
    workdir: Path
    concurrency: int = 6
    max_tokens: int = 24
    num_prompts: int = 24
    flags: tuple[str, ...] = ("--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
                              "--no-profile-cost-model")
    _refs: dict = field(default_factory=dict)

    def prompts(self, seed: int = 0, n: int | None = None, long: int = 0) -> tuple[list[list[int]], list[str]]:
        prompts = make_prompts(n or self.num_prompts, seed, long)
        key = (seed, n, long)
        if key not in self._refs:
            self._refs[key] = reference_texts(self.model, prompts, self.max_tokens)
        return prompts, self._refs[key]

    def log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"


def case_engine_kill(ctx: Ctx, res: CaseResult) -> None:
    prompts, refs = ctx.prompts(0)
    with serve("--model", ctx.model, *ctx.flags, *WRITE_ALL, "--kv-store", str(ctx.workdir / "store-ek"),
               log=ctx.log(res.name)) as (base, proc):
        engine = engine_process(proc)
        load = Load(base, prompts, refs, ctx.max_tokens, ctx.concurrency).start()
        res.check(load.wait_for(lambda: len(load.outcomes) >= ctx.concurrency and load.in_flight > 0), "no load")
        engine.kill()
        killed = time.monotonic()
        health = None
        while time.monotonic() - killed < 15:
            health = httpx.get(f"{base}/health", timeout=5).status_code
            if health == 503:
                break
            time.sleep(0.1)
        res.facts["health_503_after_s"] = round(time.monotonic() - killed, 2)
        res.check(health == 503, f"/health is {health} after the engine died")
        time.sleep(1.0)  # requests sent after the death must be refused at once
        load.stop()
        after = [o for o in load.outcomes[-ctx.concurrency:]]
        record(res, load.outcomes)
        res.check(any(o.kind == "error" for o in load.outcomes), "no request saw the engine die")
        res.check(all(o.seconds < 10 for o in after), f"late requests not refused at once: "
                  f"{[round(o.seconds, 1) for o in after]}")
        r = httpx.post(f"{base}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3}, timeout=10)
        res.check(r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", f"new request: {r.status_code}")
        res.check(proc.poll() is None, "the server process died with its engine")


def case_engine_kill_store(ctx: Ctx, res: CaseResult) -> None:
    """The engine is killed while its background writer stores segments; the store must never serve what a
    dead writer left half-written."""
    from deepinfer.kvcache.space import scan

    store = ctx.workdir / "store-eks"
    prompts, refs = ctx.prompts(1)
    with serve("--model", ctx.model, *ctx.flags, *WRITE_ALL, "--kv-store", str(store), log=ctx.log(res.name)) as (base, proc):
        engine = engine_process(proc)
        load = Load(base, prompts, refs, ctx.max_tokens, ctx.concurrency).start()
        res.check(load.wait_for(lambda: scan(store)["objects"] >= 4), "the store got no writes")
        engine.kill()
        load.stop()
        record(res, load.outcomes)
    before = scan(store)
    res.facts["store_after_kill"] = {k: before[k] for k in ("objects", "tmp_files", "corrupt")}
    with serve("--model", ctx.model, *ctx.flags, *WRITE_ALL, "--kv-store", str(store), log=ctx.log(res.name)) as (base, _):
        again = Load(base, prompts, refs, ctx.max_tokens, ctx.concurrency)
        again.run_once()
        record(res, again.outcomes, allowed=("ok",))
        res.facts["store_tier_tokens"] = _tier(base, "store")
        res.check(res.facts["store_tier_tokens"] > 0, "nothing was served from the store after the restart")
        res.check(blocks_in_use(base) == 0, "KV blocks still in use after the load")


def _tier(base: str, tier: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("deepinfer:prefix_cache_hits_by_tier_total{") and f'tier="{tier}"' in line)


def _cluster_case(ctx: Ctx, res: CaseResult, role: str) -> None:
    prompts, refs = ctx.prompts(2)
    with serve("--model", ctx.model, *ctx.flags, "--prefill-workers", "2", "--decode-workers", "2",
               "--health-interval", "1", "--token-timeout", "60", *WRITE_ALL, "--kv-store", str(ctx.workdir / f"store-{role}"),
               log=ctx.log(res.name)) as (base, _):
        deadline = time.monotonic() + 180
        while not all(w["alive"] for w in cluster_workers(base)):
            if time.monotonic() > deadline:
                raise TimeoutError("cluster workers did not all come up")
            time.sleep(0.3)
        load = Load(base, prompts, refs, ctx.max_tokens, ctx.concurrency).start()
        res.check(load.wait_for(lambda: len(load.outcomes) >= ctx.concurrency and load.in_flight > 0), "no load")
        victim = next(w for w in cluster_workers(base) if w["role"] == role)
        os.kill(victim["load"]["pid"], signal.SIGKILL)
        n_at_kill = len(load.outcomes)
        # keep the load on until the router has noticed and the survivors served a full round
        load.wait_for(lambda: len(load.outcomes) >= n_at_kill + 2 * ctx.concurrency, timeout=120)
        load.stop()
        record(res, load.outcomes)
        res.facts["completed_after_kill"] = sum(o.kind == "ok" for o in load.outcomes[n_at_kill:])
        res.check(res.facts["completed_after_kill"] > 0, "the survivors served nothing after the kill")
        dirty = settled_workers(base)
        res.check(not dirty, f"workers still hold KV / requests after the load: {dirty}")
        state = httpx.get(f"{base}/internal/workers", timeout=10, headers=internal_headers()).json()
        res.facts["prefill_retries"] = state.get("prefill_retries")
        res.check(not next(w for w in state["workers"] if w["url"] == victim["url"])["alive"],
                  "the dead worker is still in rotation")


def case_prefill_kill(ctx: Ctx, res: CaseResult) -> None:
    _cluster_case(ctx, res, "prefill")


def case_decode_kill(ctx: Ctx, res: CaseResult) -> None:
    _cluster_case(ctx, res, "decode")


def case_decode_kill_transfer(ctx: Ctx, res: CaseResult) -> None:
    """1 prefill + 2 decode workers, prefill in chunks of 8 tokens so a long prompt's KV streams for a while;
    the decode worker receiving it is killed while the transfer is pending."""
    long_prompts, long_refs = ctx.prompts(3, n=3, long=700)
    flags = [*ctx.flags, "--max-num-batched-tokens", "8", "--scheduler", "tokens"]
    with serve("--model", ctx.model, *flags, "--prefill-workers", "1", "--decode-workers", "2",
               "--health-interval", "1", "--token-timeout", "60", "--kv-store", "none",
               log=ctx.log(res.name)) as (base, _):
        deadline = time.monotonic() + 180
        while not all(w["alive"] for w in cluster_workers(base)):
            if time.monotonic() > deadline:
                raise TimeoutError("cluster workers did not all come up")
            time.sleep(0.3)
        decoders = [w for w in cluster_workers(base) if w["role"] == "decode"]
        outcomes: list[Outcome] = []
        for i, (prompt, ref) in enumerate(zip(long_prompts, long_refs, strict=True)):
            load = Load(base, [prompt], [ref], ctx.max_tokens, 1)
            t = threading.Thread(target=load.run_once, daemon=True)
            t.start()
            victim = None
            deadline = time.monotonic() + 60
            while victim is None and t.is_alive() and time.monotonic() < deadline:
                for w in decoders:
                    with contextlib.suppress(httpx.HTTPError):
                        if httpx.get(f"{w['url']}/internal/load", timeout=2, headers=internal_headers()).json()["transfers_pending"]:
                            victim = w
                            break
                time.sleep(0.01)
            if victim is not None and i == 0:
                os.kill(victim["load"]["pid"], signal.SIGKILL)
                decoders.remove(victim)
                res.facts["killed_mid_transfer"] = True
            t.join(180)
            res.check(not t.is_alive(), "a request hung")
            outcomes += load.outcomes
        record(res, outcomes)
        res.check(res.facts.get("killed_mid_transfer", False), "never caught a transfer in flight")
        res.check(outcomes[-1].kind == "ok", f"the survivor did not serve the last prompt: {outcomes[-1]}")
        dirty = settled_workers(base)
        res.check(not dirty, f"workers still hold KV / requests after the load: {dirty}")


def case_store_full(ctx: Ctx, res: CaseResult) -> None:
    mnt = ctx.workdir / "tmpfs-store"
    mnt.mkdir(exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        res.skipped = f"cannot mount a tmpfs: {r.stderr.strip()[:80]}"
        return
    try:
        prompts, refs = ctx.prompts(4, n=48)
        with serve("--model", ctx.model, *ctx.flags, *WRITE_ALL, "--kv-store", str(mnt), log=ctx.log(res.name)) as (base, _):
            load = Load(base, prompts, refs, ctx.max_tokens, ctx.concurrency)
            load.run_once()
            load.run_once()  # again: device hits and store lookups on a full store
            record(res, load.outcomes, allowed=("ok",))
            errors = metric(base, "deepinfer:kv_store_write_errors_total")
            dropped = metric(base, "deepinfer:kv_store_capacity_dropped_writes_total")
            res.facts.update(write_errors=errors, capacity_dropped=dropped,
                             store_bytes=shutil.disk_usage(mnt).used)
            res.check(errors + dropped > 0, "the store never filled: no write errors and no dropped writes")
            res.check(blocks_in_use(base) == 0, "KV blocks still in use after the load")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


SLOW_HOOK = textwrap.dedent('''
    """chaos.py fault injection: every KV store read sleeps first (the real store then reads real files)."""
    import os, time
    _delay = float(os.environ.get("DEEPINFER_CHAOS_STORE_READ_DELAY", "0"))
    if _delay:
        from deepinfer.kvcache import store as _store

        _get = _store.KVBlockStore.get

        def get(self, *args, **kwargs):
            time.sleep(_delay)
            return _get(self, *args, **kwargs)

        _store.KVBlockStore.get = get
''')


def case_store_slow(ctx: Ctx, res: CaseResult, delay: float = 1.5) -> None:
    store = ctx.workdir / "store-slow"
    prompts, refs = ctx.prompts(5)
    fresh, fresh_refs = ctx.prompts(6, n=8)
    with serve("--model", ctx.model, *ctx.flags, *WRITE_ALL, "--kv-store", str(store), log=ctx.log(res.name)) as (base, _):
        Load(base, prompts, refs, ctx.max_tokens, ctx.concurrency).run_once()
    hook = ctx.workdir / "slow-hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SLOW_HOOK)
    env = {"PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", str(ROOT))]),
           "DEEPINFER_CHAOS_STORE_READ_DELAY": str(delay)}
    with serve("--model", ctx.model, *ctx.flags, *WRITE_ALL, "--kv-store", str(store), env=env,
               log=ctx.log(res.name)) as (base, _):
        hits = Load(base, prompts, refs, ctx.max_tokens, ctx.concurrency)
        misses = Load(base, fresh, fresh_refs, ctx.max_tokens, 2)
        t = threading.Thread(target=hits.run_once, daemon=True)
        t.start()
        time.sleep(0.5)
        misses.run_once()  # prompts the store does not have, while the store hits wait on slow reads
        t.join(300)
        res.check(not t.is_alive(), "store-hit requests hung behind slow reads")
        record(res, hits.outcomes + misses.outcomes, allowed=("ok",))
        res.facts["store_tier_tokens"] = _tier(base, "store")
        res.facts["fresh_p50_s"] = sorted(o.seconds for o in misses.outcomes)[len(misses.outcomes) // 2]
        res.facts["store_hit_p50_s"] = sorted(o.seconds for o in hits.outcomes)[len(hits.outcomes) // 2]
        res.check(res.facts["store_tier_tokens"] > 0, "the slow store served nothing")
        res.check(blocks_in_use(base) == 0, "KV blocks still in use after the load")


def flip_segments(store: Path) -> int:
    """Flip one byte in every segment file: in the header of every third one, in the payload of the rest."""
    from deepinfer.kvcache.space import iter_files, read_header

    n = 0
    for i, path in enumerate(sorted(e.path for e in iter_files(store) if not e.tmp)):
        with open(path, "r+b") as f:
            hdr = read_header(f)
            off = 40 if i % 3 == 0 else hdr.header_len + (hdr.payload_len * (i % 7 + 1)) // 8
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0x5A]))
        n += 1
    return n


def case_store_corrupt(ctx: Ctx, res: CaseResult) -> None:
    store = ctx.workdir / "store-corrupt"
    prompts, refs = ctx.prompts(7)
    with serve("--model", ctx.model, *ctx.flags, *WRITE_ALL, "--kv-store", str(store), log=ctx.log(res.name)) as (base, _):
        Load(base, prompts, refs, ctx.max_tokens, ctx.concurrency).run_once()
    res.facts["segments_flipped"] = flip_segments(store)
    res.check(res.facts["segments_flipped"] > 0, "the store had no segments to corrupt")
    with serve("--model", ctx.model, *ctx.flags, *WRITE_ALL, "--kv-store", str(store), log=ctx.log(res.name)) as (base, _):
        load = Load(base, prompts, refs, ctx.max_tokens, ctx.concurrency)
        load.run_once()
        record(res, load.outcomes, allowed=("ok",))
        res.facts["corrupt_counted"] = metric(base, "deepinfer:kv_store_corrupt_total")
        res.facts["store_tier_tokens"] = _tier(base, "store")
        res.check(res.facts["corrupt_counted"] > 0, "no corrupt segment was detected")
        res.check(blocks_in_use(base) == 0, "KV blocks still in use after the load")


class FlippingProxy:
    """TCP proxy listen_host:port -> 127.0.0.1:port flipping one byte at `offset` of each connection's
    client-to-server stream (the KV transfer wire)."""

    def __init__(self, listen_host: str, port: int, offset: int) -> None:
        self.listen_host, self.port, self.offset = listen_host, port, offset
        self.connections = 0
        self.flipped = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def pipe(reader, writer, flip: bool) -> None:
            seen = 0
            try:
                while data := await reader.read(1 << 16):
                    if flip and seen <= self.offset < seen + len(data):
                        data = bytearray(data)
                        data[self.offset - seen] ^= 0xFF
                        self.flipped += 1
                    seen += len(data)
                    writer.write(bytes(data))
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    writer.close()

        async def handle(reader, writer) -> None:
            self.connections += 1
            ur, uw = await asyncio.open_connection("127.0.0.1", self.port)
            await asyncio.gather(pipe(reader, uw, True), pipe(ur, writer, False))

        async def main() -> None:
            await asyncio.start_server(handle, self.listen_host, self.port)
            self._ready.set()
            await asyncio.Event().wait()

        self._loop.run_until_complete(main())


def case_transfer_corrupt(ctx: Ctx, res: CaseResult) -> None:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
    except OSError as e:
        res.skipped = f"no 127.0.0.2 loopback: {e}"
        return
    prompts, refs = ctx.prompts(8, n=8, long=200)
    kv_port = free_port()
    # past the stream header and the first block: the receiver keeps a verified prefix and recomputes the rest
    proxy = FlippingProxy("127.0.0.2", kv_port, offset=30_000)
    router_port = free_port()
    router = f"http://127.0.0.1:{router_port}"
    pre, dec = free_port(), free_port()
    base_cmd = [sys.executable, "-m", "deepinfer.cli", "--log-level", "WARNING", "serve", "--host", "127.0.0.1"]
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.contextmanager(_process)(
            [*base_cmd, "--port", str(dec), "--role", "decode", "--model", ctx.model, *ctx.flags, "--kv-store",
             "none", "--kv-transfer-port", str(kv_port), "--advertise-host", "127.0.0.2"],
            f"http://127.0.0.1:{dec}", None, ctx.log(res.name), 300))
        stack.enter_context(contextlib.contextmanager(_process)(
            [*base_cmd, "--port", str(pre), "--role", "prefill", "--model", ctx.model, *ctx.flags, "--kv-store",
             "none"], f"http://127.0.0.1:{pre}", None, ctx.log(res.name), 300))
        stack.enter_context(contextlib.contextmanager(_process)(
            [sys.executable, "-m", "deepinfer.cli", "--log-level", "WARNING", "router", "--port", str(router_port),
             "--model", ctx.model, "--prefill", f"http://127.0.0.1:{pre}", "--decode", f"http://127.0.0.1:{dec}",
             "--health-interval", "1"], router, None, ctx.log(res.name), 120))
        load = Load(router, prompts, refs, ctx.max_tokens, 2)
        load.run_once()
        record(res, load.outcomes, allowed=("ok",))
        ld = httpx.get(f"http://127.0.0.1:{dec}/internal/load", timeout=10, headers=internal_headers()).json()
        sent = httpx.get(f"http://127.0.0.1:{pre}/internal/load", timeout=10, headers=internal_headers()).json().get("blocks_sent", 0)
        # `blocks_sent` is what the receiver acknowledged as verified; the prompts' full blocks are what
        # the prefill worker put on the wire
        full_blocks = sum(len(p) // BLOCK for p in prompts)
        log = ctx.log(res.name).read_text()
        res.facts.update(connections=proxy.connections, bytes_flipped=proxy.flipped, blocks_sent=sent,
                         blocks_imported=ld.get("blocks_imported", 0), prompt_full_blocks=full_blocks,
                         checksum_failures_logged=log.count("failed its checksum"))
        res.check(proxy.connections > 0 and proxy.flipped > 0, "no transfer went through the flipping proxy")
        res.check(res.facts["blocks_imported"] < full_blocks, "every block was imported despite flipped bytes")
        res.check(res.facts["checksum_failures_logged"] > 0, "the receiver logged no checksum failure")
        dirty = settled_workers(router)
        res.check(not dirty, f"workers still hold KV / requests after the load: {dirty}")


CASES: dict[str, Callable[[Ctx, CaseResult], None]] = {
    "engine_kill": case_engine_kill,
    "engine_kill_store": case_engine_kill_store,
    "prefill_kill": case_prefill_kill,
    "decode_kill": case_decode_kill,
    "decode_kill_transfer": case_decode_kill_transfer,
    "store_full": case_store_full,
    "store_slow": case_store_slow,
    "store_corrupt": case_store_corrupt,
    "transfer_corrupt": case_transfer_corrupt,
}


def run_case(name: str, ctx: Ctx) -> CaseResult:
    res = CaseResult(name)
    started = time.monotonic()
    try:
        CASES[name](ctx, res)
    except Exception as e:  # a case that cannot run is a failed case, with the reason
        res.failures.append(f"case raised {type(e).__name__}: {e}")
    res.seconds = time.monotonic() - started
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model path (default: the default model's GGUF)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list from {','.join(CASES)}")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--workdir", help="where stores and logs go (default: a temp dir, kept on failure)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.model is None:
        from deepinfer.weights import default_model_path

        args.model = str(default_model_path())
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DEEPINFER_KV_STORE", "none")
    # the clusters started here, our internal calls and tests.server_utils' share the test suite's token
    os.environ[CLUSTER_TOKEN_ENV] = CLUSTER_TOKEN
    ctx = Ctx(args.model, workdir, concurrency=args.concurrency, max_tokens=args.max_tokens)
    results = []
    for name in args.cases.split(","):
        res = run_case(name, ctx)
        results.append(res)
        status = "SKIP" if res.skipped else "PASS" if res.passed else "FAIL"
        print(f"{status} {name:22s} {res.seconds:6.1f}s outcomes={dict(res.outcomes)} facts={res.facts}"
              + (f" skipped: {res.skipped}" if res.skipped else "")
              + (f"\n     failures: {res.failures}" if res.failures else ""), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps([r.as_dict() for r in results], indent=1))
    failed = [r for r in results if not r.passed]
    if not failed and not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"logs and stores in {workdir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
