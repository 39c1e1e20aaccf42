"""Start a real `deepinfer serve` process on 127.0.0.1 and wait until it answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from deepinfer.cluster.auth import CLUSTER_TOKEN_HEADER

# the cluster token every server the suite starts gets ($DEEPINFER_CLUSTER_TOKEN, set by conftest.py), so
# tests can call /internal/* on routers and workers
CLUSTER_TOKEN = "deepinfer-test-cluster-token"
INTERNAL = {CLUSTER_TOKEN_HEADER: CLUSTER_TOKEN}
KEY = "test-key"  # the API key of tests/server/conftest.py's shared server
# the flags of tests/server/conftest.py's shared server (a module that needs one more starts its own with these)
# no start-up cost-model profile (~2.5 s a server): the API tests do not look at step sizes
SHARED_SERVER_FLAGS = ("--api-key", KEY, "--kv-cache-memory", "256MiB", "--max-model-len", "2048",
                       "--dtype", "float32", "--no-profile-cost-model")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(*args: str, timeout: float = 180.0, log: Path | None = None):
    port = free_port()
    cmd = [sys.executable, "-m", "deepinfer.cli", "--log-level", "WARNING", "serve", "--host", "127.0.0.1",
           "--port", str(port), *args]
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("server did not become healthy")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log:
            out.close()


@contextmanager
def inprocess_app(app, timeout: float = 30.0):
    """Serve `app` with uvicorn on a thread of this process on a free port; yields the base URL (for
    tests that reach into the engine behind it: fault injection, killing a rank)."""
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if time.monotonic() > deadline:
            raise TimeoutError("in-process server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def metric(base: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (all label sets)."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise KeyError(name)
    return total


def cluster_workers(base: str) -> list[dict]:
    """The router's worker list (url, role, alive, ...)."""
    return httpx.get(f"{base}/internal/workers", headers=INTERNAL, timeout=10).json()["workers"]


@contextmanager
def running_cluster(*args: str, log: Path | None = None, timeout: float = 300.0, workers_timeout: float = 120.0):
    """`running_server(*args)` for a `--prefill-workers/--decode-workers` cluster, yielded once every
    worker is alive (/health needs only one per pool; cluster tests want all of them)."""
    with running_server(*args, log=log, timeout=timeout) as base:
        deadline = time.monotonic() + workers_timeout
        while not all(w["alive"] for w in cluster_workers(base)):
            if time.monotonic() > deadline:
                raise TimeoutError("cluster workers did not all come up")
            time.sleep(0.3)
        yield base


def greedy_completion_tokens(base: str, prompts: list[list[int]], max_tokens: int) -> list[list[str]]:
    """Each prompt's greedy completion (ignore_eos) through the official openai client, as token strings."""
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    outs = []
    for p in prompts:
        r = client.completions.create(model=name, prompt=p, max_tokens=max_tokens, temperature=0, logprobs=1,
                                      extra_body={"ignore_eos": True})
        outs.append(r.choices[0].logprobs.tokens)
    return outs


def prefill_reference(base: str, model_dir: Path, messages: list[dict], max_tokens: int) -> tuple[list[int], str]:
    """An assistant prefill's reference: the prompt transformers renders with the final message left open
    (`continue_final_message`), and the server's greedy /v1/completions text for exactly those ids, which a
    reply that continues the message must equal."""
    import httpx
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    r = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                   json={"prompt": ids, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    return ids, r.json()["choices"][0]["text"]
