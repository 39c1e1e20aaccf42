"""The OpenAI Agents SDK (`openai-agents`): an Agent on the Chat Completions model and on the Responses
model, a function tool, and `output_type` with `tool_choice="required"` (tools and a response format in
one request; the SDK resets the choice to auto after the call)."""

from __future__ import annotations

import openai
import pytest
from pydantic import BaseModel

from tests.clients.conftest import KEY, MODEL

pytest.importorskip("agents")
from agents import (  # noqa: E402
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

pytestmark = pytest.mark.clients
set_tracing_disabled(True)


class City(BaseModel):
    name: str
    country: str


class Report(BaseModel):
    city: City  # nested: $defs in the response format's schema
    summary: str


CALLS: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    CALLS.append(city)
    return f"Sunny in {city}."


@function_tool
def find_city(city: City) -> str:
    """Look a city up (a model-typed argument: its schema is a $ref)."""
    CALLS.append(city.name)
    return f"{city.name} is in {city.country}."


@pytest.fixture(scope="module", params=["chat", "responses"])
def model(request, server):
    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=300)
    if request.param == "chat":
        return OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    return OpenAIResponsesModel(model=MODEL, openai_client=client)


def test_function_tool_then_answer(model):
    CALLS.clear()
    agent = Agent(name="weather", instructions="Answer with the get_weather tool.", model=model,
                  tools=[get_weather], model_settings=ModelSettings(tool_choice="required", temperature=0,
                                                                    max_tokens=60))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert CALLS and isinstance(result.final_output, str)


def test_output_type_with_required_tool_choice(model):
    CALLS.clear()
    agent = Agent(name="cities", instructions="Look the city up, then report.", model=model,
                  tools=[find_city], output_type=Report,
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=80))
    result = Runner.run_sync(agent, "Tell me about Paris, France.", max_turns=4)
    assert CALLS and isinstance(result.final_output, Report)
