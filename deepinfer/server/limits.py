"""Request limits and admission control, applied before a request reaches its handler (or pydantic).

`RequestLimits` is a pure-ASGI middleware in front of every public POST route (Starlette's
BaseHTTPMiddleware would hide client disconnects from the handlers):

- the body is read with a size cap (413 past `--max-request-body-size`, from Content-Length when it says
  so, before reading), parsed once, and refused (400) when it nests deeper than `--max-json-depth` or holds
  a non-finite number: Python's json reads NaN, Infinity and 1e999, which JSON does not have;
- on the generation routes every count a client controls (n / best_of, max_tokens and its aliases,
  top_logprobs / logprobs / prompt_logprobs, stop strings and bad words, tools, messages / input items,
  logit_bias entries) is checked
  against `LimitsConfig`, naming the field;
- a generation request then takes one admission slot per sequence it asks for (n x prompts) from
  `Admission`: past the server's bound (running capacity + `--max-waiting-requests`) or the caller's
  `--max-concurrent-requests-per-key`, it gets 429 with Retry-After. The slots are held for the whole HTTP
  exchange, a streamed body included, and released however it ends. The middleware also watches for the
  client leaving: a disconnect cancels the handler, so its engine request is aborted even while it is still
  waiting for its first token (Starlette only notices a gone client when it next sends).

Errors take the shape of the API called: OpenAI's {"error": {...}}, Anthropic's on /v1/messages.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deepinfer.config import LimitsConfig
from deepinfer.server.protocol import APIError
from deepinfer.server.protocol_anthropic import anthropic_error_body

# the routes that start engine requests (they take admission slots), by API
GENERATION_ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses",
                     "/v1/messages": "messages"}
# routes that render messages without generating (their counts are checked, no slot is taken)
RENDER_ROUTES = {"/v1/messages/count_tokens": "count_tokens", "/tokenize": "tokenize"}


class LimitError(Exception):
    """A request refused by a limit: rendered in the API's error shape by the middleware."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None,
                 reason: str = "invalid") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers, self.reason = headers, reason


# ---------------------------------------------------------------- admission


class Admission:
    """Counts the sequences admitted and not yet finished, in total and per API key (asyncio-only: one
    event loop, no lock). `running_capacity()`: how many sequences the engine(s) run at once."""

    def __init__(self, limits: LimitsConfig, running_capacity: Callable[[], int], max_queue: int | None = None) -> None:
        self.limits = limits
        self.running_capacity = running_capacity
        self.max_queue = max_queue  # the engine's own bound (--max-queue), the default waiting bound if set
        self.in_flight = 0
        self.per_key: dict[str, int] = {}  # only keys with sequences in flight: the dict cannot grow unbounded
        self.rejected: Counter[str] = Counter()

    def capacity(self) -> int:
        running = max(1, int(self.running_capacity()))
        waiting = self.limits.max_waiting_requests
        if waiting is None:
            waiting = 4 * running if self.max_queue is None else self.max_queue
        return running + waiting

    def acquire(self, key: str, weight: int, param: str) -> None:
        """Take `weight` slots for `key`, or raise LimitError: 400 for a request that could never be
        admitted (it alone is over a bound), 429 while the server or this key is full."""
        cap, per_key = self.capacity(), self.limits.max_concurrent_requests_per_key
        if weight > cap or (per_key and weight > per_key):
            bound = min(cap, per_key) if per_key else cap
            self.rejected["too_many_sequences"] += 1
            raise LimitError(400, f"{param}: this request asks for {weight} sequences; at most {bound} are "
                                  f"admitted at a time", param=param, reason="too_many_sequences")
        retry = {"Retry-After": str(self.limits.retry_after)}
        if self.in_flight + weight > cap:
            self.rejected["server_full"] += 1
            raise LimitError(429, f"the server is at capacity ({cap} sequences admitted); retry later",
                             code="rate_limit_exceeded", type="rate_limit_error", headers=retry, reason="server_full")
        if per_key and self.per_key.get(key, 0) + weight > per_key:
            self.rejected["key_full"] += 1
            raise LimitError(429, f"too many concurrent requests for this API key (at most {per_key} sequences "
                                  "at a time); retry later", code="rate_limit_exceeded", type="rate_limit_error",
                             headers=retry, reason="key_full")
        self.in_flight += weight
        self.per_key[key] = self.per_key.get(key, 0) + weight

    def release(self, key: str, weight: int) -> None:
        self.in_flight -= weight
        left = self.per_key.get(key, 0) - weight
        if left > 0:
            self.per_key[key] = left
        else:
            self.per_key.pop(key, None)


