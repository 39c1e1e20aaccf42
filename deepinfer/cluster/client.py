"""The router's engine client: the `EngineClient` surface, served by prefill and decode workers.

The OpenAI handlers (`server/openai_api.py`) run unchanged on top of it. One request:

    generate(prompt ids, params)
      ├─ route: policy picks a prefill worker (estimated finish) and a decode worker (load score)
      ├─ POST prefill /internal/prefill  (prompt to its first token; the worker streams the KV to the decode
      │    worker's receiver chunk by chunk meanwhile)
      │                                  connection lost / 5xx before the first token ─▶ next prefill worker
      ├─ yield the first token as soon as it comes (the request continues: finish cleared, stop-string
      │    tail held back); prompt logprobs (completions echo) come with it: the prefill worker runs the
      │    whole prompt, so it computes them, and every later output carries them on
      └─ POST decode /internal/decode at once (the decode worker waits for the last blocks, if the KV
           stream is up; else it recomputes the prompt), stream its outputs (they include the first token)
           lost before its first output ─▶ another decode worker (recomputes the prompt, no KV)
           lost after                   ─▶ WorkerError, which the handlers turn into an error event / 503

Every network wait has a timeout (`RouterConfig`): no request hangs on a dead or stuck worker.
Every worker call carries the cluster token (`cluster/auth.py`), and the request's tenant (the prefix
cache namespace of the client's API key) travels in the body: the workers name its blocks by it, and
the router's own store lookup and in-prefill prefixes hash with it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import Counter, defaultdict, deque
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from deepinfer.cluster.auth import token_headers
from deepinfer.cluster.policies import (
    DeepInferPolicy,
    RouteInfo,
    RoutingPolicy,
    WorkerView,
    estimated_prefill_seconds,
    leading_run,
    prefill_finish,
)
from deepinfer.cluster.pool import Worker, WorkerPool, peer_tile_seconds
from deepinfer.cluster.wire import logprobs_to_json, output_delta_from_json, output_from_json, params_to_json
from deepinfer.config import RouterConfig
from deepinfer.engine.engine_client import EngineDeadError, GrammarChecker
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.spec.metrics import merge_spec_stats
from deepinfer.engine.structured import StructuredOutputParams
from deepinfer.engine.validation import RequestValidator
from deepinfer.kvcache import RetentionPolicy
from deepinfer.kvcache.engine_tiers import resolve_retention
from deepinfer.kvcache.hashing import extend_block_hashes, root_hash
from deepinfer.multimodal.inputs import MultiModalInputs
from deepinfer.multimodal.processor import MultiModalProcessor
from deepinfer.server.protocol import APIError

logger = logging.getLogger(__name__)


class WorkerError(EngineDeadError):
    """No worker could serve the request, or its worker failed mid-way (HTTP 503)."""

    status = 503


class _Retry(Exception):
    pass


class ClusterEngineClient:
    def __init__(self, pool: WorkerPool, policy: RoutingPolicy, tokenizer, vocab_size: int,
                 retention: RetentionPolicy, config: RouterConfig, default_max_model_len: int,
                 store_path: Path | None = None, eos_token_ids: Any = frozenset(), token: str | None = None,
                 sampling_defaults: dict | None = None, multimodal_processor: MultiModalProcessor | None = None) -> None:
        """`multimodal_processor`: a vision-language model's processor (the router tokenizes prompts with images; an
        encode worker, if any, encodes their tiles, else the prefill and decode workers do)."""
        self.pool = pool
        self.multimodal_processor = multimodal_processor
        self.num_encode_retries = 0
        self.num_encode_fallbacks = 0  # requests whose tiles no encode worker encoded (the workers did)
        self._sampling_defaults = dict(sampling_defaults or {})
        self.policy = policy
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._grammars: GrammarChecker | None = None
        self.config = config
        self.retention = retention
        self.vocab_size = vocab_size
        self._default_max_model_len = default_max_model_len
        self.store_path = store_path
        self._store: Any = None
        # no connection cap: every open decode stream holds one, and a capped pool would queue new requests
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(config.prefill_timeout, connect=5.0),
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                                         headers=token_headers(token))
        # the latest routing decisions, newest last (GET /internal/routes): why a request went where it went
        self.recent_routes: deque[dict[str, Any]] = deque(maxlen=1000)
        # per prefill worker, the block hashes of the prompts this router has in prefill there (a prompt
        # sharing their prefix finds it in that worker's cache once they are done)
        self._prefilling: defaultdict[str, Counter[bytes]] = defaultdict(Counter)
        self.num_prefill_retries = 0
        self.num_decode_retries = 0
        self.num_failed = 0
        # the cluster's context length is its smallest live worker's: checked here, once, like a server's
        self.validator = RequestValidator(vocab_size, lambda: self.max_model_len, tokenizer is not None,
                                          self.check_retention)

    # ------------------------------------------------------------------ the EngineClient surface

    @property
    def healthy(self) -> bool:
        return bool(self.pool.rotation("prefill") and self.pool.rotation("decode"))

    @property
    def max_model_len(self) -> int:
        lens = [int(w.load["max_model_len"]) for w in self.pool.workers.values()
                if w.alive and w.load and w.role != "encode"]
        return min(lens) if lens else self._default_max_model_len

    def num_waiting(self) -> int:
        return sum(len(w.inflight_prefill) for w in self.pool.workers.values())

    @property
    def sampling_defaults(self) -> dict:
        return dict(self._sampling_defaults)

    @property
    def lora_adapters(self) -> dict[str, str] | None:
        """The LoRA adapters the workers serve (their --lora-modules, the same on every worker), as a worker
        reports them; None where they serve none."""
        return self.pool.any_load().get("lora_adapters")

    # a cluster's adapters are its workers' --lora-modules: the server's load / unload routes refuse
    loads_lora_adapters = False

    @property
    def running_capacity(self) -> int:
        """Sequences the cluster runs at once: max_num_seqs summed over the decode workers in rotation (every
        request ends up on one); the router's admission bound builds on it."""
        return sum(int(w.load.get("max_num_seqs", 0)) for w in self.pool.rotation("decode")) or 1

    def check_admission(self, num_requests: int = 1) -> None:
        if not self.healthy:
            raise WorkerError("no prefill or no decode worker is available")

    async def compile_grammar(self, params: StructuredOutputParams) -> None:
        """Reject an invalid grammar here, before a worker sees the request (see `GrammarChecker`)."""
        if self._grammars is None:
            self._grammars = GrammarChecker(self.tokenizer, self.vocab_size, self.eos_token_ids)
        await self._grammars.check(params)

    def check_retention(self, retention_class: str | None) -> str:
        return resolve_retention(self.retention, retention_class)

    def abort(self, request_id: str) -> None:
        """Nothing to do: closing the `generate` stream closes the worker connections, which aborts there."""

    def stats(self) -> dict[str, Any]:
        """Engine stats summed over live workers (ratios and cost-model terms averaged); speculative decoding's
        per proposer under "spec" (`merge_spec_stats`: summed counters, ratios recomputed from them)."""
        out: defaultdict[str, Any] = defaultdict(float)
        live = [w for w in self.pool.workers.values() if w.alive and w.load.get("stats")]
        for w in live:
            for k, v in w.load["stats"].items():
                # timestamps do not add up; speculative counters are kept per proposer below
                if isinstance(v, int | float) and not k.endswith("_at") and not k.startswith("spec_"):
                    out[k] += v
        spec = merge_spec_stats(w.load["stats"] for w in live)
        if spec:
            out["spec"] = spec
        for k in list(out):
            if k in ("kv_usage", "tile_seconds") or k.startswith(("cost_", "step_time")):
                out[k] /= max(len(live), 1)
        out["num_waiting"] = float(out["num_waiting"])
        return out

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       prompt: str | None = None, cache_salt: str | None = None,
                       retention_class: str | None = None, cache_tenant: str | None = None,
                       multi_modal: MultiModalInputs | None = None, lora: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        digest = None
        if lora is not None:
            digest = (self.pool.any_load().get("lora_digests") or {}).get(lora)
            if digest is None:
                raise ValueError(f"no LoRA adapter named {lora!r} on this cluster's workers")
        retention_class = self.validator.validate(prompt_token_ids, params, retention_class)
        if multi_modal is not None:
            multi_modal = await self._encode(multi_modal)
        adapter = (lora, digest) if lora is not None else None
        if params.n > 1:
            gen = self._generate_n(prompt_token_ids, params, request_id, prompt, cache_salt, retention_class,
                                   cache_tenant, multi_modal, adapter)
        else:
            gen = self._generate_one(prompt_token_ids, params, request_id, cache_salt, retention_class, cache_tenant,
                                     multi_modal, adapter)
        async with contextlib.aclosing(gen):
            async for out in gen:
                yield out

    async def _generate_one(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None,
                            cache_salt: str | None, retention_class: str | None, cache_tenant: str | None,
                            multi_modal: MultiModalInputs | None = None, adapter: tuple[str, str] | None = None
                            ) -> AsyncIterator[RequestOutput]:
        """One sequence (validated): prefill on one worker, decode on another; `adapter`: the LoRA adapter's
        (name, content digest) it runs with. The decode worker's lines add up
        to its whole output (which starts with the prefill's token); the deltas yielded here (`delta_text`,
        `delta_token_ids`) are taken against what this stream yielded before, as the prefill's first output
        held back the text a stop string could still claim."""
        sent = _Sent()
        rid = request_id or f"rreq-{uuid.uuid4().hex}"
        hashes, block_size = self._block_hashes(prompt_token_ids, cache_salt, cache_tenant, multi_modal,
                                                adapter[1] if adapter is not None else None)
        route = RouteInfo(len(prompt_token_ids), await self._store_hits(hashes, block_size),
                          params.max_tokens if params.max_tokens is not None else self.max_model_len,
                          self._inflight_prefixes(hashes, block_size), _tiles_to_prefill(multi_modal))
        base = {"request_id": rid, "prompt_token_ids": prompt_token_ids, "params": params_to_json(params),
                "cache_salt": cache_salt, "cache_tenant": cache_tenant, "retention_class": retention_class}
        if multi_modal is not None:
            base["multi_modal"] = multi_modal.to_wire()
        if adapter is not None:
            base["lora"] = adapter[0]
        shipment: _Shipment | None = None
        decoder: Worker | None = None
        try:
            first, decoder, shipment = await self._prefill(base, route, hashes)
            first.request_id = rid
            if first.finished and (first.outputs[0].finish_reason == "stop" or route.max_tokens <= 1):
                yield sent.deltas(first)
                return
            yield sent.deltas(_continuing(first, params))
            transfer_id = shipment.transfer_id if shipment.kv_stream else ""
            async for out in self._decode(base, route, first, decoder, transfer_id):
                yield sent.deltas(out)
        except WorkerError:
            self.num_failed += 1
            raise
        finally:
            if decoder is not None:  # its reservation, if the request never reached it (or ended there)
                decoder.inflight_decode_tokens.pop(rid, None)
            if shipment is not None:
                await shipment.close()

    async def _generate_n(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None,
                          prompt: str | None, cache_salt: str | None, retention_class: str | None,
                          cache_tenant: str | None, multi_modal: MultiModalInputs | None,
                          adapter: tuple[str, str] | None) -> AsyncIterator[RequestOutput]:
        """n > 1: n independent one-sequence requests (seeds seed, seed+1, ... as the engine gives its
        children), each routed on its own, merged into one output with n choices."""
        from deepinfer.server.serving import merge

        rid = request_id or f"rreq-{uuid.uuid4().hex}"
        subs = [self._generate_one(prompt_token_ids, replace(params, n=1, seed=None if params.seed is None else
                                                             params.seed + i), f"{rid}-{i}", cache_salt,
                                   retention_class, cache_tenant, multi_modal, adapter) for i in range(params.n)]
        latest: list[RequestOutput | None] = [None] * params.n
        async for i, out in merge(subs):
            latest[i] = out
            done = [o for o in latest if o is not None]
            # only the choice that advanced has something new
            yield replace(done[0], request_id=rid, finished=all(o is not None and o.finished for o in latest),
                          outputs=[replace(o.outputs[0], index=j) if j == i else
                                   replace(o.outputs[0], index=j, delta_text="", delta_token_ids=[])
                                   for j, o in enumerate(latest) if o is not None])

    # ------------------------------------------------------------------ encode

    async def _encode(self, multi_modal: MultiModalInputs) -> MultiModalInputs:
        """The tiles encoded by an encode worker (the one that would finish them first; another if it fails); as
        they are (pixels: the prefill and decode workers encode them) when the cluster has none or none answers."""
        tried: set[str] = set()
        while True:
            workers = [w for w in self.pool.rotation("encode") if w.url not in tried]
            if not workers:
                if tried:
                    self.num_encode_fallbacks += 1
                    logger.warning("no encode worker answered; the prefill and decode workers encode the images")
                return multi_modal
            # when each would be done with these: the tiles it has in hand and these, at its measured speed
            # (one not measured yet counts a second a tile)
            tile_seconds = peer_tile_seconds(workers)
            w = min(workers, key=lambda w: ((sum(w.inflight_encode.values()) + multi_modal.num_tiles)
                                            * (tile_seconds[w.url] or 1.0), w.requests_routed))
            tried.add(w.url)
            key = uuid.uuid4().hex
            w.inflight_encode[key] = multi_modal.num_tiles
            w.requests_routed += 1
            try:
                r = await self._client.post(f"{w.url}/internal/encode", json={"multi_modal": multi_modal.to_wire()})
                if r.status_code == 400:  # the images, not the worker: the same anywhere
                    _json_or_error(r)
                if r.status_code != 200:
                    raise httpx.HTTPStatusError(f"HTTP {r.status_code}", request=r.request, response=r)
                encoded = MultiModalInputs.from_wire(r.json()["multi_modal"])
                if encoded.tile_hashes != multi_modal.tile_hashes or encoded.embeddings is None:
                    raise ValueError("the encode worker answered for other tiles")
                return encoded
            except (httpx.HTTPError, ValueError, KeyError) as e:
                self.num_encode_retries += 1
                self.pool.mark_failed(w, f"encode failed: {e!r}")
            finally:
                w.inflight_encode.pop(key, None)

    # ------------------------------------------------------------------ prefill

    async def _prefill(self, base: dict, route: RouteInfo,
                       hashes: list[bytes]) -> tuple[RequestOutput, Worker, _Shipment]:
        tried: set[str] = set()
        last_error = "no prefill worker is available"
        for attempt in range(self.config.max_prefill_attempts):
            prefills = [w for w in self.pool.rotation("prefill") if w.url not in tried]
            decodes = self.pool.rotation("decode")
            if not prefills or not decodes:
                break
            views = self.pool.views(prefills)
            pview = self.policy.pick_prefill(views, route)
            pw = _by_url(prefills, pview.url)
            dw, dviews = self._pick_decode(decodes, route, pview)
            # counted against the decode worker from the pick on: requests still in prefill must not be
            # invisible to the next pick, or every arrival in that window herds onto one worker
            dw.inflight_decode_tokens[base["request_id"]] = route.num_prompt_tokens + 1
            picked = False
            tried.add(pw.url)
            transfer_id = uuid.uuid4().hex
            estimate = estimated_prefill_seconds(pview, route)
            self.recent_routes.append({
                "request_id": base["request_id"], "at": time.time(), "attempt": attempt,
                "prompt_tokens": route.num_prompt_tokens, "cached_tokens": route.num_cached_tokens,
                "inflight_prefix_tokens": dict(route.inflight_prefix_tokens),
                "prefill": pw.url, "prefill_queued_seconds": pview.queued_prefill_seconds,
                "prefill_estimate_seconds": estimate, "prefill_tiles": route.tiles_on(pview), "decode": dw.url,
                # every candidate as the policy saw it: queued seconds + this prompt's estimate there
                "prefill_finishes": {v.url: prefill_finish(v, route) for v in views},
                "decode_loads": {v.url: _decode_load(v, self.policy) for v in dviews}})
            pw.inflight_prefill[base["request_id"]] = (time.monotonic(), estimate)
            self._prefilling[pw.url].update(hashes)
            pw.requests_routed += 1
            pw.prefill_seconds_routed += estimate
            r: httpx.Response | None = None
            try:
                request = self._client.build_request("POST", f"{pw.url}/internal/prefill", json={
                    **base, "kv_target": dw.load.get("kv_transfer"), "transfer_id": transfer_id})
                r = await self._client.send(request, stream=True)
                if r.status_code != 200:
                    await r.aread()
                    _json_or_error(r)
                lines = r.aiter_lines()
                first = await _next_line(lines)
                if first is None:
                    raise _Retry("the prefill answer ended before its first token")
                picked = True
                shipment = _Shipment(r, transfer_id, bool(first.get("kv_stream")))
                return output_from_json(first["output"]), dw, shipment
            except httpx.TimeoutException as e:
                if r is not None:
                    await r.aclose()
                raise WorkerError(f"prefill worker {pw.url} did not answer in {self.config.prefill_timeout:.0f} s") \
                    from e
            except APIError:
                if r is not None:
                    await r.aclose()
                raise
            except (httpx.TransportError, _Retry, ValueError) as e:
                if r is not None:
                    await r.aclose()
                self.pool.mark_failed(pw, f"prefill failed: {e!r}")
                last_error = f"prefill worker {pw.url} failed: {e!r}"
                if attempt + 1 < self.config.max_prefill_attempts:
                    self.num_prefill_retries += 1
            finally:
                pw.inflight_prefill.pop(base["request_id"], None)
                self._prefilling[pw.url] -= Counter(hashes)  # (drops the counts that reach zero)
                if not picked:
                    dw.inflight_decode_tokens.pop(base["request_id"], None)
        raise WorkerError(last_error)

    def _pick_decode(self, workers: list[Worker], route: RouteInfo,
                     prefill: WorkerView | None) -> tuple[Worker, list[WorkerView]]:
        """The decode worker for `route`, and the views of `workers` the policy chose from."""
        views = [w.view() for w in workers]
        return _by_url(workers, self.policy.pick_decode(views, route, prefill).url), views

    # ------------------------------------------------------------------ decode

    async def _decode(self, base: dict, route: RouteInfo, first: RequestOutput, dw: Worker,
                      transfer_id: str) -> AsyncIterator[RequestOutput]:
        c = first.outputs[0]
        body = {**base, "output_prefix": c.token_ids, "prefix_logprobs": logprobs_to_json(c.logprobs),
                "transfer_id": transfer_id}
        if body["params"].get("prompt_logprobs") is not None:
            # the prefill worker computed them (`first` has them); asked here too, they would make the decode
            # worker recompute the whole prompt (prompt logprobs take no cached blocks, imported ones included)
            body["params"] = {**body["params"], "prompt_logprobs": None}
        tried = {dw.url}
        while True:
            started = False
            try:
                async for out in self._decode_on(dw, body, first, route):
                    started = True
                    yield out
                return
            except (httpx.TransportError, _Retry) as e:
                self.pool.mark_failed(dw, f"decode failed: {e!r}")
                if started:
                    raise WorkerError(f"decode worker {dw.url} failed mid-stream: {e!r}") from e
                others = [w for w in self.pool.rotation("decode") if w.url not in tried]
                if not others:
                    raise WorkerError(f"decode worker {dw.url} failed and no other is available: {e!r}") from e
                self.num_decode_retries += 1
                dw, _ = self._pick_decode(others, route, None)
                tried.add(dw.url)
                body = {**body, "transfer_id": ""}  # the KV went to the dead worker: recompute the prompt

    async def _decode_on(self, dw: Worker, body: dict, first: RequestOutput,
                         route: RouteInfo) -> AsyncIterator[RequestOutput]:
        rid = body["request_id"]
        timeout = httpx.Timeout(self.config.token_timeout, connect=5.0)
        dw.inflight_decode_tokens[rid] = route.num_prompt_tokens + 1
        dw.requests_routed += 1
        dw.decode_tokens_routed += route.num_prompt_tokens + route.max_tokens
        try:
            async with self._client.stream("POST", f"{dw.url}/internal/decode", json=body, timeout=timeout) as r:
                if r.status_code != 200:
                    await r.aread()
                    _json_or_error(r)
                out: RequestOutput | None = None
                async for line in r.aiter_lines():
                    if not line.strip():
                        continue
                    d = json.loads(line)
                    if "imported_blocks" in d:
                        continue
                    if "error" in d:
                        raise WorkerError(f"decode worker {dw.url}: {d['error']}")
                    out = output_delta_from_json(d, out, first)  # the worker sends what each step added
                    out.request_id = rid
                    dw.inflight_decode_tokens[rid] = route.num_prompt_tokens + len(out.outputs[0].token_ids)
                    yield out
                    if out.finished:
                        return
            raise _Retry("the decode stream ended before the request finished")
        except httpx.TimeoutException as e:
            self.pool.mark_failed(dw, "decode stream timed out")
            raise WorkerError(f"decode worker {dw.url} sent no token for {self.config.token_timeout:.0f} s") from e
        finally:
            dw.inflight_decode_tokens.pop(rid, None)

    # ------------------------------------------------------------------ store lookup

    def _block_hashes(self, prompt_ids: list[int], cache_salt: str | None, cache_tenant: str | None = None,
                      multi_modal: MultiModalInputs | None = None, adapter: str | None = None
                      ) -> tuple[list[bytes], int]:
        """The hashes of the prompt's full blocks a worker could take from a cache (the last token is
        always computed), as the workers' engines hash them for this tenant, and the block size; ([], 1)
        before any worker has reported its KV layout."""
        from deepinfer.kvcache import KVLayout

        load = self.pool.any_load()
        if not load.get("kv_layout"):
            return [], 1
        layout = KVLayout(*load["kv_layout"])
        hashes: list[bytes] = []
        extend_block_hashes(hashes, prompt_ids, layout.block_size,
                            root_hash(load["model_identity"], layout.key, cache_salt, cache_tenant, adapter),
                            multi_modal.block_keys(layout.block_size) if multi_modal is not None else None)
        return hashes[:(len(prompt_ids) - 1) // layout.block_size], layout.block_size

    def _inflight_prefixes(self, hashes: list[bytes], block_size: int) -> dict[str, int]:
        """Per prefill worker, the leading prompt tokens that prompts this router has in prefill there share
        with this one."""
        runs = {url: leading_run(hashes, blocks) for url, blocks in self._prefilling.items()}
        return {url: n * block_size for url, n in runs.items() if n}

    async def _store_hits(self, hashes: list[bytes], block_size: int) -> int:
        """Prompt tokens the shared KV store holds (what no prefill worker has to compute); 0 without one."""
        if self.store_path is None or not hashes:
            return 0
        try:
            return await asyncio.to_thread(self._store_lookup, self.pool.any_load(), hashes) * block_size
        except Exception:  # noqa: BLE001 - routing falls back to "nothing cached"
            logger.exception("KV store lookup failed")
            return 0

    def _store_lookup(self, load: dict, hashes: list[bytes]) -> int:
        """Blocks of `hashes` the store holds, from the first."""
        from deepinfer.kvcache import KVBlockStore, KVLayout

        layout = KVLayout(*load["kv_layout"])
        if self._store is None or self._store.layout != layout:
            self._store = KVBlockStore(self.store_path, load["model_identity"], layout, 1 << 60, self.retention)
        return self._store.lookup(hashes)

    async def close(self) -> None:
        await self._client.aclose()


def _decode_load(view: WorkerView, policy: RoutingPolicy) -> dict[str, float]:
    """A decode candidate as the pick saw it, for /internal/routes (its score where the policy has one)."""
    load: dict[str, float] = {"running": view.num_running, "kv_tokens": view.kv_tokens}
    if isinstance(policy, DeepInferPolicy):
        load["score"] = policy.decode_score(view)
    return load


def _tiles_to_prefill(multi_modal: MultiModalInputs | None) -> tuple[int, ...]:
    """The last placeholder position of each tile the prefill worker will encode itself (none when an encode
    worker sent embeddings)."""
    if multi_modal is None or multi_modal.embeddings is not None:
        return ()
    return multi_modal.tile_last_positions()


def _by_url(workers: list[Worker], url: str) -> Worker:
    return next(w for w in workers if w.url == url)


async def _next_line(lines: AsyncIterator[str]) -> dict | None:
    async for line in lines:
        if line.strip():
            return json.loads(line)
    return None


class _Shipment:
    """A prefill worker's answer after the first token: its KV stream to the decode worker (`kv_stream`:
    whether it is up). The stream ends on its own; the answer is kept open only until the request ends."""

    def __init__(self, response: httpx.Response, transfer_id: str, kv_stream: bool) -> None:
        self.response, self.transfer_id, self.kv_stream = response, transfer_id, kv_stream

    async def close(self) -> None:
        await self.response.aclose()


def _json_or_error(r: httpx.Response) -> dict:
    """A worker's JSON answer; its 4xx become the client's error, 5xx a reason to try another worker."""
    if r.status_code == 200:
        return r.json()
    try:
        err = r.json().get("error", {})
    except ValueError:
        err = {}
    message = err.get("message") or r.text[:200]
    if 400 <= r.status_code < 500 and r.status_code != 408:
        raise APIError(r.status_code, message, err.get("type", "invalid_request_error"), err.get("param"),
                       err.get("code"))
    raise _Retry(f"HTTP {r.status_code}: {message}")


class _Sent:
    """What one sequence's stream has yielded: text and token ids (for the deltas of the next output)."""

    def __init__(self) -> None:
        self.text = 0
        self.tokens = 0

    def deltas(self, out: RequestOutput) -> RequestOutput:
        c = out.outputs[0]
        c.delta_text, c.delta_token_ids = c.text[self.text:], c.token_ids[self.tokens:]
        self.text, self.tokens = len(c.text), len(c.token_ids)
        return out


def _continuing(first: RequestOutput, params: SamplingParams) -> RequestOutput:
    """The prefill's finished one-token output as the first output of a continuing request: no finish
    reason, and the text without the tail a stop string could still claim (as the engine holds it back)."""
    c = first.outputs[0]
    holdback = max((len(s) for s in params.stop or ()), default=1) - 1
    text = c.text[:max(0, len(c.text) - holdback)] if holdback else c.text
    return replace(first, finished=False,
                   outputs=[replace(c, text=text, finish_reason=None, stop_reason=None)])
