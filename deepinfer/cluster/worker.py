"""A prefill or decode worker: the ordinary server plus `/internal/*` endpoints for the router.

    router ── POST /internal/prefill ──▶ prefill worker: run the prompt to its first token (max_tokens 1);
                                         NDJSON answer: the first output at once, then (after exporting the
                                         prompt's full KV blocks and shipping them to the decode worker's
                                         KV receiver, `KVTransfer`) how many blocks arrived
    router ── POST /internal/decode  ──▶ decode worker: claim the shipped blocks, import them into the prefix
                                         cache, continue the request after its first token; NDJSON stream
                                         of outputs (text and logprobs include the first token)
    router ── GET  /internal/load    ──▶ either: queued prefill seconds (cost model), running requests, KV
                                         tokens / usage / capacity, KV receiver address, what names blocks
    worker ── POST router/internal/register (heartbeat thread, with --router-url): join by URL

The engine is reached only through the `EngineClient` surface (its engine may run in another process):
`facts`, `stats()`, `generate`, and `call("export_kv_blocks" | "import_kv_blocks", ...)`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import threading
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import StreamingResponse

from deepinfer.cluster.transfer import KVTransfer, KVTransferError, TCPKVTransfer
from deepinfer.cluster.wire import logprobs_from_json, output_to_json, params_from_json
from deepinfer.config import ClusterConfig, ServerConfig
from deepinfer.engine.cost_model import TERMS, CostModel
from deepinfer.engine.engine_client import EngineClient
from deepinfer.server.protocol import APIError

logger = logging.getLogger(__name__)

RECEIVE_TIMEOUT = 30.0  # the router calls decode only after the prefill's send was acknowledged
ENGINE_CALL_TIMEOUT = 60.0


class WorkerState:
    """What one worker process knows about itself beyond the engine: role, KV receiver, in-flight prefills."""

    def __init__(self, engine: EngineClient, cluster: ClusterConfig, server: ServerConfig,
                 transfer: KVTransfer | None = None) -> None:
        self.engine = engine
        self.role = cluster.role
        self.transfer = transfer or TCPKVTransfer(server.host, cluster.kv_transfer_port, cluster.advertise_host)
        self._transfer_address: str | None = None
        self._start_lock = asyncio.Lock()
        self.pending_prefill_seconds: dict[str, float] = {}
        self.blocks_sent = 0
        self.transfer_failures = 0

    async def transfer_address(self) -> str:
        """The KV receiver's address (started on first use: the server's event loop runs by then)."""
        async with self._start_lock:
            if self._transfer_address is None:
                self._transfer_address = await self.transfer.start()
        return self._transfer_address

    def load(self, kv_address: str | None) -> dict[str, Any]:
        eng = self.engine
        facts = eng.facts
        s = eng.stats()
        block_size = facts["block_size"]
        queued = max(float(s.get("prefill_queued_seconds", 0.0)), sum(self.pending_prefill_seconds.values()))
        return {
            "role": self.role, "pid": os.getpid(), "healthy": eng.healthy, "queued_prefill_seconds": queued,
            "num_running": int(s["num_running"]), "num_waiting": eng.num_waiting(),
            "kv_tokens": int(s.get("kv_tokens", 0)), "kv_usage": float(s["kv_usage"]),
            "kv_capacity_tokens": int(s["kv_blocks_total"]) * block_size,
            "max_num_seqs": facts["max_num_seqs"], "max_model_len": eng.max_model_len,
            "block_size": block_size, "model_identity": facts["model_identity"], "kv_layout": facts["kv_layout"],
            "cost_coefficients": cost_coefficients(s),
            "kv_transfer": kv_address, "blocks_sent": self.blocks_sent, "transfer_failures": self.transfer_failures,
            "stats": s,
        }


def cost_coefficients(stats: dict[str, float]) -> list[float]:
    """The engine's current cost-model coefficients, in `TERMS` order, from its stats snapshot."""
    return [float(stats[f"cost_coef_{t}"]) for t in TERMS]


async def _read(raw: Request, *required: str) -> dict[str, Any]:
    """The JSON body with its required fields, else a 400 (the router is the only intended caller, but bad
    input still gets a clear error, never a 500)."""
    try:
        body = await raw.json()
    except ValueError as e:
        raise APIError(400, f"the body is not JSON: {e}") from e
    missing = [k for k in required if k not in body] if isinstance(body, dict) else list(required)
    if missing:
        raise APIError(400, f"missing fields: {', '.join(missing)}", param=missing[0])
    try:
        body["params"] = params_from_json(body["params"]) if "params" in body else None
    except (TypeError, ValueError) as e:
        raise APIError(400, f"invalid params: {e}", param="params") from e
    return body


