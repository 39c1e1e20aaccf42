"""The Responses API and Chat Completions tool calling on the real server (default model), through the
official `openai` SDK."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server_utils import running_server

MODEL = "SmolLM2-135M-Instruct"
Q = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
TEXT_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
              "response.content_part.added", "response.output_text.delta", "response.output_text.done",
              "response.content_part.done", "response.output_item.done", "response.completed"]


def _call_items(city: str, i: int) -> list[dict]:
    return [{"role": "user", "content": f"What is the weather in {city}?"},
            {"type": "function_call", "call_id": f"call_{i}", "name": "get_weather",
             "arguments": json.dumps({"city": city})}]


# Two earlier turns that called the tool: the 135M default model copies the pattern for the third city
FEW_SHOT = _call_items("Paris", 1) + _call_items("Rome", 2) + [
    {"role": "user", "content": "What is the weather in London?"}]
CHAT_FEW_SHOT = []
for _city, _i in (("Paris", 1), ("Rome", 2)):
    CHAT_FEW_SHOT += [{"role": "user", "content": f"What is the weather in {_city}?"},
                      {"role": "assistant", "content": None, "tool_calls": [{
                          "id": f"call_{_i}", "type": "function",
                          "function": {"name": "get_weather", "arguments": json.dumps({"city": _city})}}]}]
CHAT_FEW_SHOT.append({"role": "user", "content": "What is the weather in London?"})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("srv") / "server.log"
    # one decode step per pass: a stream's tokens come one at a time, so tool-call arguments arrive in pieces
    # (a pass of several steps may send a short argument whole)
    with running_server("--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--dtype", "float32",
                        "--responses-store-size", "4", "--num-scheduler-steps", "1", log=log) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def _tokens(server: str, messages: list[dict]) -> int:
    return httpx.post(f"{server}/tokenize", json={"messages": messages}, timeout=30).json()["count"]


def test_logprobs_when_included(client):
    # the same prompt and greedy tokens as Chat Completions, so the same logprob entries
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": Q}], max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=2)
    want = [(t.token, round(t.logprob, 4), [a.token for a in t.top_logprobs]) for t in chat.choices[0].logprobs.content]
    ask = {"model": MODEL, "input": Q, "max_output_tokens": 8, "temperature": 0,
           "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    r = client.responses.create(**ask)
    got = r.output[0].content[0].logprobs
    assert [(t.token, round(t.logprob, 4), [a.token for a in t.top_logprobs]) for t in got] == want
    assert "".join(t.token for t in got).startswith(r.output_text)  # and the end of turn, as Chat's
    streamed, done = [], None
    for event in client.responses.create(**ask, stream=True):
        if event.type == "response.output_text.delta":
            streamed += event.logprobs
        elif event.type == "response.output_text.done":
            done = event.logprobs
    # the deltas carry the text's tokens; the end of turn, which adds no text, only the done event
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t[0], t[1]) for t in want[:len(streamed)]]
    assert len(streamed) >= len(want) - 1 and [t.token for t in done] == [t[0] for t in want]
    plain = client.responses.create(model=MODEL, input=Q, max_output_tokens=4, temperature=0)
    assert plain.output[0].content[0].logprobs == []  # not asked for


def test_create_non_streaming(client, server):
    r = client.responses.create(model=MODEL, input=Q, max_output_tokens=30, temperature=0,
                                prompt_cache_key="k1", prompt_cache_retention="24h")
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert "Paris" in r.output_text
    assert [o.type for o in r.output] == ["message"]
    u = r.usage
    assert u.input_tokens == _tokens(server, [{"role": "user", "content": Q}])
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens > 0
    assert u.input_tokens_details.cached_tokens >= 0 and u.output_tokens_details.reasoning_tokens == 0
    assert r.prompt_cache_key == "k1" and r.prompt_cache_retention == "24h"


def test_instructions_are_the_system_message(client, server):
    r = client.responses.create(model=MODEL, instructions="Answer briefly.", input=Q, max_output_tokens=5,
                                temperature=0)
    assert r.usage.input_tokens == _tokens(server, [{"role": "system", "content": "Answer briefly."},
                                                    {"role": "user", "content": Q}])
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5


def test_streaming_event_order_and_final_response(client):
    ref = client.responses.create(model=MODEL, input=Q, max_output_tokens=30, temperature=0)
    events = list(client.responses.create(model=MODEL, input=Q, max_output_tokens=30, temperature=0, stream=True))
    types = [e.type for e in events]
    collapsed = [t for i, t in enumerate(types) if t != "response.output_text.delta" or types[i - 1] != t]
    assert collapsed == TEXT_ORDER
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == ref.output_text == final.output_text
    assert final.usage.output_tokens == ref.usage.output_tokens
    with client.responses.stream(model=MODEL, input=Q, max_output_tokens=30, temperature=0) as stream:
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == ref.output_text


def test_previous_response_id_continues_the_conversation(client, server):
    first = client.responses.create(model=MODEL, input=Q, max_output_tokens=30, temperature=0)
    follow = "And of Germany?"
    second = client.responses.create(model=MODEL, input=follow, previous_response_id=first.id,
                                     max_output_tokens=30, temperature=0)
    convo = [{"role": "user", "content": Q}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": follow}]
    assert second.usage.input_tokens == _tokens(server, convo) > first.usage.input_tokens
    assert second.previous_response_id == first.id
    # the first exchange's KV is reused by the follow-up
    assert second.usage.input_tokens_details.cached_tokens > 0
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text


def test_unknown_and_unstored_ids_are_404(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_does_not_exist")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_gone", max_output_tokens=4)
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    kept = client.responses.create(model=MODEL, input="hi", max_output_tokens=4)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_store_is_bounded(client):
    ids = [client.responses.create(model=MODEL, input="hi", max_output_tokens=2).id for _ in range(5)]
    with pytest.raises(openai.NotFoundError):  # --responses-store-size 4: the oldest is gone
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[-1]).id == ids[-1]


def test_bad_requests_are_400(client):
    for kwargs in [dict(tools=[{"type": "web_search"}]), dict(prompt_cache_retention="forever"),
                   dict(input=[{"type": "item_reference", "id": "x"}]), dict(max_output_tokens=0),
                   dict(text={"format": {"type": "xml"}}),
                   dict(tools=[WEATHER], tool_choice={"type": "function", "name": "nope"})]:
        with pytest.raises(openai.BadRequestError):
            client.responses.create(**{"model": MODEL, "input": "hi", **kwargs})


def test_function_call_items(client):
    r = client.responses.create(model=MODEL, input=FEW_SHOT, tools=[WEATHER], max_output_tokens=60, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls, r.output
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "London"}
    assert calls[0].call_id.startswith("call_") and calls[0].status == "completed"
    events = list(client.responses.create(model=MODEL, input=FEW_SHOT, tools=[WEATHER], max_output_tokens=60,
                                          temperature=0, stream=True))
    types = [e.type for e in events]
    collapsed = [t for i, t in enumerate(types) if not t.endswith(".delta") or types[i - 1] != t]
    assert collapsed == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.function_call_arguments.delta", "response.function_call_arguments.done",
                         "response.output_item.done", "response.completed"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == calls[0].arguments == events[-1].response.output[0].arguments
    # the call's result goes back as function_call_output; the conversation continues
    follow = client.responses.create(model=MODEL, previous_response_id=r.id, tools=[WEATHER], max_output_tokens=20,
                                     temperature=0, input=[{"type": "function_call_output",
                                                            "call_id": calls[0].call_id, "output": "Foggy"}])
    assert follow.usage.input_tokens > r.usage.input_tokens


def test_text_format_json_schema_validates(client):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Weather in Paris as JSON.", max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_schema", "name": "w", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


# ---------------------------------------------------------------- chat completions with tools


def test_chat_tool_call_non_streaming_and_streaming_agree(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT_FEW_SHOT, tools=[CHAT_WEATHER], temperature=0,
                                       max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "London"}
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT_FEW_SHOT, tools=[CHAT_WEATHER],
                                                 temperature=0, max_tokens=60, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 for d in deltas) and all(d.id is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert len(deltas) > 2  # the arguments came in pieces
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks).strip()


def test_chat_tool_choice_none_and_plain_answers(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT_FEW_SHOT, tools=[CHAT_WEATHER], temperature=0,
                                       max_tokens=30, tool_choice="none")
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": Q}], tools=[CHAT_WEATHER],
                                       temperature=0, max_tokens=30)
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"


def test_chat_tool_errors(client):
    bad = [dict(tool_choice={"type": "function", "function": {"name": "nope"}}),
           dict(tool_choice="sometimes"), dict(tools=[{"type": "code_interpreter"}])]
    for kwargs in bad:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**{"model": MODEL, "messages": CHAT_FEW_SHOT, "tools": [CHAT_WEATHER],
                                              "max_tokens": 5, **kwargs})


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_chat_tool_choice_enforced(client, choice):
    # a question that does not call for the tool: only the grammar makes the model call it
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a joke."}], tools=[CHAT_WEATHER],
                      tool_choice=choice, max_tokens=80, temperature=0)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
            name, args = deltas[0].function.name, "".join(d.function.arguments or "" for d in deltas)
        else:
            r = client.chat.completions.create(**kwargs)
            assert r.choices[0].finish_reason == "tool_calls"
            name, args = r.choices[0].message.tool_calls[0].function.name, \
                r.choices[0].message.tool_calls[0].function.arguments
        assert name == "get_weather"
        assert isinstance(json.loads(args)["city"], str)


def _sse_data(server: str, path: str, body: dict) -> list[tuple[str | None, dict]]:
    """(event name, data) of each SSE frame, read raw."""
    frames, event = [], None
    with httpx.stream("POST", f"{server}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: ") and line != "data: [DONE]":
                frames.append((event, json.loads(line[len("data: "):])))
    return frames


def test_responses_shapes_validate_strictly_against_the_sdk_types(server):
    """The SDK builds its objects without validation; validate our JSON against its types strictly."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    events = TypeAdapter(ResponseStreamEvent)
    for body in [{"model": MODEL, "input": Q, "max_output_tokens": 20, "temperature": 0},
                 {"model": MODEL, "input": FEW_SHOT, "tools": [WEATHER], "max_output_tokens": 60, "temperature": 0}]:
        Response.model_validate(httpx.post(f"{server}/v1/responses", json=body, timeout=120).json())
        for name, data in _sse_data(server, "/v1/responses", body):
            assert name == data["type"]
            events.validate_python(data)


def test_chat_tool_call_shapes_validate_strictly_against_the_sdk_types(server):
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    body = {"model": MODEL, "messages": CHAT_FEW_SHOT, "tools": [CHAT_WEATHER], "max_tokens": 60, "temperature": 0}
    r = ChatCompletion.model_validate(httpx.post(f"{server}/v1/chat/completions", json=body, timeout=120).json())
    assert r.choices[0].message.tool_calls
    for _, data in _sse_data(server, "/v1/chat/completions", body):
        ChatCompletionChunk.model_validate(data)
