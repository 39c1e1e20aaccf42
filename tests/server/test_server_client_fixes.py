"""Issue #17's server defects, each through the official SDK on the real server (default model):
forced tool calls for tools whose schemas use `$defs` / `$ref`, a response format together with a forced
tool choice, `/v1/completions` `echo` with prompt logprobs (and `max_tokens: 0`), and a Responses message
cut by `max_output_tokens`."""

from __future__ import annotations

import json
import math

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.server_utils import KEY

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0}
# a nested model as Pydantic writes it: the argument's type lives in the root `$defs`
CITY_PARAMS = {"$defs": {"City": {"type": "object", "properties": {"name": {"type": "string"}},
                                  "required": ["name"]}},
               "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"]}
# a recursive one: a reference to the parameters' own root
TREE_PARAMS = {"type": "object", "properties": {"label": {"type": "string"}, "children": {
    "type": "array", "items": {"$ref": "#"}, "maxItems": 1}}, "required": ["label", "children"]}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}




@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=300)


def _chat_tool(name: str, params: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": params}}


# ---------------------------------------------------------------- 1. $defs / $ref under a forced tool call


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_chat_forced_tool_call_with_defs(client, choice):
    # one call (the 135M model repeats parallel calls until max_tokens)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[_chat_tool("get_weather", CITY_PARAMS)],
                                       tool_choice=choice, parallel_tool_calls=False, max_tokens=60, **GREEDY)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(calls[0].function.arguments), CITY_PARAMS)


def test_chat_named_recursive_tool(client):
    """A reference to the parameters' root (`#`) is served too (before: 400). The default model nests
    without end, so only the start of the call is checked; tests/recipe/test_tool_parsers.py checks the schema."""
    tools = [_chat_tool("get_weather", CITY_PARAMS), _chat_tool("tree", TREE_PARAMS)]
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, max_tokens=25, **GREEDY,
                                       tool_choice={"type": "function", "function": {"name": "tree"}})
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "tree" and call.function.arguments.startswith('{"label": "')


def test_responses_required_tool_call_with_defs(client):
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY_PARAMS, "strict": False}]
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=tools,
                                tool_choice="required", parallel_tool_calls=False, max_output_tokens=60,
                                temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), CITY_PARAMS)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_anthropic_forced_tool_use_with_defs(claude, choice):
    r = claude.messages.create(model=MODEL, max_tokens=60, messages=ASK,
                               tool_choice={**choice, "disable_parallel_tool_use": True},
                               tools=[{"name": "get_weather", "input_schema": CITY_PARAMS}], extra_body=GREEDY)
    uses = [b for b in r.content if b.type == "tool_use"]
    assert uses and r.stop_reason == "tool_use"
    jsonschema.validate(uses[0].input, CITY_PARAMS)


# ---------------------------------------------------------------- 2. a format with a forced tool choice


def test_chat_response_format_with_required_tool_choice(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    tools = [_chat_tool("get_weather", CITY_PARAMS)]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=choice,
                                           parallel_tool_calls=False, response_format=fmt, max_tokens=60, **GREEDY)
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), CITY_PARAMS)
    # streamed, the call arrives as tool_calls deltas (not as content, as a format-only reply would)
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice="required",
                                            parallel_tool_calls=False, response_format=fmt, max_tokens=60,
                                            stream=True, **GREEDY)
    chunks = list(stream)
    args = "".join(tc.function.arguments or "" for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or [])
    jsonschema.validate(json.loads(args), CITY_PARAMS)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_responses_text_format_with_required_tool_choice(client):
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY_PARAMS, "strict": False}]
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=tools,
                                tool_choice="required", parallel_tool_calls=False, max_output_tokens=60,
                                temperature=0, text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA}})
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), CITY_PARAMS)


def test_anthropic_output_format_with_forced_tool_choice(claude):
    r = claude.messages.create(model=MODEL, max_tokens=60, messages=ASK,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               tools=[{"name": "get_weather", "input_schema": CITY_PARAMS}],
                               extra_body={**GREEDY, "output_config": {"format": {"type": "json_schema",
                                                                                  "schema": ANSWER_SCHEMA}}})
    uses = [b for b in r.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, CITY_PARAMS)


# ---------------------------------------------------------------- 3. echo with prompt logprobs


def _ids(client, text: str) -> list[int]:
    """The prompt's token ids as /v1/completions tokenizes it."""
    base = str(client.base_url).removesuffix("/").removesuffix("/v1")
    r = httpx.post(f"{base}/tokenize", json={"prompt": text}, headers={"Authorization": f"Bearer {KEY}"})
    r.raise_for_status()
    return r.json()["tokens"]


def _check_shape(lp, text: str, n_tokens: int) -> None:
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n_tokens)]


