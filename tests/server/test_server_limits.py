"""Request limits and overload (issue #16), against a real server on 127.0.0.1 (tiny model, small limits).

Every count a client controls gets a 4xx in the shape of the API called, naming the field, before anything
is queued; so do non-finite numbers, deep nesting and oversized bodies. Past the admission bound (running
capacity + --max-waiting-requests) or the per-key cap, requests get 429 with Retry-After; the admitted ones
finish, /health stays 200, and the slots and KV blocks all come back, also after clients leave mid-stream or
while still queued.
"""

from __future__ import annotations

import asyncio
import json
import time

import anthropic
import httpx
import openai
import pytest

from tests.server_utils import metric, running_cluster, running_server

MODEL = "tiny"
LIMITS = {"max_n": 4, "max_stop": 4, "max_stop_len": 20, "max_tools": 3, "max_messages": 5, "max_logit_bias": 3,
          "max_logprobs": 5, "depth": 16, "body": 64 * 1024}
MSG = [{"role": "user", "content": "Hello there"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
RTOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
ATOOL = {"name": "f", "input_schema": {"type": "object", "properties": {}}}


@pytest.fixture(scope="module")
def server(tiny_models):
    # capacity: 2 running + 2 waiting sequences; per key at most 3
    with running_server("--model", str(tiny_models["llama"]), "--served-model-name", MODEL, "--dtype", "float32",
                        "--kv-cache-memory", "32MiB", "--max-model-len", "1024", "--max-num-seqs", "2",
                        "--max-waiting-requests", "2", "--max-concurrent-requests-per-key", "3",
                        "--max-n", str(LIMITS["max_n"]), "--max-stop-sequences", str(LIMITS["max_stop"]),
                        "--max-stop-length", str(LIMITS["max_stop_len"]), "--max-tools", str(LIMITS["max_tools"]),
                        "--max-messages", str(LIMITS["max_messages"]),
                        "--max-logit-bias", str(LIMITS["max_logit_bias"]),
                        "--max-logprobs", str(LIMITS["max_logprobs"]), "--max-json-depth", str(LIMITS["depth"]),
                        "--max-request-body-size", str(LIMITS["body"]), "--retry-after", "2") as base:
        yield base


def _nested(depth: int) -> dict:
    d: dict = {"x": 1}
    for _ in range(depth):
        d = {"k": d}
    return d


CHAT = {"model": MODEL, "messages": MSG, "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
RESPONSE = {"model": MODEL, "input": "Hello", "max_output_tokens": 2}
MESSAGE = {"model": MODEL, "messages": MSG, "max_tokens": 2}
PATHS = {"chat": ("/v1/chat/completions", CHAT), "completions": ("/v1/completions", COMPLETION),
         "responses": ("/v1/responses", RESPONSE), "messages": ("/v1/messages", MESSAGE)}

# (api, body changes, the field the 400 must name); raw strings are spliced in as JSON text (NaN ...)
BAD = [
    ("chat", {"n": 100000}, "n"),
    ("chat", {"n": "100000"}, "n"),  # pydantic would read the string as 100000
    ("chat", {"n": 0}, "n"),
    ("chat", {"best_of": 50}, "best_of"),
    ("chat", {"max_tokens": 10**12}, "max_tokens"),
    ("chat", {"max_completion_tokens": 5000}, "max_completion_tokens"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {"logprobs": True, "top_logprobs": 6}, "top_logprobs"),
    ("chat", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("chat", {"stop": ["a", "x" * 21]}, "stop[1]"),
    ("chat", {"stop": "x" * 21}, "stop"),
    ("chat", {"tools": [TOOL] * 4}, "tools"),
    ("chat", {"messages": MSG * 6}, "messages"),
    ("chat", {"logit_bias": {"1": 1, "2": 1, "3": 1, "4": 1}}, "logit_bias"),
    ("chat", {"temperature": "NaN"}, "temperature"),
    ("chat", {"top_p": "Infinity"}, "top_p"),
    ("chat", {"presence_penalty": "-Infinity"}, "presence_penalty"),
    ("chat", {"logit_bias": {"5": "1e999"}}, "logit_bias.5"),
    ("chat", {"metadata": _nested(20)}, "metadata.k"),
    ("completions", {"n": 5}, "n"),
    ("completions", {"prompt": ["a", "b", "c"], "n": 2}, "prompt"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"max_tokens": 10**9}, "max_tokens"),
    ("completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("completions", {"logit_bias": {str(i): 0 for i in range(4)}}, "logit_bias"),
    ("completions", {"temperature": "NaN"}, "temperature"),
    ("responses", {"max_output_tokens": 10**9}, "max_output_tokens"),
    ("responses", {"input": MSG * 6}, "input"),
    ("responses", {"tools": [RTOOL] * 4}, "tools"),
    ("responses", {"top_logprobs": 6}, "top_logprobs"),
    ("responses", {"temperature": "Infinity"}, "temperature"),
    ("messages", {"max_tokens": 10**9}, "max_tokens"),
    ("messages", {"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ("messages", {"stop_sequences": ["x" * 21]}, "stop_sequences[0]"),
    ("messages", {"tools": [ATOOL] * 4}, "tools"),
    ("messages", {"messages": MSG * 6}, "messages"),
    ("messages", {"temperature": "NaN"}, "temperature"),
    ("messages", {"metadata": _nested(20)}, "metadata.k"),
]


def _raw_json(body: dict) -> bytes:
    """`body` as JSON text, with the strings NaN / Infinity / -Infinity / 1e999 written as bare tokens."""
    text = json.dumps(body)
    for token in ("NaN", "-Infinity", "Infinity", "1e999"):
        text = text.replace(f'"{token}"', token)
    return text.encode()


def _check_shape(r: httpx.Response, api: str, status: int, field: str | None) -> None:
    assert r.status_code == status, (api, field, r.status_code, r.text)
    body = r.json()
    if api == "messages":  # Anthropic's shape; the field is named in the message
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        assert body["error"]["type"] == {400: "invalid_request_error", 413: "request_too_large",
                                         429: "rate_limit_error"}[status]
        if field:
            assert field.split(".")[0].split("[")[0] in body["error"]["message"]
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}
        if field:
            assert body["error"]["param"].startswith(field), body


def test_every_client_count_is_bounded_in_the_api_s_shape(server):
    with httpx.Client(base_url=server, timeout=30) as c:
        for api, change, field in BAD:
            path, base = PATHS[api]
            r = c.post(path, content=_raw_json({**base, **change}), headers={"content-type": "application/json"})
            _check_shape(r, api, 400, field)
        # an oversized body: 413, announced by Content-Length or not
        for api, (path, base) in PATHS.items():
            big = {**base, "pad": "x" * (LIMITS["body"] + 10)}
            _check_shape(c.post(path, json=big), api, 413, None)

            data = json.dumps(big).encode()
            chunks = (data[i:i + 8192] for i in range(0, len(data), 8192))  # no Content-Length: chunked
            _check_shape(c.post(path, content=chunks), api, 413, None)
        # nesting past the interpreter's own recursion limit is a 400, not a crash
        r = c.post("/v1/completions", content=b"[" * 30000 + b"]" * 30000)
        _check_shape(r, "completions", 400, None)
        assert metric(server, "deepinfer:requests_refused_total") >= len(BAD) + 9
        # nothing was queued, and the server answers a normal request at once
        t0 = time.monotonic()
        for api, (path, base) in PATHS.items():
            assert c.post(path, json=base).status_code == 200, api
        assert time.monotonic() - t0 < 10
    assert metric(server, "deepinfer:admitted_sequences") == 0


def test_sdks_see_the_limit_errors(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, n=100000, max_tokens=2)
    assert e.value.body["param"] == "n" and "at most 4" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, logit_bias={"1": 1, "2": 1, "3": 1,
                                                                                             "4": 1})
    assert e.value.body["param"] == "logit_bias"  # (the SDK itself refuses to send NaN; see the raw cases)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=10**7)
    assert e.value.body["param"] == "max_output_tokens"
    claude = anthropic.Anthropic(base_url=server, api_key="k", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, messages=MSG, max_tokens=2, stop_sequences=["s"] * 9)
    assert "stop_sequences" in e.value.message
    # the per-key cap is 3: n=4 could never be admitted, which is a 400 rather than a 429 forever
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, n=4, max_tokens=2)
    assert e.value.body["param"] == "n" and "at most 3" in e.value.message
    assert client.chat.completions.create(model=MODEL, messages=MSG, n=3, max_tokens=2).choices


async def _post(c: httpx.AsyncClient, api: str, key: str, max_tokens: int, stream: bool = False) -> httpx.Response:
    path, base = PATHS[api]
    body = {**base, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    if api == "responses":
        body = {**RESPONSE, "max_output_tokens": max_tokens, "stream": stream}
    headers = {"x-api-key": key} if api == "messages" else {"Authorization": f"Bearer {key}"}
    return await c.post(path, json=body, headers=headers)


def test_flood_gets_429s_with_retry_after_and_the_server_keeps_answering(server):
    """16 concurrent requests (4x the bound of 4 sequences) over the four APIs, each under its own key: the
    admitted ones finish, the rest get 429 in their API's shape, never a 5xx; /health answers throughout."""

    async def flood():
        async with httpx.AsyncClient(base_url=server, timeout=120) as c:
            apis = list(PATHS)
            tasks = [asyncio.create_task(_post(c, apis[i % 4], f"key-{i}", 48, stream=i % 3 == 0))
                     for i in range(16)]
            health = []
            while not all(t.done() for t in tasks):
                t0 = time.monotonic()
                health.append(((await c.get("/health")).status_code, time.monotonic() - t0))
                await asyncio.sleep(0.05)
            return [t.result() for t in tasks], health

    responses, health = asyncio.run(flood())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(200) >= 4 and codes.count(429) >= 4, codes
    for i, r in enumerate(responses):
        api = list(PATHS)[i % 4]
        if r.status_code == 429:
            assert r.headers["retry-after"] == "2"
            _check_shape(r, api, 429, None)
            if api != "messages":
                assert r.json()["error"]["type"] == "rate_limit_error"
        elif i % 3 != 0 and api in ("chat", "completions"):
            assert r.json()["usage"]["completion_tokens"] == 48
    assert health and all(code == 200 for code, _ in health)
    assert max(s for _, s in health) < 5  # /health never waits behind the flood
    _wait_idle(server)


def _wait_idle(base: str, timeout: float = 30) -> None:
    """Admission slots and KV blocks all come back."""
    deadline = time.monotonic() + timeout
    while True:
        slots = metric(base, "deepinfer:admitted_sequences")
        blocks = metric(base, "deepinfer:kv_cache_blocks_used")
        keys = metric(base, "deepinfer:admitted_api_keys")
        if slots == blocks == keys == 0:
            return
        assert time.monotonic() < deadline, (slots, blocks, keys)
        time.sleep(0.2)


def test_per_key_cap_and_slots_come_back_after_disconnects(server):
    """One key may hold 3 of the 4 slots: its 4th request gets 429 while another key still gets in. Clients
    that leave (mid-stream, or still queued before their first token) give their slots back at once."""

    async def scenario():
        async with httpx.AsyncClient(base_url=server, timeout=120) as c:
            # key A: three long streams; two run (max-num-seqs 2), one waits in the engine's queue
            streams = []
            for _ in range(3):
                streams.append(asyncio.create_task(_post(c, "chat", "A", 900, stream=True)))
            await _until(lambda: metric(server, "deepinfer:admitted_sequences") == 3)
            over = await _post(c, "completions", "A", 4)
            assert over.status_code == 429 and "API key" in over.json()["error"]["message"]
            assert over.headers["retry-after"] == "2"
            # key B takes the last slot; then the server is full for everyone
            b = asyncio.create_task(_post(c, "messages", "B", 900))
            await _until(lambda: metric(server, "deepinfer:admitted_sequences") == 4)
            full = await _post(c, "responses", "C", 4)
            assert full.status_code == 429 and "capacity" in full.json()["error"]["message"]
            assert httpx.get(f"{server}/health").status_code == 200
            # every client leaves: the queued ones before any token, the running ones mid-stream
            for t in [*streams, b]:
                t.cancel()
            await asyncio.gather(*streams, b, return_exceptions=True)
            await _until(lambda: metric(server, "deepinfer:admitted_sequences") == 0, timeout=10)

    asyncio.run(scenario())
    _wait_idle(server)
    # and the slots are usable again
    assert httpx.post(f"{server}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


async def _until(cond, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(cond):
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.1)


def test_streams_closed_early_release_their_slots(server):
    """Streams read halfway and closed (SDK iterators abandoned, connections dropped) free everything."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="k", max_retries=0)
    for _ in range(3):
        stream = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=600, stream=True,
                                                extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()
    claude = anthropic.Anthropic(base_url=server, api_key="k", max_retries=0)
    with claude.messages.stream(model=MODEL, messages=MSG, max_tokens=600) as s:
        next(iter(s))
    _wait_idle(server)


@pytest.mark.slow
def test_the_cluster_router_refuses_past_its_bound(tiny_models):
    """`serve --prefill-workers 1 --decode-workers 1`: the router admits the decode worker's max-num-seqs (1)
    + --max-waiting-requests (1) sequences; a flood of 6 gets 429s, never a 5xx, and everything comes back."""
    with running_cluster("--model", str(tiny_models["llama"]), "--served-model-name", MODEL, "--dtype", "float32",
                         "--kv-cache-memory", "32MiB", "--no-profile-cost-model", "--max-model-len", "1024",
                         "--max-num-seqs", "1",
                         "--max-waiting-requests", "1", "--prefill-workers", "1", "--decode-workers", "1") as base:
        assert metric(base, "deepinfer:admission_capacity") == 2

        async def flood():
            async with httpx.AsyncClient(base_url=base, timeout=120) as c:
                return await asyncio.gather(*(_post(c, list(PATHS)[i % 4], f"k{i}", 200) for i in range(6)))

        codes = [r.status_code for r in asyncio.run(flood())]
        assert set(codes) <= {200, 429} and codes.count(429) >= 2 and codes.count(200) >= 2, codes
        assert httpx.get(f"{base}/health").status_code == 200
        assert metric(base, "deepinfer:admitted_sequences") == 0