def add_worker_routes(app: FastAPI, state: WorkerState) -> None:
    engine = state.engine
    internal = APIRouter(prefix="/internal")

    @internal.get("/load")
    async def load():
        return state.load(await state.transfer_address())

    @internal.post("/prefill")
    async def prefill(raw: Request):
        body = await _read(raw, "request_id", "prompt_token_ids", "params")
        prompt_ids = list(body["prompt_token_ids"])
        params = body["params"]
        rid = body["request_id"]
        first_params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        state.pending_prefill_seconds[rid] = CostModel(cost_coefficients(engine.stats())).prefill_seconds(
            len(prompt_ids))
        final = None
        try:
            async for out in engine.generate(prompt_ids, first_params, request_id=f"{rid}-prefill",
                                             cache_salt=body.get("cache_salt"),
                                             retention_class=body.get("retention_class")):
                final = out
        finally:
            state.pending_prefill_seconds.pop(rid, None)
        if final is None:
            raise APIError(503, "the prefill produced no output", type="server_error")
        target = body.get("kv_target")
        done = final.outputs[0].finish_reason == "stop" or (params.max_tokens is not None and params.max_tokens <= 1)

        async def ship() -> int:
            if not target or done:
                return 0
            blocks = await asyncio.wait_for(engine.call("export_kv_blocks", prompt_ids, body.get("cache_salt")),
                                            ENGINE_CALL_TIMEOUT)
            try:
                sent = await state.transfer.send(target, body["transfer_id"], blocks)
            except (KVTransferError, TimeoutError) as e:
                # the decode worker recomputes the prompt; a slow answer beats a failed request
                state.transfer_failures += 1
                logger.warning("KV transfer for %s failed: %r", rid, e)
                return 0
            state.blocks_sent += sent
            return sent

        async def lines():
            # the first token goes out at once (the router streams it to the client) and the KV ships
            # after it: the transfer overlaps the router's work instead of delaying the first token
            yield json.dumps({"output": output_to_json(final)}) + "\n"
            yield json.dumps({"blocks_sent": await ship()}) + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @internal.post("/decode")
    async def decode(raw: Request):
        body = await _read(raw, "request_id", "prompt_token_ids", "params", "output_prefix")
        params = body["params"]
        blocks: list = []
        if body.get("transfer_id"):
            await state.transfer_address()
            try:
                blocks = await state.transfer.receive(body["transfer_id"], RECEIVE_TIMEOUT)
            except TimeoutError:
                logger.warning("KV for %s did not arrive; recomputing its prompt", body["request_id"])
        imported = (await asyncio.wait_for(engine.call("import_kv_blocks", blocks), ENGINE_CALL_TIMEOUT)
                    if blocks else 0)
        gen = engine.generate(list(body["prompt_token_ids"]), params, request_id=body["request_id"],
                              cache_salt=body.get("cache_salt"), retention_class=body.get("retention_class"),
                              output_prefix=list(body["output_prefix"]),
                              prefix_logprobs=logprobs_from_json(body.get("prefix_logprobs")))
        try:  # the first output before the 200, so engine-side rejections still get their status
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = None

        async def lines():
            try:
                yield json.dumps({"imported_blocks": imported}) + "\n"
                if first is None or first.finished:
                    if first is not None:
                        yield json.dumps(output_to_json(first)) + "\n"
                    return
                yield json.dumps(output_to_json(first)) + "\n"
                async for out in gen:
                    yield json.dumps(output_to_json(out)) + "\n"
            except Exception as e:  # noqa: BLE001 - the status is sent; report in-band
                yield json.dumps({"error": str(e), "status": getattr(e, "status", 503)}) + "\n"
            finally:
                await gen.aclose()  # the router went away: abort the request, free its blocks

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    app.include_router(internal)


def start_heartbeat(router_url: str, worker_url: str, role: str, interval: float = 1.0) -> threading.Event:
    """Register with the router now and again every `interval` seconds (the router drops a worker it has
    not heard from); returns the event that stops it. A daemon thread: it dies with the process."""
    stop = threading.Event()

    def run() -> None:
        with httpx.Client(timeout=5) as client:
            while not stop.is_set():
                try:
                    client.post(f"{router_url.rstrip('/')}/internal/register", json={"url": worker_url, "role": role})
                except httpx.HTTPError as e:
                    logger.debug("heartbeat to %s failed: %r", router_url, e)
                stop.wait(interval)

    threading.Thread(target=run, name="deepinfer-heartbeat", daemon=True).start()
    return stop


def worker_customizer(cluster: ClusterConfig, server: ServerConfig):
    """The `serve(customize=...)` hook of a prefill or decode worker."""

    def customize(app: FastAPI, engine: EngineClient) -> None:
        state = WorkerState(engine, cluster, server)
        app.state.worker = state
        add_worker_routes(app, state)
        if cluster.router_url:
            host = cluster.advertise_host or (server.host if server.host not in ("0.0.0.0", "::") else "127.0.0.1")
            start_heartbeat(cluster.router_url, f"http://{host}:{server.port}", cluster.role)

    return customize
