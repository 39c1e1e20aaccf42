"""Tool-call parsers, reasoning parser, tool schemas and the response store, on text (no model)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from deepinfer.recipe.output import Content, OutputParser, Reasoning, RecipeOptions
from deepinfer.recipe.reasoning import ThinkReasoningParser, resolve_reasoning_parser
from deepinfer.recipe.tool_parsers import (
    HermesToolParser,
    JsonChoiceToolParser,
    JsonSequenceToolParser,
    ToolCallDelta,
    detect_tool_parser,
    get_tool_parser,
)
from deepinfer.recipe.tools import (
    ToolChoice,
    ToolError,
    anthropic_tool_choice,
    fallback_messages,
    openai_tool_choice,
    specs_from_anthropic,
    specs_from_openai,
    tool_choice_schema,
)
from deepinfer.server.response_store import ResponseStore

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"},
                                                "unit": {"enum": ["C", "F"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


def feed_in_steps(parser, text: str, step: int) -> list:
    events = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i:i + step])
    return events + parser.finish()


def calls_from_deltas(events: list) -> dict[int, list[str]]:
    """{index: [name, arguments]} rebuilt from streamed deltas, as a client does."""
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.name is not None:
                assert e.index not in calls, "a call's name is sent once"
                calls[e.index] = [e.name, ""]
            calls[e.index][1] += e.arguments
    return calls


HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "note": "a}\\"<b"}}\n'
          '</tool_call>\n<tool_call>\n{"arguments": {"zone": "CET"}, "name": "get_time"}\n</tool_call>')


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_hermes_streaming_matches_whole(step):
    whole = HermesToolParser()
    content, calls = whole.parse(HERMES)
    assert content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "note": 'a}"<b'}), ("get_time", {"zone": "CET"})]
    p = HermesToolParser()
    events = feed_in_steps(p, HERMES, step)
    assert "".join(e for e in events if isinstance(e, str)) == content
    assert calls_from_deltas(events) == {i: [c.name, c.arguments] for i, c in enumerate(calls)}


def test_hermes_arguments_stream_before_the_call_closes():
    p = HermesToolParser()
    events = p.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "Par')
    assert [e.name for e in events if isinstance(e, ToolCallDelta) and e.name] == ["get_weather"]
    assert "".join(e.arguments for e in events if isinstance(e, ToolCallDelta)) == '{"city": "Par'
    more = p.feed('is"}}</tool_call>')
    assert "".join(e.arguments for e in more if isinstance(e, ToolCallDelta)) == 'is"}'
    assert not p.finish()
    assert p.calls[0].arguments == '{"city": "Paris"}'


def test_hermes_holds_back_a_partial_tag_and_keeps_bad_json_as_content():
    p = HermesToolParser()
    assert p.feed("Hello <tool") == ["Hello "]
    assert p.feed("box>") == ["<toolbox>"]  # not the tag after all
    text = 'x <tool_call>{"name": oops}</tool_call> y'
    content, calls = HermesToolParser().parse(text)
    assert calls == [] and content == text
    content, calls = HermesToolParser().parse("no calls <tool_")
    assert calls == [] and content == "no calls <tool_"


def test_hermes_truncated_call_still_ends():
    p = HermesToolParser()
    events = feed_in_steps(p, '<tool_call>{"name": "f", "arguments": {"a": [1, 2', 4)
    assert calls_from_deltas(events) == {0: ["f", '{"a": [1, 2']}
    assert p.calls[0].name == "f"


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_llama3_json(step):
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
    p = JsonSequenceToolParser()
    events = feed_in_steps(p, text, step)
    assert p.content == ""
    assert calls_from_deltas(events) == {0: ["get_weather", '{"city": "Oslo"}'], 1: ["get_time", "{}"]}
    # a reply that is not a call stays content, JSON or not
    for reply in ["The weather is fine.", '{"answer": 42}', "  {\"name\": 1}"]:
        content, calls = JsonSequenceToolParser().parse(reply)
        assert calls == [] and content == reply


def test_json_choice_parser_array_and_object():
    text = '[{"name": "get_weather", "arguments": {"city": "a]b"}}, {"name": "get_time", "arguments": {"zone": "X"}}]'
    p = JsonChoiceToolParser()
    events = feed_in_steps(p, text, 3)
    assert calls_from_deltas(events) == {0: ["get_weather", '{"city": "a]b"}'], 1: ["get_time", '{"zone": "X"}']}
    _, calls = JsonChoiceToolParser().parse('{"name": "get_time", "arguments": {"zone": "UTC"}}')
    assert [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone": "UTC"}')]


def test_registry_and_detection():
    assert get_tool_parser("qwen") is HermesToolParser
    with pytest.raises(ValueError, match="unknown tool parser"):
        get_tool_parser("nope")
    assert detect_tool_parser("{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert detect_tool_parser("{{ '<|python_tag|>' }}{% if tools %}{% endif %}") == "llama3_json"
    assert detect_tool_parser("{% if tools %}x{% endif %}", ["LlamaForCausalLM"]) == "llama3_json"
    assert detect_tool_parser("{{ messages }}") == "hermes"  # no tool support: our Hermes-style prompt


# ---------------------------------------------------------------- reasoning


@pytest.mark.parametrize("step", [1, 2, 1000])
def test_think_parser_prompt_opened(step):
    text = "\nplan the answer </think>\n\nThe answer."
    p = ThinkReasoningParser(in_reasoning=True)
    pieces = feed_in_steps(p, text, step)
    assert p.reasoning == "plan the answer " and p.content == "The answer."
    assert "".join(t for k, t in pieces if k == "reasoning") == p.reasoning


def test_think_parser_detects_start_tag_or_plain_answer():
    p = ThinkReasoningParser()
    feed_in_steps(p, "<think>\nhmm</think>yes", 2)
    assert (p.reasoning, p.content) == ("hmm", "yes")
    p = ThinkReasoningParser()
    feed_in_steps(p, "<thin air", 1)
    assert (p.reasoning, p.content) == ("", "<thin air")
    p = ThinkReasoningParser(in_reasoning=True)
    feed_in_steps(p, "still thinking </thi", 3)  # ends while thinking: all of it is reasoning
    assert (p.reasoning, p.content) == ("still thinking </thi", "")


def test_reasoning_parser_resolution():
    assert resolve_reasoning_parser("auto", "{{ '<think>' }}") == "think"
    assert resolve_reasoning_parser("auto", "{{ x }}") is None
    assert resolve_reasoning_parser("none", "<think>") is None
    with pytest.raises(ValueError):
        resolve_reasoning_parser("bogus", None)


class _Tok:
    """Just enough tokenizer for OutputParser: the prompt tail decodes to an open <think>."""

    unk_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "<|im_start|>assistant\n<think>\n"

    def convert_tokens_to_ids(self, token):
        return 99 if token == "</think>" else 0


def test_output_parser_reasoning_then_tool_call():
    p = OutputParser(RecipeOptions("hermes", "think"), _Tok(), [1, 2, 3], tools=True)
    text = 'need weather</think>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    events = feed_in_steps(p, text, 4)
    assert "".join(e.text for e in events if isinstance(e, Reasoning)) == "need weather"
    assert not "".join(e.text for e in events if isinstance(e, Content)).strip()
    assert calls_from_deltas(events) == {0: ["get_weather", '{"city": "Rome"}']}
    assert p.reasoning_tokens([5, 6, 99, 7, 8]) == 3


# ---------------------------------------------------------------- tools on the way in


def test_specs_and_choices():
    specs = specs_from_openai([WEATHER, TIME])
    assert [s.name for s in specs] == ["get_weather", "get_time"]
    flat = specs_from_openai([{"type": "function", "name": "f", "parameters": {"type": "object"}}])
    assert flat[0].name == "f"
    with pytest.raises(ToolError, match="not supported"):
        specs_from_openai([{"type": "web_search"}])
    with pytest.raises(ToolError, match="twice"):
        specs_from_openai([WEATHER, WEATHER])
    assert openai_tool_choice(None, specs) == ToolChoice("auto")
    assert openai_tool_choice({"type": "function", "function": {"name": "get_time"}}, specs) == \
        ToolChoice("named", "get_time")
    with pytest.raises(ToolError, match="not among the tools"):
        openai_tool_choice({"type": "function", "function": {"name": "nope"}}, specs)
    with pytest.raises(ToolError):
        openai_tool_choice("sometimes", specs)
    a = specs_from_anthropic([{"name": "g", "input_schema": {"type": "object"}}])
    assert anthropic_tool_choice({"type": "any"}, a) == ToolChoice("required")
    assert anthropic_tool_choice({"type": "tool", "name": "g"}, a) == ToolChoice("named", "g")
    assert anthropic_tool_choice({"type": "none"}, a) == ToolChoice("none")


def test_tool_choice_schemas_accept_calls_and_reject_others():
    specs = specs_from_openai([WEATHER, TIME])
    named = tool_choice_schema(specs, ToolChoice("named", "get_weather"))
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}, named)
    for bad in [{"name": "get_time", "arguments": {"zone": "x"}}, {"name": "get_weather", "arguments": {}},
                {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "K"}}, {"name": "get_weather"}]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, named)
    required = tool_choice_schema(specs, ToolChoice("required"))
    ok = [{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "arguments": {"city": "A"}}]
    jsonschema.validate(ok, required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], required)
    single = tool_choice_schema(specs, ToolChoice("required"), parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, single)
    # what the grammar lets through parses straight into the calls, compact or pretty-printed
    for text in (json.dumps(ok), json.dumps(ok, indent=2), json.dumps(ok, separators=(",", ":"))):
        _, calls = JsonChoiceToolParser().parse(text)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "UTC"}),
                                                                       ("get_weather", {"city": "A"})]
    _, calls = JsonChoiceToolParser().parse(json.dumps(ok[0]))
    assert [c.name for c in calls] == ["get_time"]


def test_fallback_prompt_renders_tools_calls_and_results_as_text():
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    out = fallback_messages(msgs, specs_from_openai([TIME]))
    assert out[0]["role"] == "system" and '"get_time"' in out[0]["content"]
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>' in out[2]["content"]
    assert out[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}
    assert all("tool_calls" not in m for m in out)


# ---------------------------------------------------------------- response store


def test_response_store_is_bounded_by_count_and_age():
    now = [0.0]
    store = ResponseStore(max_entries=3, ttl=10.0, clock=lambda: now[0])
    for i in range(5):
        store.put(f"r{i}", {"id": f"r{i}"}, [])
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    now[0] = 5.0
    store.put("late", {}, [])
    now[0] = 10.5  # r2..r4 are older than 10 s, "late" is not
    assert store.get("r4") is None and store.get("late") is not None and len(store) == 1
    assert store.delete("late") and not store.delete("late")
    off = ResponseStore(max_entries=0)
    off.put("x", {}, [])
    assert off.get("x") is None


# ---------------------------------------------------------------- server options


class _TemplateTok:
    def __init__(self, template: str | None) -> None:
        self.chat_template = template


def test_recipe_options_detect_and_override():
    from deepinfer.cli import build_parser
    from deepinfer.config import ServerConfig, config_from_args
    from deepinfer.server.app import recipe_options

    qwen3 = "{% if tools %}<tool_call>{% endif %}{{ '<think>' }}"
    assert recipe_options(_TemplateTok(qwen3), ["Qwen3ForCausalLM"]) == RecipeOptions("hermes", "think")
    llama = "{% if tools %}{{ '<|python_tag|>' }}{% endif %}"
    assert recipe_options(_TemplateTok(llama), ["LlamaForCausalLM"]) == RecipeOptions("llama3_json", None)
    assert recipe_options(_TemplateTok(qwen3), None, "llama3_json", "none") == RecipeOptions("llama3_json", None)
    with pytest.raises(ValueError):
        recipe_options(_TemplateTok(None), None, "nope")
    args = build_parser().parse_args(["serve", "--tool-parser", "llama3_json", "--reasoning-parser", "none",
                                      "--responses-store-size", "7"])
    cfg = config_from_args(ServerConfig, args)
    assert (cfg.tool_parser, cfg.reasoning_parser, cfg.responses_store_size) == ("llama3_json", "none", 7)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-parser", "nope"])
