"""LiteLLM's SDK against the server through its three usual routes: `openai/` (any OpenAI-compatible
server), `hosted_vllm/` (vLLM's provider) and `anthropic/` (Messages, with the server root as api_base):
plain, streamed, tools and a structured response format."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from tests.clients.conftest import KEY, MODEL

litellm = pytest.importorskip("litellm")
pytestmark = pytest.mark.clients
litellm.telemetry = False


class City(BaseModel):
    name: str
    country: str


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["openai", "hosted_vllm", "anthropic"])
def route(request, server):
    base = server if request.param == "anthropic" else f"{server}/v1"
    return {"model": f"{request.param}/{MODEL}", "api_base": base, "api_key": KEY, "max_tokens": 40,
            "temperature": 0, "num_retries": 0, "timeout": 300}


def test_completion_and_stream(route):
    r = litellm.completion(messages=ASK, **route)
    assert r.choices[0].message.content and r.usage.completion_tokens > 0
    chunks = list(litellm.completion(messages=ASK, stream=True, **route))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_forced_tool_call(route):
    r = litellm.completion(messages=ASK, tools=[WEATHER], tool_choice="required", **route)
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)


def test_response_format(route):
    if route["model"].startswith("anthropic/"):
        pytest.skip("LiteLLM sends an Anthropic response_format as a forced tool; covered by test_forced_tool_call")
    r = litellm.completion(messages=[{"role": "user", "content": "Paris is in France."}], response_format=City,
                           **{**route, "max_tokens": 60})
    City.model_validate_json(r.choices[0].message.content)
