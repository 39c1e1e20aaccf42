"""The Anthropic Messages API on the real server (default model), through the official `anthropic` SDK.

This SDK version has no temperature parameter on messages.create; greedy decoding goes in extra_body."""

from __future__ import annotations

import time

import anthropic
import httpx
import pytest

from tests.server_utils import KEY, SHARED_SERVER_FLAGS, metric, prefill_reference, running_server

MODEL = "SmolLM2-135M-Instruct"
Q = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
# two earlier turns that called the tool: the 135M default model copies the pattern for the third city
FEW_SHOT = []
for _i, _city in enumerate(("Paris", "Rome")):
    FEW_SHOT += [{"role": "user", "content": f"What is the weather in {_city}?"},
                 {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{_i}", "name": "get_weather",
                                                    "input": {"city": _city}}]}]
FEW_SHOT.append({"role": "user", "content": "What is the weather in London?"})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # the shared server's flags, and one decode step per pass: a stream's tokens come one at a time, so the
    # tool input arrives in pieces (a pass of several steps may send `{"city": "London"}` whole, as it did once
    # the float32 kernels got faster and the pass budget let passes run 8 steps)
    log = tmp_path_factory.mktemp("srv") / "server.log"
    with running_server(*SHARED_SERVER_FLAGS, "--num-scheduler-steps", "1", log=log) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=120)


