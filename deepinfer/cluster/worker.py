"""A prefill or decode worker: the ordinary server plus `/internal/*` endpoints for the router.

    router ── POST /internal/prefill ──▶ prefill worker: opens a KV stream to the decode worker's receiver
                                         (`KVTransfer.open`), runs the prompt to its first token (max_tokens
                                         1, `stream_kv`): each chunk's completed blocks are sent by a
                                         background task while the next chunk computes. NDJSON answer: the
                                         first output at once (with whether the stream is up), then, once the
                                         last blocks went out, how many the receiver verified
    decode worker's KV receiver: imports each arriving batch into its engine at once, held (referenced)
                                         under the transfer id; a transfer that breaks off drops its hold
    router ── POST /internal/decode  ──▶ decode worker: waits until the transfer has ended (most blocks are
                                         imported by then), continues the request after its first token,
                                         releases the hold once the request runs; NDJSON stream of outputs
    router ── GET  /internal/load    ──▶ either: queued prefill seconds (cost model), running requests, KV
                                         tokens / usage / capacity, KV receiver address, what names blocks,
                                         transfer counters
    worker ── POST router/internal/register (heartbeat thread, with --router-url): join by URL

Every /internal request needs the cluster token (`cluster/auth.py`), the KV port its handshake: so the
tenant the router puts in a body (`cache_tenant`, the prefix cache namespace of the client's API key)
is taken as given, and a client cannot name another tenant's blocks by talking to a worker.

The engine is reached only through the `EngineClient` surface (its engine may run in another process):
`facts`, `stats()`, `generate(stream_kv=...)`, and `call("import_kv_blocks" | "release_kv_blocks", ...)`. A request
with images carries them (`multi_modal`: pixels, or an encode worker's embeddings, `cluster/encoder.py`) to the
prefill and the decode worker alike: the decode worker recomputes the prompt's last partial block, which may hold
image placeholders.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import socket
import threading
import time
from typing import Any

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import StreamingResponse

from deepinfer.cluster.auth import require_token, token_headers
from deepinfer.cluster.policies import queued_since
from deepinfer.cluster.transfer import (
    IncomingTransfer,
    KVSendStream,
    KVTransfer,
    KVTransferError,
    TCPKVTransfer,
)
from deepinfer.cluster.wire import logprobs_from_json, output_delta_to_json, output_to_json, params_from_json
from deepinfer.config import ClusterConfig, ServerConfig
from deepinfer.engine.cost_model import TERMS, CostModel
from deepinfer.engine.engine_client import EngineClient, EngineDeadError
from deepinfer.multimodal.inputs import MultiModalInputs
from deepinfer.server.protocol import APIError

logger = logging.getLogger(__name__)

RECEIVE_TIMEOUT = 30.0  # how long a decode waits for the end of a transfer the prefill worker started
OPEN_TIMEOUT = 5.0
FINISH_TIMEOUT = 60.0
ENGINE_CALL_TIMEOUT = 60.0
HOLD_TTL = 120.0  # a transfer no decode request claimed by then is dropped, its blocks released


@dataclasses.dataclass
class Arrival:
    """One incoming transfer on a decode worker."""

    imported: int = 0  # blocks the engine holds for it
    before_decode: int = 0  # ... of which imported before the decode request arrived
    ok: bool | None = None  # None while it runs; False: it broke off (what arrived stays usable)
    claimed: bool = False
    short: bool = False  # an import came back short: later blocks would leave a gap in the chain
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


def prefill_estimate(stats: dict[str, float], num_prompt_tokens: int,
                     multi_modal: MultiModalInputs | None = None) -> float:
    """A prompt's prefill seconds as this worker's engine prices them (`stats`: its snapshot): the text under its
    cost model, and the image tiles it will encode at its tower's seconds per tile (a tile can outweigh the
    text many times over: left out, a worker busy with an image reported itself nearly idle)."""
    tiles = multi_modal.tiles_to_encode(0) if multi_modal is not None else 0
    return (CostModel(cost_coefficients(stats)).prefill_seconds(num_prompt_tokens)
            + tiles * float(stats.get("tile_seconds", 0.0)))


def queued_prefill_seconds(stats: dict[str, float], pending: dict[str, tuple[float, float]], now: float) -> float:
    """Prefill compute queued on a worker at `now`. The engine's estimate (`stats`) is from the end of its
    last step, which is seconds old in the middle of a long prefill step: count it down since then (a
    second of work per second), and add the prompts received after it (`pending`: request id ->
    (received at, estimated seconds)) at their full estimate. Without the countdown a worker nearly
    through a long prompt reports the whole prompt queued until its step ends.

    A snapshot taken after a prompt was received may still predate the engine reading it (it arrives
    through a pipe) and then stays the latest for the whole of that prompt's step: the prompts received
    before the snapshot, each counted down since its arrival, are therefore a floor under it."""
    stamp = float(stats.get("prefill_queued_at", now))
    engine_view = queued_since(float(stats.get("prefill_queued_seconds", 0.0)), stamp, pending, now)
    own_view = sum(est if at >= stamp else queued_since(est, at, {}, now) for at, est in pending.values())
    return max(engine_view, own_view)


def process_cpus() -> list[int]:
    """The CPUs this process may run on ([]: the platform does not say)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def peer_hardware(hardware: str, dtype: str, cpus: list[int]) -> str:
    """What a worker reports as `hardware`: workers reporting the same are peers, whose cost models and seconds
    per image tile the router pools (the same hardware, dtype and CPU count)."""
    return f"{hardware} / {dtype} / {len(cpus)} cpus"


