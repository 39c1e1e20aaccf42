"""instructor (`instructor.from_openai`): TOOLS (its default: a named tool choice), JSON_SCHEMA,
RESPONSES_TOOLS (a named tool choice plus text.format on every call), `create_iterable` (a required
tool choice over a wrapper whose items are `$ref`s) and nested models."""

from __future__ import annotations

import openai
import pytest
from pydantic import BaseModel

from tests.clients.conftest import KEY, MODEL

instructor = pytest.importorskip("instructor")
pytestmark = pytest.mark.clients


class City(BaseModel):
    name: str
    country: str


class Person(BaseModel):
    name: str
    age: int
    home: City  # nested: the tool schema carries $defs


TEXT = [{"role": "user", "content": "Extract: Alice is 30 and lives in Paris, France."}]


@pytest.fixture(scope="module")
def openai_client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA", "RESPONSES_TOOLS"])
def test_nested_model(openai_client, mode):
    client = instructor.from_openai(openai_client, mode=getattr(instructor.Mode, mode))
    person = client.chat.completions.create(model=MODEL, response_model=Person, messages=TEXT, max_retries=0,
                                            max_tokens=80, temperature=0)
    assert isinstance(person, Person) and isinstance(person.home, City)


def test_create_iterable(openai_client):
    client = instructor.from_openai(openai_client, mode=instructor.Mode.TOOLS)
    cities = list(client.chat.completions.create_iterable(
        model=MODEL, response_model=City, max_retries=0, max_tokens=120, temperature=0,
        messages=[{"role": "user", "content": "List two cities: Paris in France and Rome in Italy."}]))
    assert cities and all(isinstance(c, City) for c in cities)


def test_streamed_partial(openai_client):
    client = instructor.from_openai(openai_client, mode=instructor.Mode.TOOLS)
    parts = list(client.chat.completions.create_partial(model=MODEL, response_model=City, messages=TEXT,
                                                        max_retries=0, max_tokens=60, temperature=0))
    assert parts and isinstance(parts[-1].name, str) and isinstance(parts[-1].country, str)
