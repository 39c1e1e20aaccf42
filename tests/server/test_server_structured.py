"""Structured output and logit_bias through the real server (default model) and the official `openai` SDK."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.engine.test_structured import SCHEMAS
from tests.server_utils import KEY

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


def _ask(what: str) -> list[dict]:
    return [{"role": "user", "content": what}]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_chat_json_schema_validates(client, name):
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=_ask("Give me an example as JSON."), max_tokens=200,
                                       temperature=0.7, seed=1, n=2, response_format=fmt)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    chunks = list(client.chat.completions.create(model=MODEL, messages=_ask("Another one."), max_tokens=200,
                                                 temperature=0, stream=True, response_format=fmt))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_sdk_parse_with_a_pydantic_model(client):
    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)
        population: int = Field(ge=0, le=10**8)

    r = client.chat.completions.parse(model=MODEL, messages=_ask("Describe Paris."), max_tokens=100,
                                      temperature=0, response_format=City)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and isinstance(city.population, int)


def test_json_object_parses(client):
    r = client.chat.completions.create(model=MODEL, messages=_ask("List three fruits as a JSON object."),
                                       max_tokens=200, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_vllm_style_extras_on_completions_and_chat(client):
    pattern = r"\d{3}-[a-z]{2,4}"
    r = client.completions.create(model=MODEL, prompt="A code: ", max_tokens=20, temperature=1.0, seed=3, n=2,
                                  extra_body={"guided_regex": pattern})
    assert all(re.fullmatch(pattern, c.text) for c in r.choices), [c.text for c in r.choices]
    r = client.completions.create(model=MODEL, prompt="Answer: ", max_tokens=10, temperature=0,
                                  extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}})
    assert r.choices[0].text in ("yes", "no")
    schema = SCHEMAS["enums"]
    chunks = list(client.completions.create(model=MODEL, prompt="JSON: ", max_tokens=60, temperature=0, stream=True,
                                            extra_body={"guided_json": schema}))
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in chunks if c.choices)), schema)
    r = client.chat.completions.create(model=MODEL, messages=_ask("Pick a color."), max_tokens=60, temperature=0,
                                       extra_body={"structured_outputs": {"json": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_vllm_choice(client):
    """vLLM's `guided_choice` and `structured_outputs: {"choice": ...}`: the whole output is one of the strings."""
    options = ["Paris", "London", "New York", 'naïve "quoted"']
    r = client.chat.completions.create(model=MODEL, messages=_ask("Which city is in France?"), max_tokens=20,
                                       temperature=1.5, seed=5, n=6, extra_body={"guided_choice": options})
    assert all(c.message.content in options and c.finish_reason == "stop" for c in r.choices), r.choices
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=20,
                                            temperature=0, stream=True,
                                            extra_body={"structured_outputs": {"choice": options}}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) in options


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_json": {"type": "object"}}, "guided_regex"),
    ({"structured_outputs": {"yaml": "x"}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["yes", ""]}, "guided_choice"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
    ({"guided_choice": ["yes"], "guided_regex": "y"}, "guided_choice"),
    ({"logit_bias": {"hello": 5}}, "logit_bias"),
    ({"logit_bias": {"10000000": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
])
def test_bad_constraints_are_400s(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=_ask("hi"), max_tokens=5, extra_body=body)
    assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=5, stream=True, extra_body=body)
    r = client.chat.completions.create(model=MODEL, messages=_ask("hi"), max_tokens=3)  # still serving
    assert r.choices[0].message.content is not None


def test_logit_bias_forces_a_token(client, default_model_dir):
    from transformers import AutoTokenizer

    (tid,) = AutoTokenizer.from_pretrained(str(default_model_dir)).encode(" banana", add_special_tokens=False)
    r = client.chat.completions.create(model=MODEL, messages=_ask("Say hello."), max_tokens=5, temperature=1.0,
                                       logit_bias={str(tid): 100})
    assert r.choices[0].message.content == " banana" * 5
    r = client.chat.completions.create(model=MODEL, messages=_ask("Say hello."), max_tokens=5, temperature=0,
                                       logit_bias={str(tid): -100, "9": -100.0})
    assert "banana" not in r.choices[0].message.content