def advertised_url(cluster: ClusterConfig, server: ServerConfig) -> str:
    """The URL a worker registers with the router: --advertise-host, else its listening host (127.0.0.1 for a
    wildcard address)."""
    host = cluster.advertise_host or (server.host if server.host not in ("0.0.0.0", "::") else "127.0.0.1")
    return f"http://{host}:{server.port}"


class WorkerState:
    """What one worker process knows about itself beyond the engine: role, KV receiver, transfers."""

    def __init__(self, engine: EngineClient, cluster: ClusterConfig, server: ServerConfig,
                 transfer: KVTransfer | None = None) -> None:
        self.engine = engine
        self.role = cluster.role
        self.token = server.resolved_cluster_token()
        self.transfer = transfer or TCPKVTransfer(server.host, cluster.kv_transfer_port, cluster.advertise_host,
                                                  token=self.token)
        self._transfer_address: str | None = None
        self._start_lock = asyncio.Lock()
        self.pending_prefill: dict[str, tuple[float, float]] = {}  # request id -> (received at, estimated s)
        self.arrivals: dict[str, Arrival] = {}
        self._tasks: set[asyncio.Task] = set()
        self.counters = dict.fromkeys(("blocks_sent", "blocks_sent_before_first_token", "transfer_failures",
                                       "transfers_received", "transfers_broken", "blocks_imported",
                                       "blocks_imported_before_decode"), 0)

    async def transfer_address(self) -> str:
        """The KV receiver's address (started on first use: the server's event loop runs by then)."""
        async with self._start_lock:
            if self._transfer_address is None:
                self._transfer_address = await self.transfer.start(self._receive)
        return self._transfer_address

    def load(self, kv_address: str | None) -> dict[str, Any]:
        eng = self.engine
        facts = eng.facts
        s = eng.stats()
        block_size = facts["block_size"]
        queued = queued_prefill_seconds(s, self.pending_prefill, time.monotonic())
        cpus = process_cpus()
        return {
            "role": self.role, "pid": os.getpid(), "host": socket.gethostname(), "cpus": cpus,
            "hardware": peer_hardware(facts.get("hardware", ""), facts.get("dtype", ""), cpus),
            "healthy": eng.healthy, "queued_prefill_seconds": queued,
            "prefill_request_ids": list(self.pending_prefill),  # what `queued_prefill_seconds` covers
            "num_running": int(s["num_running"]), "num_waiting": eng.num_waiting(),
            "kv_tokens": int(s.get("kv_tokens", 0)), "kv_usage": float(s["kv_usage"]),
            "kv_capacity_tokens": int(s["kv_blocks_total"]) * block_size,
            "max_num_seqs": facts["max_num_seqs"], "max_model_len": eng.max_model_len,
            "block_size": block_size, "model_identity": facts["model_identity"], "kv_layout": facts["kv_layout"],
            "cost_coefficients": cost_coefficients(s), "kv_transfer": kv_address, **self.counters,
            "transfers_refused": getattr(self.transfer, "refused", 0),  # peers without the cluster token
            "transfers_pending": sum(not a.done.is_set() for a in self.arrivals.values()), "kv_blocks_held": int(s.get("kv_blocks_held_for_imports", 0)),
            "tile_seconds": float(s.get("tile_seconds", 0.0)),  # a vision-language model's tower, per tile
            # the LoRA adapters it serves (--lora-modules): name -> directory, and -> content digest (block names)
            "lora_adapters": facts.get("lora_adapters"), "lora_digests": facts.get("lora_digests"),
            "stats": s,
        }

    def background(self, coro) -> asyncio.Task:
        """Run `coro` on its own, past the HTTP exchange that started it (kept referenced until done)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------------ prefill side

    async def open_stream(self, target: str | None, transfer_id: str | None) -> KVSendStream | None:
        if not target or not transfer_id:
            return None
        try:
            return await self.transfer.open(target, transfer_id, OPEN_TIMEOUT)
        except KVTransferError as e:  # the decode worker recomputes the prompt: slow beats failed
            self.counters["transfer_failures"] += 1
            logger.warning("cannot open a KV stream to %s: %r", target, e)
            return None

    async def finish_stream(self, stream: KVSendStream) -> int:
        try:
            sent = await stream.finish(FINISH_TIMEOUT)
        except (KVTransferError, TimeoutError) as e:
            self.counters["transfer_failures"] += 1
            logger.warning("KV stream failed: %r", e)
            return 0
        self.counters["blocks_sent"] += sent
        return sent

    # ------------------------------------------------------------------ decode side

    def arrival(self, transfer_id: str) -> Arrival:
        a = self.arrivals.get(transfer_id)
        if a is None:
            a = self.arrivals[transfer_id] = Arrival()
            asyncio.get_running_loop().call_later(HOLD_TTL, self._expire, transfer_id, a)
        return a

    def _expire(self, transfer_id: str, a: Arrival) -> None:
        if self.arrivals.get(transfer_id) is a and not a.claimed:
            del self.arrivals[transfer_id]
            self.background(self.release(transfer_id))

    async def release(self, transfer_id: str) -> None:
        """Drop the engine's hold on a transfer's blocks (they stay cached until evicted)."""
        try:
            await asyncio.wait_for(self.engine.call("release_kv_blocks", transfer_id), ENGINE_CALL_TIMEOUT)
        except (EngineDeadError, TimeoutError) as e:
            logger.warning("releasing the KV blocks of transfer %s failed: %r", transfer_id, e)

    async def _receive(self, incoming: IncomingTransfer) -> None:
        """Import an incoming transfer batch by batch, as it arrives (the `KVTransfer` handler)."""
        tid = incoming.transfer_id
        a = self.arrival(tid)
        self.counters["transfers_received"] += 1
        try:
            async for batch in incoming:
                if a.short:
                    continue
                n = await asyncio.wait_for(self.engine.call("import_kv_blocks", batch, tid), ENGINE_CALL_TIMEOUT)
                a.imported += n
                self.counters["blocks_imported"] += n
                if not a.claimed:
                    a.before_decode += n
                    self.counters["blocks_imported_before_decode"] += n
                a.short = n < len(batch)
            a.ok = True
        except (KVTransferError, TimeoutError, EngineDeadError) as e:
            # a prefill worker that died mid-stream: free what arrived (a request retried elsewhere never
            # comes here; one that does finds the blocks cached while they last and recomputes the rest)
            a.ok = False
            self.counters["transfers_broken"] += 1
            logger.warning("KV transfer %s broke off after %d blocks: %r", tid, a.imported, e)
            await self.release(tid)
        finally:
            a.done.set()


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
    for name in ("cache_salt", "cache_tenant", "lora"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise APIError(400, f"{name} must be a string", param=name)
    if body.get("multi_modal") is not None:
        try:
            body["multi_modal"] = MultiModalInputs.from_wire(body["multi_modal"])
        except ValueError as e:
            raise APIError(400, str(e), param="multi_modal") from e
    return body


def add_worker_routes(app: FastAPI, state: WorkerState) -> None:
    engine = state.engine
    internal = APIRouter(prefix="/internal", dependencies=[Depends(require_token(state.token))])

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
        one_token = params.max_tokens is not None and params.max_tokens <= 1
        state.pending_prefill[rid] = (time.monotonic(),
                                      prefill_estimate(engine.stats(), len(prompt_ids), body.get("multi_modal")))
        stream = None if one_token else await state.open_stream(body.get("kv_target"), body.get("transfer_id"))
        final = None
        try:
            async for out in engine.generate(prompt_ids, first_params, request_id=f"{rid}-prefill",
                                             cache_salt=body.get("cache_salt"),
                                             cache_tenant=body.get("cache_tenant"),
                                             retention_class=body.get("retention_class"),
                                             stream_kv=stream is not None, multi_modal=body.get("multi_modal"),
                                             lora=body.get("lora")):
                if out.kv_blocks and stream is not None:
                    stream.send(out.kv_blocks)  # a background task writes them while the next chunk computes
                final = out
        except BaseException:
            if stream is not None:
                state.background(stream.abort())
            raise
        finally:
            state.pending_prefill.pop(rid, None)
        sent_early = stream.blocks_sent if stream is not None else 0
        state.counters["blocks_sent_before_first_token"] += sent_early
        if final is None or final.outputs[0].finish_reason == "stop":
            if stream is not None:  # nothing will continue this request: the receiver drops what it got
                state.background(stream.abort())
            stream = None
        if final is None:
            raise APIError(503, "the prefill produced no output", type="server_error")
        # the rest of the stream ends on its own, even if the router stops reading this answer
        finishing = state.background(state.finish_stream(stream)) if stream is not None else None
        first = {"output": output_to_json(final), "kv_stream": stream is not None,
                 "blocks_sent_before_first_token": sent_early}

        async def lines():
            yield json.dumps(first) + "\n"
            yield json.dumps({"blocks_sent": await asyncio.shield(finishing) if finishing else 0}) + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @internal.post("/decode")
    async def decode(raw: Request):
        body = await _read(raw, "request_id", "prompt_token_ids", "params", "output_prefix")
        params = body["params"]
        tid = body.get("transfer_id")
        arrival: Arrival | None = None
        waited = 0.0
        if tid:
            await state.transfer_address()
            arrival = state.arrival(tid)
            arrival.claimed = True
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(arrival.done.wait(), RECEIVE_TIMEOUT)
            except TimeoutError:
                logger.warning("the KV stream of %s did not end in time; recomputing the rest", body["request_id"])
            waited = time.monotonic() - t0
        try:
            gen = engine.generate(list(body["prompt_token_ids"]), params, request_id=body["request_id"],
                                  cache_salt=body.get("cache_salt"), cache_tenant=body.get("cache_tenant"),
                                  retention_class=body.get("retention_class"),
                                  output_prefix=list(body["output_prefix"]),
                                  prefix_logprobs=logprobs_from_json(body.get("prefix_logprobs")),
                                  multi_modal=body.get("multi_modal"), lora=body.get("lora"))
            try:  # the first output before the 200, so engine-side rejections still get their status
                first = await gen.__anext__()
            except StopAsyncIteration:
                first = None
        finally:
            if tid:  # the request holds its own references to the blocks by now (or never will)
                state.arrivals.pop(tid, None)
                await state.release(tid)
        imported = {"imported_blocks": arrival.imported if arrival else 0,
                    "imported_before_decode": arrival.before_decode if arrival else 0,
                    "transfer_wait_seconds": waited}

        async def lines():
            try:
                yield json.dumps(imported) + "\n"
                if first is None or first.finished:
                    if first is not None:
                        yield json.dumps(output_delta_to_json(first)) + "\n"
                    return
                yield json.dumps(output_delta_to_json(first)) + "\n"
                async for out in gen:
                    yield json.dumps(output_delta_to_json(out)) + "\n"
            except Exception as e:  # noqa: BLE001 - the status is sent; report in-band
                yield json.dumps({"error": str(e), "status": getattr(e, "status", 503)}) + "\n"
            finally:
                await gen.aclose()  # the router went away: abort the request, free its blocks

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    app.include_router(internal)


def start_heartbeat(router_url: str, worker_url: str, role: str, interval: float = 1.0,
                    token: str | None = None) -> threading.Event:
    """Register with the router now and again every `interval` seconds (the router drops a worker it has
    not heard from); returns the event that stops it. A daemon thread: it dies with the process."""
    stop = threading.Event()

    def run() -> None:
        with httpx.Client(timeout=5, headers=token_headers(token)) as client:
            while not stop.is_set():
                try:
                    r = client.post(f"{router_url.rstrip('/')}/internal/register",
                                    json={"url": worker_url, "role": role})
                    if r.status_code == 401:
                        logger.warning("the router at %s refuses this worker: give both the same cluster token "
                                       "(--cluster-token or $DEEPINFER_CLUSTER_TOKEN)", router_url)
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
            start_heartbeat(cluster.router_url, advertised_url(cluster, server), cluster.role, token=state.token)

    return customize
