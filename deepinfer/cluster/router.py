"""`deepinfer router`: the OpenAI API of `deepinfer serve`, served by prefill and decode workers.

The app is the server's own (`server.app.build_app`) around a `ClusterEngineClient`, plus:
- POST /internal/register {url, role}: a worker joins (or heartbeats) by URL;
- GET /internal/workers: every known worker (prefill, decode, encode), its state and last load report, and the
  router's retry counters;
- /metrics: the server's metrics (engine stats summed over workers) and the scaling signals per
  worker and per pool: queued prefill seconds, running requests, KV tokens and usage, liveness.

The /internal routes need the cluster token (`cluster/auth.py`), which the router also sends on every
worker call; the public API authenticates clients by API key, and each key's tenant goes with its
requests to the workers (`ClusterEngineClient`).

The router loads only the tokenizer and config of the model (no weights).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from prometheus_client.core import GaugeMetricFamily

from deepinfer.cluster.auth import require_token
from deepinfer.cluster.client import ClusterEngineClient
from deepinfer.cluster.policies import make_policy
from deepinfer.cluster.pool import WORKER_ROLES, WorkerPool
from deepinfer.config import KVStoreConfig, LimitsConfig, ModelConfig, RouterConfig, ServerConfig
from deepinfer.server.protocol import APIError

logger = logging.getLogger(__name__)


class ClusterCollector:
    """Prometheus collector of the per-worker and per-pool scaling signals."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def collect(self):
        def family(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"deepinfer:cluster_{name}", doc, labels=labels)

        up = family("worker_up", "1 if the worker is in rotation.", ["worker", "role"])
        queued = family("worker_queued_prefill_seconds", "Estimated prefill compute queued on the worker.",
                        ["worker", "role"])
        running = family("worker_running_requests", "Requests running on the worker.", ["worker", "role"])
        kv_tokens = family("worker_kv_tokens", "KV tokens held by the worker's running requests.", ["worker", "role"])
        kv_usage = family("worker_kv_usage", "Fraction of the worker's KV blocks in use.", ["worker", "role"])
        pool_queued = family("pool_queued_prefill_seconds", "Queued prefill compute summed over the pool.", ["pool"])
        pool_running = family("pool_running_requests", "Running requests summed over the pool.", ["pool"])
        pool_usage = family("pool_kv_usage", "Mean KV usage over the pool's live workers.", ["pool"])
        pool_live = family("pool_workers_live", "Workers of the pool in rotation.", ["pool"])
        for role in WORKER_ROLES:
            members = [w for w in self.pool.workers.values() if w.role == role]
            live = self.pool.rotation(role)
            for w in members:
                v = w.view()
                usage = float(w.load.get("kv_usage", 0.0))
                up.add_metric([w.url, role], 1.0 if w in live else 0.0)
                queued.add_metric([w.url, role], v.queued_prefill_seconds)
                running.add_metric([w.url, role], v.num_running)
                kv_tokens.add_metric([w.url, role], v.kv_tokens)
                kv_usage.add_metric([w.url, role], usage)
            views = [w.view() for w in live]
            pool_queued.add_metric([role], sum(v.queued_prefill_seconds for v in views))
            pool_running.add_metric([role], sum(v.num_running for v in views))
            pool_usage.add_metric([role], sum(float(w.load.get("kv_usage", 0.0)) for w in live) / max(len(live), 1))
            pool_live.add_metric([role], len(live))
        yield from (up, queued, running, kv_tokens, kv_usage, pool_queued, pool_running, pool_usage, pool_live)


def build_router_app(client: ClusterEngineClient, model_name: str | Sequence[str],
                     api_key: str | Sequence[str] | None = None,
                     cluster_token: str | None = None, limits: LimitsConfig | None = None,
                     cors: dict | None = None) -> FastAPI:
    """`cluster_token`: what /internal/* requires (None: open, for clusters configured without one); `cors`:
    as `build_app` takes it."""
    from deepinfer.server.app import build_app

    # the server's limits and admission, with the cluster's running capacity
    app = build_app(client, model_name, api_key, limits=limits,  # type: ignore[arg-type]  # the EngineClient surface
                    cors=cors)
    pool = client.pool
    app.state.ctx.metrics.registry.register(ClusterCollector(pool))
    internal = APIRouter(prefix="/internal", dependencies=[Depends(require_token(cluster_token))])

    @internal.post("/register")
    async def register(raw: Request):
        body = await raw.json()
        url, role = body.get("url"), body.get("role")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise APIError(400, "url must be an http(s) URL", param="url")
        if role not in WORKER_ROLES:
            raise APIError(400, "role must be prefill, decode or encode", param="role")
        pool.heartbeat(url, role)
        return {"ok": True}

    @internal.get("/workers")
    async def workers() -> dict[str, Any]:
        now = time.monotonic()
        return {"workers": [{
            "url": w.url, "role": w.role, "alive": w.alive, "failures": w.failures,
            "seen_seconds_ago": now - w.last_seen if w.last_seen else None, "requests_routed": w.requests_routed,
            "prefill_seconds_routed": w.prefill_seconds_routed, "decode_tokens_routed": w.decode_tokens_routed,
            "view": {k: v for k, v in vars(w.view()).items() if k != "cost_model"},
            "load": {k: v for k, v in w.load.items() if k != "stats"},
        } for w in pool.workers.values()],
            "prefill_retries": client.num_prefill_retries, "decode_retries": client.num_decode_retries,
            "encode_retries": client.num_encode_retries, "encode_fallbacks": client.num_encode_fallbacks,
            "failed_requests": client.num_failed}

    @internal.get("/routes")
    async def routes() -> dict[str, Any]:
        """The latest routing decisions (at most 1000), oldest first."""
        return {"routes": list(client.recent_routes)}

    app.include_router(internal)
    return app


