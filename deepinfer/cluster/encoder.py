"""An encode worker: a vision-language model's vision tower alone, behind the router's /internal calls.

    router ── POST /internal/encode ──▶ a prompt's image tiles encoded (`TileEncoder`: the encoded-tile cache, then
                                        the tower, on a thread of its own, one call at a time) ─▶ their embeddings,
                                        which the router sends to the prefill and decode workers in place of pixels
    router ── GET  /internal/load   ──▶ role, health, the tower's seconds per tile, tiles in hand and encoded
    probes ── GET  /health, /metrics
    worker ── POST router/internal/register (heartbeat thread, with --router-url)

It builds and loads the tower and connector only (`models.registry.build_image_encoder`, what vLLM's
`--mm-encoder-only` does): no text layers, no KV cache, no engine. The /internal routes need the cluster token
(`cluster/auth.py`).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest

from deepinfer.cluster.auth import require_token
from deepinfer.cluster.worker import advertised_url, peer_hardware, process_cpus, start_heartbeat
from deepinfer.config import ClusterConfig, EngineConfig, ServerConfig
from deepinfer.multimodal.encoder import TileEncoder, tile_stats
from deepinfer.multimodal.inputs import MultiModalInputs
from deepinfer.server.metrics import image_metrics
from deepinfer.server.protocol import APIError


class EncodeWorker:
    """The tower of `config`'s model (ValueError for a text model) and what an encode worker reports of it."""

    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoConfig

        from deepinfer.engine.engine import hardware_name
        from deepinfer.engine.runner import resolve_device, resolve_dtype
        from deepinfer.models.registry import build_image_encoder
        from deepinfer.weights import resolve_model

        mc = config.model
        files = resolve_model(mc.model)
        device = resolve_device(mc.device)
        dtype = resolve_dtype(mc.dtype, device)
        if mc.num_threads:
            torch.set_num_threads(mc.num_threads)
        model = build_image_encoder(AutoConfig.from_pretrained(str(files.directory)), dtype, device)
        model.load_weights(files.iter_weights(dtype, prefixes=model.WEIGHT_PREFIXES))
        self.model_name = mc.served_model_name[0] if mc.served_model_name else files.name
        self.dtype, self.device = dtype, device
        self.num_parameters = sum(p.numel() for p in model.parameters())
        self.tiles = TileEncoder(model, config.cache.image_cache_memory)
        if config.scheduler.profile_cost_model:
            self.tiles.profile()
        self.cpus = process_cpus()
        self.hardware = peer_hardware(hardware_name(device), str(dtype), self.cpus)
        self.num_encoded = 0  # tiles asked for (cache hits included)
        self.in_hand: dict[int, int] = {}  # call -> tiles, queued or encoding
        self._calls = itertools.count()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-encode")

    async def encode(self, inputs: MultiModalInputs) -> MultiModalInputs:
        """`inputs` encoded, on the tower's thread (the event loop keeps answering polls meanwhile)."""
        call = next(self._calls)
        self.in_hand[call] = inputs.num_tiles
        try:
            encoded = await asyncio.get_running_loop().run_in_executor(self._thread, self.tiles.encode, inputs)
        finally:
            del self.in_hand[call]
        self.num_encoded += inputs.num_tiles
        return encoded

    def stats(self) -> dict[str, float]:
        return {**tile_stats(self.tiles), "encoded_tiles": self.num_encoded,
                "tiles_in_hand": sum(self.in_hand.values())}

    def load(self) -> dict[str, Any]:
        s = self.stats()
        return {"role": "encode", "pid": os.getpid(), "host": socket.gethostname(), "cpus": self.cpus,
                "hardware": self.hardware, "healthy": True, "num_waiting": len(self.in_hand),
                "tile_seconds": s["tile_seconds"], "encoded_tiles": self.num_encoded,
                "tiles_in_hand": s["tiles_in_hand"], "parameters": self.num_parameters, "stats": s}


class _TowerCollector:
    def __init__(self, worker: EncodeWorker) -> None:
        self.worker = worker

    def collect(self):
        yield from image_metrics(self.worker.stats(), self.worker.model_name)


def build_encoder_app(worker: EncodeWorker, token: str | None = None) -> FastAPI:
    """The encode worker's HTTP surface; `token`: what /internal/* requires (None: open)."""
    app = FastAPI(title="deepinfer encode worker")

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    registry = CollectorRegistry()
    registry.register(_TowerCollector(worker))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    internal = APIRouter(prefix="/internal", dependencies=[Depends(require_token(token))])

    @internal.get("/load")
    async def load() -> dict[str, Any]:
        return worker.load()

    @internal.post("/encode")
    async def encode(raw: Request) -> dict[str, Any]:
        try:
            body = await raw.json()
        except ValueError as e:
            raise APIError(400, f"the body is not JSON: {e}") from e
        if not isinstance(body, dict) or not isinstance(body.get("multi_modal"), dict):
            raise APIError(400, "missing fields: multi_modal", param="multi_modal")
        try:
            encoded = await worker.encode(MultiModalInputs.from_wire(body["multi_modal"]))
        except ValueError as e:
            raise APIError(400, str(e), param="multi_modal") from e
        return {"multi_modal": encoded.to_wire()}

    app.include_router(internal)
    return app


def serve_encode_worker(engine: EngineConfig, server: ServerConfig, cluster: ClusterConfig) -> None:
    """Load the tower, then serve until interrupted (`deepinfer serve --role encode`)."""
    import uvicorn

    print("deepinfer: loading the vision tower (an encode worker: no text model, no KV cache) ...", flush=True)
    worker = EncodeWorker(engine)
    print(f"deepinfer: encode worker for {worker.model_name} ({worker.dtype}, {worker.device}); "
          f"{worker.num_parameters / 1e6:.1f}M parameters; "
          f"{(worker.tiles.seconds or 0) * 1000:.0f} ms a tile", flush=True)
    token = server.resolved_cluster_token()
    app = build_encoder_app(worker, token)
    if cluster.router_url:
        start_heartbeat(cluster.router_url, advertised_url(cluster, server), "encode", token=token)
    print(f"deepinfer: encode worker at http://{server.host}:{server.port}", flush=True)
    uvicorn.run(app, host=server.host, port=server.port, log_level=server.uvicorn_log_level,
                timeout_graceful_shutdown=5, lifespan="off")