def test_completions_echo_returns_prompt_logprobs(client):
    prompt = "The capital of France is Paris"
    n_prompt = len(_ids(client, prompt))
    r = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0)
    c = r.choices[0]
    _check_shape(c.logprobs, c.text, n_prompt + 1)
    assert c.text.startswith(prompt)
    assert all(len(top) >= 1 for top in c.logprobs.top_logprobs[1:])


def test_completions_echo_max_tokens_zero_scores_the_prompt(client):
    prompt = "The capital of France is Paris"
    ids = _ids(client, prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=0, max_tokens=0, temperature=0)
    c = r.choices[0]
    assert c.text == prompt and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    _check_shape(c.logprobs, prompt, len(ids))
    # a prompt token's logprob is what the model gave it as the next token after the tokens before it
    head = ids[:-1]
    g = client.completions.create(model=MODEL, prompt=head, logprobs=5, max_tokens=1, temperature=0)
    tok = c.logprobs.tokens[-1]
    assert tok in g.choices[0].logprobs.top_logprobs[0]
    assert math.isclose(g.choices[0].logprobs.top_logprobs[0][tok], c.logprobs.token_logprobs[-1], abs_tol=2e-3)
    # again, with the prompt now in the prefix cache: the same numbers (cached blocks do not skip them)
    again = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=0, max_tokens=0)
    assert again.choices[0].logprobs.token_logprobs[1:] == pytest.approx(c.logprobs.token_logprobs[1:], abs=2e-3)


def test_completions_echo_scores_answers_like_lm_eval(client):
    """lm-evaluation-harness's loglikelihood: sum token_logprobs over the continuation's tokens."""
    ctx = "Question: What is the capital of France?\nAnswer:"
    scores = {}
    for answer in (" Paris", " Banana"):
        n_ctx = len(_ids(client, ctx))
        r = client.completions.create(model=MODEL, prompt=ctx + answer, echo=True, logprobs=1, max_tokens=0,
                                      temperature=0)
        cont = r.choices[0].logprobs.token_logprobs[n_ctx:]
        assert cont and all(x is not None for x in cont)
        scores[answer] = sum(cont)
    assert scores[" Paris"] > scores[" Banana"]


def test_completions_echo_streaming(client):
    prompt = "The capital of France is Paris"
    n_prompt = len(_ids(client, prompt))
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=3,
                                            temperature=0, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    lps = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert text.startswith(prompt) and "".join(tokens) == text
    assert len(tokens) == n_prompt + 3 and lps[0] is None


def test_completions_max_tokens_zero_needs_echo(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=0)


# ---------------------------------------------------------------- 4. a Responses message cut short


def test_responses_message_cut_by_max_output_tokens_is_incomplete(client):
    kw = dict(model=MODEL, input="Write a long story about a dragon.", max_output_tokens=4, temperature=0)
    r = client.responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    messages = [o for o in r.output if o.type == "message"]
    assert messages and all(m.status == "incomplete" for m in messages)
    assert messages[0].content[0].text  # what was written is kept
    events = list(client.responses.create(**kw, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "message"]
    assert done and done[-1].status == "incomplete"
    final = events[-1]
    assert final.type == "response.incomplete"
    assert [o.status for o in final.response.output if o.type == "message"] == ["incomplete"]
    full = client.responses.create(**{**kw, "max_output_tokens": 400, "input": "Say hi."})
    assert full.status == "completed" and all(o.status == "completed" for o in full.output)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


@pytest.mark.parametrize("parallel", [False, True])
def test_responses_function_call_cut_by_max_output_tokens_is_incomplete(client, parallel):
    """A forced call whose arguments max_output_tokens cuts is "incomplete" (as OpenAI marks the item being
    written), in the response, its stream's output_item.done and its response.incomplete; calls finished
    before the cut stay "completed". The budget that cuts inside the arguments is found by shrinking it."""
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY_PARAMS, "strict": False}]
    kw = dict(model=MODEL, input="What is the weather in Paris?", tools=tools, tool_choice="required",
              parallel_tool_calls=parallel, temperature=0)
    whole = client.responses.create(**kw, max_output_tokens=60)
    first = next(o for o in whole.output if o.type == "function_call")
    assert first.status == "completed" and _parses(first.arguments)
    n = whole.usage.output_tokens
    while True:  # the largest budget whose last call has unfinished arguments
        n -= 1
        assert n > 0, "no budget cut the arguments"
        r = client.responses.create(**kw, max_output_tokens=n)
        calls = [o for o in r.output if o.type == "function_call"]
        if calls and not _parses(calls[-1].arguments):
            break
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [c.status for c in calls] == ["completed"] * (len(calls) - 1) + ["incomplete"]
    assert calls[-1].name == "get_weather" and calls[-1].arguments
    events = list(client.responses.create(**kw, max_output_tokens=n, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.status, getattr(i, "arguments", None)) for i in done] == \
        [(o.type, o.status, getattr(o, "arguments", None)) for o in r.output]
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.status == "incomplete"
    assert [o.status for o in final.response.output] == [o.status for o in r.output]
