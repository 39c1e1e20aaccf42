"""The schema that enforces a required / named tool choice, for tools whose parameters use `$defs`,
`definitions` and root references (`#`): every reference must resolve from the wrapper's root, and two
tools with a definition of the same name must keep theirs apart."""

from __future__ import annotations

import copy

import jsonschema
import pytest

from deepinfer.recipe.tools import ToolChoice, specs_from_openai, tool_choice_schema


def _tool(name: str, params: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params}}


# two tools, each with its own `City`: one by `$defs`, one by the older `definitions`
WEATHER = {"$defs": {"City": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
           "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"]}
ZIP = {"definitions": {"City": {"type": "object", "properties": {"zip": {"type": "integer"}}, "required": ["zip"]}},
       "type": "object", "properties": {"city": {"$ref": "#/definitions/City"}}, "required": ["city"]}
TREE = {"type": "object", "properties": {"label": {"type": "string"}, "children": {
    "type": "array", "items": {"$ref": "#"}}}, "required": ["label"]}
ODD = {"$defs": {"a/b~c": {"type": "integer"}}, "type": "object", "properties": {"n": {"$ref": "#/$defs/a~1b~0c"}},
       "required": ["n"]}


@pytest.fixture
def specs():
    return specs_from_openai([_tool("weather", WEATHER), _tool("zip", ZIP), _tool("tree", TREE), _tool("odd", ODD)])


def test_required_schema_resolves_each_tools_definitions(specs):
    before = copy.deepcopy([s.parameters for s in specs])
    schema = tool_choice_schema(specs, ToolChoice("required"))
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "weather", "arguments": {"city": {"name": "Paris"}}},
          {"name": "zip", "arguments": {"city": {"zip": 75001}}},
          {"name": "tree", "arguments": {"label": "a", "children": [{"label": "b", "children": []}]}},
          {"name": "odd", "arguments": {"n": 3}}]
    jsonschema.validate(ok, schema)
    for bad in ([{"name": "weather", "arguments": {"city": {"zip": 1}}}],  # the other tool's City
                [{"name": "zip", "arguments": {"city": {"name": "Paris"}}}],
                [{"name": "tree", "arguments": {"label": "a", "children": [{"children": []}]}}],
                [{"name": "odd", "arguments": {"n": "3"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert [s.parameters for s in specs] == before  # the tools' own schemas are not rewritten


def test_named_schema_keeps_only_that_tools_definitions(specs):
    schema = tool_choice_schema(specs, ToolChoice("named", "zip"))
    jsonschema.validate({"name": "zip", "arguments": {"city": {"zip": 1}}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "zip", "arguments": {"city": {"name": "x"}}}, schema)
    assert len(schema["$defs"]) == 1


def test_schema_without_references_is_unchanged():
    plain = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = tool_choice_schema(specs_from_openai([_tool("p", plain)]), ToolChoice("named", "p"))
    assert schema["properties"]["arguments"] == plain and "$defs" not in schema
