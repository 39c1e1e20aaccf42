"""`deepinfer serve --ray ADDRESS --prefill-workers P --decode-workers D [--encode-workers E]`: workers on an
existing Ray cluster.

    this process (Ray driver): router on --host/--port
        │ ray.init(ADDRESS)
        ├─ WorkerActor (prefill) x P ─▶ on its node: `deepinfer serve --role prefill --host 0.0.0.0
        ├─ WorkerActor (decode)  x D      --advertise-host <node ip> --port <free>` (a child process)
        └─ WorkerActor (encode)  x E    (a vision-language model's vision tower alone, `cluster/encoder.py`)
    the router reaches each worker at http://<node ip>:<port>, like any worker that joined by URL

Ray only places and keeps the processes: requests and KV never pass through it. Each
node needs deepinfer and the model (the same --model path, or the default model). The
actors are spread over nodes (`SPREAD`); `--ray-cpus-per-worker` is what each reserves.
Stopping the router kills the actors, and each actor's worker process with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from deepinfer.config import ClusterConfig, EngineConfig, RouterConfig, ServerConfig

logger = logging.getLogger(__name__)


class WorkerActor:
    """Runs one `deepinfer serve --role ...` process on the node Ray placed this actor on."""

    def __init__(self, role: str, engine_flags: list[str], log_level: str, package_root: str,
                 token: str | None = None) -> None:
        import os
        import socket
        import subprocess
        import sys

        import ray

        from deepinfer.cluster.launcher import _die_with_parent, free_port
        from deepinfer.config import CLUSTER_TOKEN_ENV

        self.ip = ray.util.get_node_ip_address()
        port = free_port("0.0.0.0")
        cmd = [sys.executable, "-m", "deepinfer.cli", "--log-level", log_level, "serve", "--role", role,
               "--host", "0.0.0.0", "--advertise-host", self.ip, "--port", str(port), *engine_flags]
        env = dict(os.environ)
        if token:  # the environment, not argv: argv shows in `ps` on the node
            env[CLUSTER_TOKEN_ENV] = token
        if os.path.isdir(os.path.join(package_root, "deepinfer")):  # the driver's checkout, where nodes share it
            env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)  # noqa: PLW1509
        self.url = f"http://{self.ip}:{port}"
        self.hostname = socket.gethostname()

    def info(self) -> dict[str, Any]:
        return {"url": self.url, "pid": self.proc.pid, "host": self.hostname, "alive": self.proc.poll() is None}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except Exception:  # noqa: BLE001 - a stuck worker is killed
                self.proc.kill()


def start_ray_workers(address: str, engine: EngineConfig, cluster: ClusterConfig,
                      log_level: str, token: str | None = None) -> tuple[list[Any], dict[str, list[str]]]:
    """Connect to the Ray cluster and place the worker actors; returns (actors, each role's worker URLs)."""
    try:
        import ray
    except ImportError as e:
        raise ValueError("--ray needs Ray: pip install 'deepinfer[ray]'") from e
    from deepinfer.cluster.launcher import engine_flags

    ray.init(address=None if address == "auto" else address, logging_level=logging.WARNING,
             log_to_driver=False)
    actor_cls = ray.remote(num_cpus=cluster.ray_cpus_per_worker, scheduling_strategy="SPREAD")(WorkerActor)
    roles = (["prefill"] * cluster.prefill_workers + ["decode"] * cluster.decode_workers
             + ["encode"] * cluster.encode_workers)
    from pathlib import Path

    import deepinfer

    root = str(Path(deepinfer.__file__).resolve().parent.parent)
    actors = [actor_cls.remote(role, engine_flags(engine, role), log_level, root, token) for role in roles]
    infos = ray.get([a.info.remote() for a in actors], timeout=300)
    urls: dict[str, list[str]] = {"prefill": [], "decode": [], "encode": []}
    for info, role in zip(infos, roles, strict=True):
        urls[role].append(info["url"])
    return actors, urls


def stop_ray_workers(actors: list[Any]) -> None:
    import ray

    try:
        ray.get([a.stop.remote() for a in actors], timeout=30)
    except Exception:  # noqa: BLE001 - killing the actors below ends their workers too (parent death)
        logger.warning("Ray workers did not stop cleanly", exc_info=True)
    for a in actors:
        ray.kill(a)
    ray.shutdown()


def serve_ray_cluster(engine: EngineConfig, server: ServerConfig, cluster: ClusterConfig, router: RouterConfig,
                      log_level: str = "WARNING") -> None:
    """Place the workers on Ray, then run the router here until interrupted."""
    import dataclasses
    import signal

    from deepinfer.cluster.auth import new_token
    from deepinfer.cluster.router import build_client, model_name_of, run_router

    def interrupted(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    started = time.monotonic()
    token = server.resolved_cluster_token() or new_token()
    server = dataclasses.replace(server, cluster_token=token)
    actors, urls = start_ray_workers(cluster.ray, engine, cluster, log_level, token)
    try:
        router = dataclasses.replace(router, prefill=(*router.prefill, *urls["prefill"]),
                                     decode=(*router.decode, *urls["decode"]), encode=(*router.encode, *urls["encode"]))
        client = build_client(engine.model, engine.kvstore, router, token)
        name = model_name_of(engine.model)
        encoders = f", encode workers {', '.join(urls['encode'])}" if urls["encode"] else ""
        print(f"deepinfer: Ray cluster {cluster.ray}: router http://{server.host}:{server.port}/v1, prefill "
              f"workers {', '.join(urls['prefill'])}, decode workers {', '.join(urls['decode'])}{encoders} (placed "
              f"in {time.monotonic() - started:.0f} s)", flush=True)
        asyncio.run(run_router(client, name, server))
    except KeyboardInterrupt:
        pass
    finally:
        stop_ray_workers(actors)