def build_client(model: ModelConfig, kvstore: KVStoreConfig, router: RouterConfig,
                 token: str | None = None) -> ClusterEngineClient:
    """Pool, policy and tokenizer of a router (the model's tokenizer and config only; no weights); `token`:
    the cluster token its worker calls carry."""
    from transformers import AutoConfig

    from deepinfer.models.registry import image_facts, text_config
    from deepinfer.multimodal.processor import MultiModalProcessor
    from deepinfer.recipe.tokenizer import eos_token_ids, load_tokenizer, sampling_defaults
    from deepinfer.weights import resolve_model

    files = resolve_model(model.model)
    hf_config = AutoConfig.from_pretrained(str(files.directory))
    tokenizer = load_tokenizer(files) if files.has_tokenizer() else None
    pool = WorkerPool(router.health_interval, router.worker_timeout, token)
    for url in router.prefill:
        pool.add(url, "prefill")
    for url in router.decode:
        pool.add(url, "decode")
    for url in router.encode:
        pool.add(url, "encode")
    policy = make_policy(router.routing_policy, router.decode_running_weight, router.decode_kv_weight,
                         router.decode_locality_margin)
    retention = kvstore.retention
    default_len = model.max_model_len or getattr(text_config(hf_config), "max_position_embeddings", None) or 4096
    store: Path | None = kvstore.store_path()
    images = image_facts(hf_config)  # a vision-language model: the router runs its processor
    processor = MultiModalProcessor(files.directory, *images) if images is not None else None
    hf_config = text_config(hf_config)
    return ClusterEngineClient(pool, policy, tokenizer, hf_config.vocab_size, retention, router, default_len, store,
                               eos_token_ids(tokenizer, hf_config, files.directory), token,
                               sampling_defaults(model.generation_config, files.directory), processor)


def model_name_of(model: ModelConfig) -> tuple[str, ...]:
    """The names the API answers to (the first is the one responses report)."""
    from deepinfer.weights import resolve_model

    return model.served_model_name or (resolve_model(model.model).name,)


async def run_router(client: ClusterEngineClient, model_name: str | Sequence[str], server: ServerConfig,
                     ready_timeout: float = 0.0) -> None:
    """Serve the router until cancelled (the poll loop runs alongside)."""
    import uvicorn

    from deepinfer.recipe.tokenizer import use_chat_template

    use_chat_template(client.tokenizer, server.chat_template)  # the router renders chat prompts
    app = build_router_app(client, model_name, server.api_key, server.resolved_cluster_token(), server.limits,
                           server.cors_options())
    client.pool.start()
    if ready_timeout:
        await client.pool.wait_ready(ready_timeout)
    config = uvicorn.Config(app, host=server.host, port=server.port, log_level=server.uvicorn_log_level,
                            timeout_graceful_shutdown=5, lifespan="off")
    try:
        await uvicorn.Server(config).serve()
    finally:
        await client.pool.close()
        await client.close()


def serve_router(model: ModelConfig, kvstore: KVStoreConfig, router: RouterConfig, server: ServerConfig) -> None:
    token = server.resolved_cluster_token()
    if token is None and server.api_key:
        # tenants are kept apart by what the router tells the workers: without a token, anyone who can
        # reach a worker's /internal endpoints could claim any tenant
        logger.warning("--api-key without a cluster token: workers' /internal endpoints and KV ports are open; "
                       "set --cluster-token or $DEEPINFER_CLUSTER_TOKEN on the router and every worker")
    client = build_client(model, kvstore, router, token)
    name = model_name_of(model)
    print(f"deepinfer: router for {', '.join(name)} at http://{server.host}:{server.port}/v1 ({router.routing_policy} "
          f"policy; {len(router.prefill)} prefill and {len(router.decode)} decode workers listed)", flush=True)
    asyncio.run(run_router(client, name, server))