def _prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_create_text(client):
    m = client.messages.create(model=MODEL, max_tokens=30, messages=Q, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and "Paris" in m.content[0].text
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    count = client.messages.count_tokens(model=MODEL, messages=Q).input_tokens
    assert _prompt_tokens(m.usage) == count and m.usage.output_tokens > 0
    assert m.usage.cache_creation_input_tokens == 0  # no cache_control breakpoint


def test_system_and_count_tokens_match_the_prompt(client, server):
    system = [{"type": "text", "text": "You answer in one word."}]
    count = client.messages.count_tokens(model=MODEL, system=system, messages=Q).input_tokens
    tokenized = httpx.post(f"{server}/tokenize", headers={"x-api-key": KEY}, timeout=30, json={
        "messages": [{"role": "system", "content": "You answer in one word."}, *Q]}).json()["count"]
    assert count == tokenized
    m = client.messages.create(model=MODEL, max_tokens=5, system="You answer in one word.", messages=Q,
                               extra_body=GREEDY)
    assert _prompt_tokens(m.usage) == count
    with_tools = client.messages.count_tokens(model=MODEL, messages=Q, tools=[WEATHER]).input_tokens
    assert with_tools > client.messages.count_tokens(model=MODEL, messages=Q).input_tokens


def test_a_final_assistant_message_is_a_prefill(client, server, default_model_dir):
    prefill = [*Q, {"role": "assistant", "content": [{"type": "text", "text": "The capital of France is"}]}]
    ids, expected = prefill_reference(server, default_model_dir, [*Q, {"role": "assistant",
                                                                      "content": "The capital of France is"}], 12)
    m = client.messages.create(model=MODEL, max_tokens=12, messages=prefill, extra_body=GREEDY)
    assert expected.strip() and m.content[0].text == expected  # the continuation only, as Anthropic returns it
    assert _prompt_tokens(m.usage) == len(ids) == client.messages.count_tokens(model=MODEL, messages=prefill).input_tokens
    with client.messages.stream(model=MODEL, max_tokens=12, messages=prefill, extra_body=GREEDY) as stream:
        assert stream.get_final_text() == expected
    # an empty final assistant message is no prefill: the reply is a new turn, as without it
    plain = client.messages.create(model=MODEL, max_tokens=12, messages=Q, extra_body=GREEDY)
    empty = client.messages.create(model=MODEL, max_tokens=12, messages=[*Q, {"role": "assistant", "content": ""}],
                                   extra_body=GREEDY)
    assert empty.content[0].text == plain.content[0].text != expected
    for last in ("The capital of France is ", [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]):
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(model=MODEL, max_tokens=5, messages=[*Q, {"role": "assistant", "content": last}])


def test_stop_reasons(client):
    m = client.messages.create(model=MODEL, max_tokens=3, messages=Q, extra_body=GREEDY)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    m = client.messages.create(model=MODEL, max_tokens=30, messages=Q, stop_sequences=["Paris"], extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Paris"
    assert "Paris" not in m.content[0].text


def _raw_event_names(server: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{server}/v1/messages", json={**body, "stream": True}, timeout=60,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200
        return [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]


def test_stream_text(client, server):
    ref = client.messages.create(model=MODEL, max_tokens=30, messages=Q, extra_body=GREEDY)
    with client.messages.stream(model=MODEL, max_tokens=30, messages=Q, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == ref.content[0].text and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == ref.usage.output_tokens
    events = list(client.messages.create(model=MODEL, max_tokens=30, messages=Q, stream=True, extra_body=GREEDY))
    types = [e.type for e in events]
    collapsed = [t for i, t in enumerate(types) if t != "content_block_delta" or types[i - 1] != t]
    assert collapsed == ["message_start", "content_block_start", "content_block_delta",
                         "content_block_stop", "message_delta", "message_stop"]  # the SDK drops pings
    raw = _raw_event_names(server, {"model": MODEL, "max_tokens": 30, "messages": Q, **GREEDY})
    assert raw[:3] == ["message_start", "ping", "content_block_start"] and raw[-1] == "message_stop"
    assert all(e.delta.type == "text_delta" for e in events if e.type == "content_block_delta")
    assert events[0].message.usage.input_tokens + events[0].message.usage.cache_read_input_tokens == \
        _prompt_tokens(ref.usage)


def test_tools(client):
    m = client.messages.create(model=MODEL, max_tokens=60, messages=FEW_SHOT, tools=[WEATHER], extra_body=GREEDY)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1, m.content
    assert uses[0].name == "get_weather" and uses[0].input == {"city": "London"} and uses[0].id.startswith("toolu_")
    json_deltas = []
    with client.messages.stream(model=MODEL, max_tokens=60, messages=FEW_SHOT, tools=[WEATHER],
                                extra_body=GREEDY) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                assert event.delta.type == "input_json_delta"
                json_deltas.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content if b.type == "tool_use"] == \
        [("tool_use", "get_weather", {"city": "London"})]
    assert final.stop_reason == "tool_use"
    assert len(json_deltas) > 1  # the input streamed in pieces


def test_tool_result_and_tool_choice_none(client):
    uses = [{"type": "tool_use", "id": "toolu_9", "name": "get_weather", "input": {"city": "London"}}]
    convo = FEW_SHOT + [{"role": "assistant", "content": uses},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9",
                                                      "content": "Foggy, 12 C"}]}]
    with_result = client.messages.count_tokens(model=MODEL, messages=convo, tools=[WEATHER]).input_tokens
    assert with_result > client.messages.count_tokens(model=MODEL, messages=FEW_SHOT, tools=[WEATHER]).input_tokens
    answer = client.messages.create(model=MODEL, max_tokens=4, messages=convo, tools=[WEATHER], extra_body=GREEDY)
    assert _prompt_tokens(answer.usage) == with_result
    none = client.messages.create(model=MODEL, max_tokens=8, messages=FEW_SHOT, tools=[WEATHER],
                                  tool_choice={"type": "none"}, extra_body=GREEDY)
    assert all(b.type == "text" for b in none.content) and none.stop_reason != "tool_use"


