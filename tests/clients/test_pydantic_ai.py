"""pydantic-ai: an Agent on OpenAI Chat Completions and on the Responses API, with a structured
`output_type` (its default tool output: a required tool choice over the model's schema, nested models
included), native output (response_format / text.format), and a function tool."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from tests.clients.conftest import KEY, MODEL

pytest.importorskip("pydantic_ai")
from pydantic_ai import Agent, NativeOutput  # noqa: E402
from pydantic_ai.messages import ToolCallPart  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402

pytestmark = pytest.mark.clients
SETTINGS = {"temperature": 0.0, "max_tokens": 80}


class City(BaseModel):
    name: str
    country: str


class Trip(BaseModel):
    destination: City  # nested: $defs in the output tool's schema
    days: int


@pytest.fixture(scope="module", params=["chat", "responses"])
def model(request, server):
    provider = OpenAIProvider(base_url=f"{server}/v1", api_key=KEY)
    cls = OpenAIChatModel if request.param == "chat" else OpenAIResponsesModel
    return cls(MODEL, provider=provider)


def test_tool_output_nested(model):
    agent = Agent(model, output_type=Trip, model_settings=SETTINGS, retries=0)
    result = agent.run_sync("Plan a 3 day trip to Paris, France.")
    assert isinstance(result.output, Trip) and isinstance(result.output.destination, City)


def test_native_output(model):
    """NativeOutput: the schema as response_format / text.format. (PromptedOutput, the schema only in the
    prompt with no grammar, is left out: whether it parses is up to the 135M model.)"""
    agent = Agent(model, output_type=NativeOutput(City), model_settings=SETTINGS, retries=0)
    assert isinstance(agent.run_sync("Paris is in France. Which city is it?").output, City)


def test_function_tool(model):
    """A function tool next to the output tool, every step forced to call one of them (pydantic-ai refuses
    a plain `required` choice with an output tool; a list of names is its forced choice)."""
    calls: list[str] = []
    agent = Agent(model, output_type=City, retries=0, instructions="Use get_weather, then give the city.",
                  model_settings={**SETTINGS, "tool_choice": ["get_weather", "final_result"]})

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"Sunny in {city}."

    result = agent.run_sync("What is the weather in Paris, France?")
    assert isinstance(result.output, City)
    parts = [p for m in result.all_messages() for p in m.parts if isinstance(p, ToolCallPart)]
    assert parts and {p.tool_name for p in parts} <= {"get_weather", "final_result"}
    assert len(calls) == sum(p.tool_name == "get_weather" for p in parts)
