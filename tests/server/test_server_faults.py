"""Server behaviour under overload and engine failure (tiny model, real HTTP on 127.0.0.1)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from deepinfer.config import EngineConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.server.app import build_app
from tests.server_utils import inprocess_app, metric, running_server


def test_queue_limit_gives_429_with_retry_after(tiny_models):
    with running_server("--model", str(tiny_models["llama"]), "--dtype", "float32", "--max-num-seqs", "1",
                        "--max-queue", "1", "--kv-cache-memory", "32MiB", "--max-model-len", "1024") as base:
        async def burst():
            # up to two requests are admitted (1 running + 1 queued) and run one after the other: on a loaded
            # 2-core machine 900 tokens of the tiny model took ~85 s each
            async with httpx.AsyncClient(timeout=400) as c:
                body = {"prompt": [5, 6, 7], "max_tokens": 900, "ignore_eos": True}
                return await asyncio.gather(*(c.post(f"{base}/v1/completions", json=body) for _ in range(5)))

        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert 200 in codes and 429 in codes and set(codes) <= {200, 429}
        limited = next(r for r in responses if r.status_code == 429)
        assert limited.headers["retry-after"] and limited.json()["error"]["code"] == "rate_limit_exceeded"
        for r in responses:
            if r.status_code == 200:
                assert r.json()["usage"]["completion_tokens"] == 900
        assert metric(base, "deepinfer:kv_cache_blocks_used") == 0


@pytest.fixture
def inprocess_server(tiny_models):
    engine = AsyncEngine(EngineConfig.from_kwargs(model=str(tiny_models["llama"]), dtype="float32",
                                                  kv_cache_memory="16MiB", max_model_len=512))
    try:
        with inprocess_app(build_app(engine, "tiny")) as base:
            yield base, engine
    finally:
        engine.shutdown()


def test_health_turns_503_when_the_engine_loop_dies(inprocess_server):
    base, engine = inprocess_server
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 5}
    assert httpx.post(f"{base}/v1/completions", json=body, timeout=30).status_code == 200
    assert httpx.get(f"{base}/health").status_code == 200

    def broken(*_args, **_kw):
        raise RuntimeError("injected device failure")

    engine.engine.core.runner.run = broken  # fault injection: the next model step fails
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert httpx.get(f"{base}/health").status_code == 503
    # new requests are refused at once rather than hanging
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
    assert r.status_code == 503


def test_engine_process_killed_mid_stream_ends_streams_with_an_error(tiny_models):
    """The engine runs in its own process (the default): killing it ends open streams with an error
    event, /health turns 503 and new requests are refused at once; nothing hangs."""
    import psutil

    with running_server("--model", str(tiny_models["llama"]), "--dtype", "float32", "--kv-cache-memory", "32MiB",
                        "--max-model-len", "1024") as base:
        port = int(base.rsplit(":", 1)[1])
        server = next(p for p in psutil.process_iter(["cmdline"]) if str(port) in (p.info["cmdline"] or []))
        engine_procs = [p for p in server.children() if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(engine_procs) == 1
        body = {"prompt": [5, 6, 7], "max_tokens": 900, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 3:
                    for p in engine_procs:
                        p.kill()
        assert '"error"' in events[-1] or '"error"' in events[-2], events[-3:]
        assert 3 <= len(events) < 900
        assert httpx.get(f"{base}/health", timeout=10).status_code == 503
        r = httpx.post(f"{base}/v1/completions", json={"prompt": [5, 6], "max_tokens": 3}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
