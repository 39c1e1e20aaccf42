"""LangChain's OpenAI and Anthropic chat models: `bind_tools` and `with_structured_output` with every
method each offers (OpenAI: function_calling, json_schema, json_mode; Anthropic: function_calling,
json_schema), on Chat Completions, the Responses API and Messages."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from tests.clients.conftest import KEY, MODEL

pytest.importorskip("langchain_openai")
pytest.importorskip("langchain_anthropic")
from langchain_anthropic import ChatAnthropic  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402

pytestmark = pytest.mark.clients


class City(BaseModel):
    """A city and its country."""

    name: str
    country: str


class Weather(BaseModel):
    """Get the weather in a city."""

    city: City


@pytest.fixture(scope="module", params=["openai-chat", "openai-responses", "anthropic"])
def llm(request, server):
    if request.param == "anthropic":
        return ChatAnthropic(model=MODEL, base_url=server, api_key=KEY, max_tokens=80, temperature=0,
                             max_retries=0, timeout=300)
    return ChatOpenAI(model=MODEL, base_url=f"{server}/v1", api_key=KEY, max_tokens=80, temperature=0,
                      max_retries=0, timeout=300, use_responses_api=request.param == "openai-responses")


def test_bind_tools_forced(llm):
    choice = "any" if isinstance(llm, ChatAnthropic) else "required"
    msg = llm.bind_tools([Weather], tool_choice=choice).invoke("What is the weather in Paris, France?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "Weather"
    Weather.model_validate(msg.tool_calls[0]["args"])


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_with_structured_output(llm, method):
    if isinstance(llm, ChatAnthropic) and method == "json_mode":
        pytest.skip("ChatAnthropic has no json_mode")
    prompt = "Paris is in France. Give the city as JSON."
    if method == "json_mode":
        # json_object: any JSON object (the keys are the prompt's to ask for, which the 135M model ignores)
        out = llm.with_structured_output(City, method=method, include_raw=True).invoke(prompt)
        assert isinstance(json.loads(out["raw"].text), dict)
        return
    assert isinstance(llm.with_structured_output(City, method=method).invoke(prompt), City)