def test_cache_control(client):
    system = [{"type": "text", "text": "You are terse. " * 20, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    first = client.messages.create(model=MODEL, max_tokens=4, system=system, messages=Q, extra_body=GREEDY)
    again = client.messages.create(model=MODEL, max_tokens=4, system=system, messages=Q, extra_body=GREEDY)
    assert _prompt_tokens(first.usage) == _prompt_tokens(again.usage)
    assert first.usage.input_tokens == 0 and first.usage.cache_creation_input_tokens > 0
    assert again.usage.cache_read_input_tokens > first.usage.cache_read_input_tokens
    with pytest.raises(anthropic.BadRequestError, match="ttl"):
        client.messages.create(model=MODEL, max_tokens=4, messages=Q, system=[
            {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2d"}}])


def test_errors_use_the_sdk_exception_classes(client, server):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=5, messages=Q)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=0, messages=Q)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=5, messages=Q, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=100000, messages=Q)
    bad_key = anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad_key.messages.create(model=MODEL, max_tokens=5, messages=Q)
    with pytest.raises(anthropic.AuthenticationError):
        bad_key.messages.count_tokens(model=MODEL, messages=Q)


def test_error_shapes_by_path(server):
    r = httpx.post(f"{server}/v1/messages", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                   json={"model": MODEL, "messages": Q}, timeout=30)  # max_tokens missing
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    r = httpx.post(f"{server}/v1/messages", headers={"x-api-key": "wrong"}, json={}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(f"{server}/v1/chat/completions", headers={"x-api-key": "wrong"}, json={}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key" and "type" not in r.json()


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_tool_choice_enforced(client, choice):
    m = client.messages.create(model=MODEL, max_tokens=80, messages=[{"role": "user", "content": "Tell me a joke."}],
                               tools=[WEATHER], tool_choice=choice, extra_body=GREEDY)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses[0].name == "get_weather" and isinstance(uses[0].input["city"], str)


def test_shapes_validate_strictly_against_the_sdk_types(server):
    """The SDK builds its objects without validation; validate our JSON against its types strictly."""
    import json

    from anthropic.types import Message, RawMessageStreamEvent
    from pydantic import TypeAdapter

    events = TypeAdapter(RawMessageStreamEvent)
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    for body in [{"model": MODEL, "max_tokens": 20, "messages": Q, **GREEDY},
                 {"model": MODEL, "max_tokens": 60, "messages": FEW_SHOT, "tools": [WEATHER], **GREEDY}]:
        Message.model_validate(httpx.post(f"{server}/v1/messages", json=body, headers=headers, timeout=120).json())
        with httpx.stream("POST", f"{server}/v1/messages", json={**body, "stream": True}, headers=headers,
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["type"] != "ping":
                    events.validate_python(json.loads(line[6:]))


def _generated(server: str) -> float:
    try:
        return metric(server, "deepinfer:generation_tokens_total")
    except KeyError:  # no request has generated yet
        return 0.0


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_disconnect_mid_stream_stops_the_request(server, path):
    prompt = "Count from 1 to 1000, separated by commas."
    body = ({"model": MODEL, "max_tokens": 1500, "messages": [{"role": "user", "content": prompt}]}
            if path == "/v1/messages" else {"model": MODEL, "max_output_tokens": 1500, "input": prompt})
    before = _generated(server)
    with httpx.stream("POST", f"{server}{path}", json={**body, "stream": True, **GREEDY}, timeout=60,
                      headers={"x-api-key": KEY, "authorization": f"Bearer {KEY}"}) as r:
        running = 0.0
        for i, _ in enumerate(r.iter_lines()):
            if i % 10 == 9:
                running = metric(server, "deepinfer:num_requests_running")
                if running:
                    break
        assert running == 1  # still generating when the client goes away
    deadline = time.monotonic() + 10
    while metric(server, "deepinfer:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server, "deepinfer:num_requests_running") == 0
    assert metric(server, "deepinfer:kv_cache_blocks_used") == 0
    generated = _generated(server)
    time.sleep(1)
    assert _generated(server) == generated
    assert generated - before < 100  # left alone, this greedy reply runs 122 tokens
