"""The openai SDK's own helpers: `chat.completions.parse` (a Pydantic response_format, and
`pydantic_function_tool` with a forced choice), `chat.completions.stream` and `responses.parse` /
`responses.stream`."""

from __future__ import annotations

import openai
import pytest
from pydantic import BaseModel

from tests.clients.conftest import KEY, MODEL

pytestmark = pytest.mark.clients


class City(BaseModel):
    name: str
    country: str


class Weather(BaseModel):
    """Get the weather in a city."""

    city: City  # a nested model: its schema is a $ref into $defs


ASK = [{"role": "user", "content": "What is the weather in Paris, France?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=300)


def test_parse_response_format(client):
    r = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=City, max_tokens=60, temperature=0)
    assert isinstance(r.choices[0].message.parsed, City)


def test_parse_pydantic_function_tool_forced(client):
    tool = openai.pydantic_function_tool(Weather)
    r = client.chat.completions.parse(model=MODEL, messages=ASK, tools=[tool], max_tokens=60, temperature=0,
                                      tool_choice={"type": "function", "function": {"name": "Weather"}})
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "Weather" and isinstance(call.function.parsed_arguments, Weather)


def test_chat_stream_helper(client):
    with client.chat.completions.stream(model=MODEL, messages=ASK, response_format=City, max_tokens=60,
                                        temperature=0) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion()
    assert {"content.delta", "content.done"} <= kinds
    assert isinstance(final.choices[0].message.parsed, City)


def test_responses_parse_and_stream(client):
    r = client.responses.parse(model=MODEL, input="Paris is in France. Give the city.", text_format=City,
                               max_output_tokens=60, temperature=0)
    assert isinstance(r.output_parsed, City)
    with client.responses.stream(model=MODEL, input="Paris is in France. Give the city.", text_format=City,
                                 max_output_tokens=60, temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()  # needs response.completed: the schema's JSON ends in time
    assert "response.output_text.delta" in kinds and isinstance(final.output_parsed, City)
