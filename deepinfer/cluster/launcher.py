"""One-command local cluster: `deepinfer serve --prefill-workers P --decode-workers D [--encode-workers E]`.

    this process: router on --host/--port ──polls──▶ P prefill + D decode (+ E encode) worker processes
                                                    (`deepinfer serve --role ...` on free 127.0.0.1 ports,
                                                     each with this command's engine flags)

Workers are children: they get SIGTERM when the router stops, and (Linux) when this
process dies without cleaning up. A worker that exits is logged; the router takes it
out of rotation by itself. Router and workers share a cluster token (--cluster-token,
$DEEPINFER_CLUSTER_TOKEN, else a fresh random one), handed to the workers in their
environment: argv would show it to every user of the machine (`ps`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from typing import Any

from deepinfer.config import CLUSTER_TOKEN_ENV, ClusterConfig, EngineConfig, RouterConfig, ServerConfig

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def config_flags(cfg: Any) -> list[str]:
    """The CLI flags that rebuild `cfg` (a config dataclass) in another process."""
    out: list[str] = []
    for f in dataclasses.fields(cfg):
        if "help" not in f.metadata:
            continue
        value = getattr(cfg, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, tuple) and f.metadata.get("action") == "append":
            for v in value:
                out += [flag, str(v)]
        elif isinstance(value, tuple):
            if value:  # pairs (--lora-modules) as name=value
                out += [flag, *(f"{v[0]}={v[1]}" if isinstance(v, tuple) else str(v) for v in value)]
        elif dataclasses.is_dataclass(value):  # a JSON-valued flag (--speculative-config)
            out += [flag, json.dumps(dataclasses.asdict(value))]
        elif value is not None:
            out += [flag, str(value)]
    return out


def engine_flags(engine: EngineConfig, role: str = "unified") -> list[str]:
    """The flags that rebuild `engine` in a worker of `role`. Speculative decoding goes to decode (and
    unified) workers only: a prefill worker computes the prompt and the first token, never a draft (an encode
    worker, no token at all). LoRA adapters go to every worker with an engine (prefill and decode both run them)."""
    spec = config_flags(engine.speculative) if role in ("unified", "decode") else []
    lora = config_flags(engine.lora) if role != "encode" else []
    return [*config_flags(engine.model), *config_flags(engine.cache), *config_flags(engine.scheduler),
            *config_flags(engine.kvstore), *spec, *lora]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def worker_cpu_sets(num_workers: int, threads_per_worker: int = 1) -> list[set[int]]:
    """CPU sets for `num_workers` workers of `threads_per_worker` threads each, dealt round-robin over the
    CPUs this process may use (workers share CPUs only when there are fewer CPUs than threads)."""
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, min(threads_per_worker, len(cpus)))
    return [{cpus[(i * per + j) % len(cpus)] for j in range(per)} for i in range(num_workers)]


def start_worker(role: str, engine: EngineConfig, port: int, log_level: str = "WARNING",
                 extra: list[str] | None = None, cpus: set[int] | None = None,
                 token: str | None = None) -> subprocess.Popen:
    """A worker process; `cpus`: pin it (and the engine process it starts, which inherits it) to them;
    `token`: the cluster token, passed in its environment."""
    cmd = [sys.executable, "-m", "deepinfer.cli", "--log-level", log_level, "serve", "--role", role,
           "--host", "127.0.0.1", "--port", str(port), *engine_flags(engine, role), *(extra or [])]
    linux = sys.platform.startswith("linux")

    def preexec() -> None:  # pragma: no cover - runs in the child before exec
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if token:
        env[CLUSTER_TOKEN_ENV] = token
    return subprocess.Popen(cmd, env=env, preexec_fn=preexec if linux else None)  # noqa: PLW1509


def stop_workers(procs: list[subprocess.Popen], timeout: float = 15.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def serve_local_cluster(engine: EngineConfig, server: ServerConfig, cluster: ClusterConfig,
                        router: RouterConfig, log_level: str = "WARNING") -> None:
    """Start the workers, then run the router here until interrupted; stop the workers on the way out."""
    from deepinfer.cluster.auth import new_token
    from deepinfer.cluster.router import build_client, model_name_of, run_router

    def interrupted(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)  # `finally` below stops the workers on SIGTERM too
    token = server.resolved_cluster_token() or new_token()
    server = dataclasses.replace(server, cluster_token=token)
    prefill = [f"http://127.0.0.1:{free_port()}" for _ in range(cluster.prefill_workers)]
    decode = [f"http://127.0.0.1:{free_port()}" for _ in range(cluster.decode_workers)]
    encode = [f"http://127.0.0.1:{free_port()}" for _ in range(cluster.encode_workers)]
    roles = [(role, url) for role, urls in (("prefill", prefill), ("decode", decode), ("encode", encode))
             for url in urls]
    cpu_sets = (worker_cpu_sets(len(roles), engine.model.num_threads or 1) if cluster.pin_workers
                else [None] * len(roles))
    procs = [start_worker(role, engine, int(url.rsplit(":", 1)[1]), log_level, cpus=cpus, token=token)
             for (role, url), cpus in zip(roles, cpu_sets, strict=True)]
    try:
        router = dataclasses.replace(router, prefill=(*router.prefill, *prefill), decode=(*router.decode, *decode),
                                     encode=(*router.encode, *encode))
        client = build_client(engine.model, engine.kvstore, router, token)
        name = model_name_of(engine.model)
        encoders = f", encode workers {', '.join(encode)}" if encode else ""
        print(f"deepinfer: local cluster: router http://{server.host}:{server.port}/v1, prefill workers "
              f"{', '.join(prefill)}, decode workers {', '.join(decode)}{encoders} ({router.routing_policy} policy)",
              flush=True)
        asyncio.run(run_router(client, name, server))
    except KeyboardInterrupt:
        pass
    finally:
        stop_workers(procs)