class AdmissionCollector:
    """Prometheus view of `Admission`: sequences in flight, the bound, keys in flight, refusals by reason."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    def collect(self):
        a = self.admission
        g = GaugeMetricFamily("deepinfer:admitted_sequences", "Sequences admitted and not yet finished.")
        g.add_metric([], a.in_flight)
        cap = GaugeMetricFamily("deepinfer:admission_capacity", "Sequences the server admits at a time "
                                "(running capacity + --max-waiting-requests).")
        cap.add_metric([], a.capacity())
        keys = GaugeMetricFamily("deepinfer:admitted_api_keys", "API keys (or keyless clients) with sequences "
                                 "admitted.")
        keys.add_metric([], len(a.per_key))
        refused = CounterMetricFamily("deepinfer:requests_refused", "Requests refused before queueing, by "
                                      "reason (body_too_large, invalid, too_many_sequences, server_full, key_full).",
                                      labels=["reason"])
        for reason in ("body_too_large", "invalid", "too_many_sequences", "server_full", "key_full"):
            refused.add_metric([reason], a.rejected[reason])
        yield from (g, cap, keys, refused)


def client_key(scope: Scope) -> str:
    """Whose request this is, for the per-key cap: the credential presented (as `authenticate` reads it:
    Authorization Bearer, else x-api-key), hashed so no key is kept in memory in clear; else the client's
    address."""
    headers = dict(scope.get("headers") or ())
    auth = headers.get(b"authorization", b"").decode("latin-1")
    token = auth[7:] if auth.lower().startswith("bearer ") else headers.get(b"x-api-key", b"").decode("latin-1")
    if token:
        return "key:" + hashlib.sha256(token.encode("latin-1")).hexdigest()[:32]
    client = scope.get("client")
    return f"client:{client[0] if client else '?'}"


# ---------------------------------------------------------------- body checks


def parse_body(body: bytes, max_depth: int) -> Any:
    """The JSON body, refused (LimitError) if nested deeper than `max_depth` or holding a non-finite number;
    `None` when it is empty or not JSON at all (the route's own parsing reports that)."""
    if not body.strip():
        return None
    try:
        data = json.loads(body)
    except RecursionError:  # deeper than the interpreter's recursion limit: far past any sane max_depth
        raise LimitError(400, f"the request body nests deeper than {max_depth} levels") from None
    except ValueError:
        return None
    stack: list[tuple[Any, str, int]] = [(data, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, dict):
            items = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
        elif isinstance(value, list):
            items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, float) and not math.isfinite(value):
            raise LimitError(400, f"{path or 'body'}: {value} is not a valid number (JSON has no NaN or Infinity)",
                             param=path or None)
        else:
            continue
        if depth > max_depth:
            where = path if len(path) <= 120 else path[:117] + "..."
            raise LimitError(400, f"{where or 'body'}: the request body nests deeper than {max_depth} levels",
                             param=where or None)
        for p, v in items:
            if isinstance(v, dict | list | float):
                stack.append((v, p, depth + 1))
    return data


def _as_int(value: Any) -> int | None:
    """`value` as the integer pydantic would read it (it accepts "5" and 5.0 for an int), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        with suppress(ValueError):
            return int(value.strip())
    return None


def _bounded(body: dict, name: str, high: int, low: int = 0, why: str = "", code: str | None = None) -> int | None:
    value = _as_int(body.get(name))
    if value is None:
        return None
    if value < low:
        raise LimitError(400, f"{name}: must be at least {low}, got {value}", param=name)
    if value > high:
        raise LimitError(400, f"{name}: must be at most {high}{why}, got {value}", param=name, code=code)
    return value


def _count(body: dict, name: str, high: int, what: str) -> None:
    value = body.get(name)
    if isinstance(value, list | dict) and len(value) > high:
        raise LimitError(400, f"{name}: at most {high} {what} are allowed, got {len(value)}", param=name)


_IMAGE_PARTS = ("image_url", "input_image", "image")  # Chat, Responses, Anthropic


def _images(body: dict, name: str, high: int) -> None:
    """Image parts across the messages' content lists (every API's spelling)."""
    messages = body.get(name)
    if not isinstance(messages, list):
        return
    found = sum(1 for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
                for part in m["content"] if isinstance(part, dict) and part.get("type") in _IMAGE_PARTS)
    if found > high:
        raise LimitError(400, f"{name}: at most {high} images are allowed in one request, got {found}", param=name)


def _stops(body: dict, name: str, limits: LimitsConfig, what: str = "stop sequence") -> None:
    """Stop strings (and bad words, held to the same bounds): how many, and how long each."""
    value = body.get(name)
    stops = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    if len(stops) > limits.max_stop_sequences:
        raise LimitError(400, f"{name}: at most {limits.max_stop_sequences} {what}s are allowed, got "
                              f"{len(stops)}", param=name)
    for i, s in enumerate(stops):
        if isinstance(s, str) and len(s) > limits.max_stop_length:
            where = name if isinstance(value, str) else f"{name}[{i}]"
            raise LimitError(400, f"{where}: a {what} may be at most {limits.max_stop_length} characters, "
                                  f"got {len(s)}", param=where)


def _num_prompts(prompt: Any) -> int:
    if isinstance(prompt, list) and prompt and not all(isinstance(x, int) for x in prompt):
        return len(prompt)
    return 1


def check_counts(api: str, body: dict, limits: LimitsConfig, max_model_len: int) -> tuple[int, str]:
    """Check the client-controlled counts of a request to `api`; return its weight (the sequences it asks
    for) and the field that weight comes from."""
    if limits.max_tokens_per_request is not None:
        max_tokens, why, code = limits.max_tokens_per_request, "", None
    else:
        max_tokens, why, code = max_model_len, " (the model's context length)", "context_length_exceeded"
    # completions with echo may ask for 0 tokens: score the prompt only (the legacy API allows it)
    low = 0 if api == "completions" and body.get("echo") is True else 1
    for name in {"chat": ("max_tokens", "max_completion_tokens"), "completions": ("max_tokens",),
                 "responses": ("max_output_tokens",), "messages": ("max_tokens",)}.get(api, ()):
        _bounded(body, name, max_tokens, low=low, why=why, code=code)
    _bounded(body, "seed", 2**63 - 1, low=-(2**63))  # what a torch generator takes
    if api in ("chat", "responses", "tokenize"):
        _count(body, "messages" if api != "responses" else "input", limits.max_messages,
               "messages" if api != "responses" else "input items")
    if api in ("messages", "count_tokens"):
        _count(body, "messages", limits.max_messages, "messages")
    if api in ("chat", "responses", "messages", "count_tokens"):
        _count(body, "tools", limits.max_tools, "tools")
    if api in ("chat", "responses", "messages", "count_tokens", "tokenize"):
        _images(body, "input" if api == "responses" else "messages", limits.max_images_per_request)
    if api in ("chat", "responses"):
        _bounded(body, "top_logprobs", limits.max_logprobs)
    if api == "completions":
        _bounded(body, "logprobs", limits.max_logprobs)
    if api in ("chat", "completions"):
        _stops(body, "stop", limits)
        _stops(body, "bad_words", limits, "bad word")
        _bounded(body, "prompt_logprobs", limits.max_logprobs, low=0)
        _count(body, "logit_bias", limits.max_logit_bias, "logit_bias entries")
        n = _bounded(body, "n", limits.max_n, low=1) or 1
        best_of = _bounded(body, "best_of", limits.max_n, low=1) or 1
        weight, param = max(n, best_of), "n" if n >= best_of else "best_of"
        if api == "completions":
            prompts = _num_prompts(body.get("prompt"))
            if prompts * weight > limits.max_n:
                raise LimitError(400, f"prompt: {prompts} prompts x {param} {weight} = {prompts * weight} "
                                      f"sequences; at most {limits.max_n} per request", param="prompt")
            weight, param = prompts * weight, "prompt" if prompts > 1 else param
        return weight, param
    if api == "messages":
        _stops(body, "stop_sequences", limits)
    return 1, "messages"


# ---------------------------------------------------------------- the middleware


class RequestLimits:
    """Pure-ASGI middleware applying `LimitsConfig` and `Admission` (see the module docstring)."""

    def __init__(self, app: ASGIApp, limits: LimitsConfig, admission: Admission,
                 max_model_len: Callable[[], int]) -> None:
        self.app, self.limits, self.admission, self.max_model_len = app, limits, admission, max_model_len

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope["method"] != "POST" or path.startswith("/internal/"):
            await self.app(scope, receive, send)  # worker <-> router traffic is the router's, not a client's
            return
        api = GENERATION_ROUTES.get(path) or RENDER_ROUTES.get(path)
        key, weight = None, 0
        try:
            body = await self._read_body(scope, receive)
            if body is None:
                return  # the client left while sending
            data = parse_body(body, self.limits.max_json_depth)
            if api is not None and isinstance(data, dict):
                weight, param = check_counts(api, data, self.limits, self.max_model_len())
            if path in GENERATION_ROUTES:
                weight = max(weight, 1)
                who = client_key(scope)
                self.admission.acquire(who, weight, param if isinstance(data, dict) else "n")
                key = who
        except LimitError as e:
            if e.reason in ("invalid", "body_too_large"):
                self.admission.rejected[e.reason] += 1
            await _error_response(e, path)(scope, receive, send)
            return
        if key is None:
            await self.app(scope, _replay(body, receive), send)
            return
        try:
            await _run_watching_disconnect(self.app, scope, body, receive, send)
        finally:
            self.admission.release(key, weight)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        limit = self.limits.max_request_body_size
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        too_large = LimitError(413, f"the request body is larger than {limit} bytes (--max-request-body-size)",
                               code="request_too_large", reason="body_too_large")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _error_response(e: LimitError, path: str) -> JSONResponse:
    if path.startswith("/v1/messages"):
        return JSONResponse(anthropic_error_body(e.status, e.message), status_code=e.status, headers=e.headers)
    return JSONResponse(APIError(e.status, e.message, e.type, e.param, e.code).body(), status_code=e.status,
                        headers=e.headers)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the already-read body to the app once, then passes through."""
    sent = False

    async def wrapped() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return wrapped


async def _run_watching_disconnect(app: ASGIApp, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
    """Run the app on the already-read body while listening for the client to leave; if it leaves before the
    response is complete, cancel the app (its engine streams close and abort their requests)."""
    gone = asyncio.Event()
    complete = False
    sent_body = False

    async def app_receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def app_send(message: Message) -> None:
        nonlocal complete
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            complete = True
        await send(message)

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
                return

    task = asyncio.ensure_future(app(scope, app_receive, app_send))
    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and not complete:  # the client left: stop serving it
            task.cancel()
        if not task.done():
            with suppress(asyncio.CancelledError):
                await task
        if not task.cancelled():
            task.result()  # the app's own exception, if any, as if it ran inline
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
