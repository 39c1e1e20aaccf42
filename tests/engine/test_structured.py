"""Structured output and logit_bias in the engine, on a tiny random model: whatever the model
prefers, constrained output parses and validates; unconstrained neighbours are unaffected; preemption,
abort and compile failures leak nothing. Both host-overlap modes."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine.structured import StructuredOutputParams
from tests.models.test_models_vs_hf import _assert_all_free, _prompts

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 8}, "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
            "required": ["city", "zip"]},
        "active": {"type": "boolean"}},
        "required": ["name", "address", "active"]},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]},
        "mode": {"type": "string", "enum": ["fast", "slow"]}},
        "required": ["color", "size", "mode"]},
    "arrays": {"type": "object", "properties": {
        "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 1,
                "maxItems": 4},
        "points": {"type": "array", "items": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9,
                                                                        "maximum": 9}},
            "required": ["x", "y"]}, "maxItems": 3}},
        "required": ["ids", "points"]},
}
# fixed length (8 enum items) so that requests need a known number of blocks
LONG = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 8, "maxItems": 8}


def _llm(path, overlap: bool = False, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "64MiB")
    return LLM(str(path), dtype="float32", overlap_host_work="on" if overlap else "off", **kw)


def _json(schema: dict, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 120)
    return SamplingParams(structured_output=StructuredOutputParams(json_schema=schema), **kw)


@pytest.fixture(scope="module", params=[False, True], ids=["sequential", "overlap"])
def llm(request, tiny_models):
    return _llm(tiny_models["llama"], overlap=request.param)


def test_json_schemas_parse_and_validate(llm):
    prompts = ["Describe a person.", "hello", "x y z", "{"]
    for schema in SCHEMAS.values():
        params = [_json(schema, temperature=0.0), _json(schema, temperature=1.0, seed=1),
                  _json(schema, temperature=1.3, top_p=0.95, seed=2), _json(schema, temperature=0.8, n=2, seed=3)]
        for out in llm.generate(prompts, params):
            for c in out.outputs:
                assert c.finish_reason == "stop", c
                jsonschema.validate(json.loads(c.text), schema)
                assert c.token_ids[-1] in llm.engine.eos_token_ids  # ended by the grammar's stop token
    _assert_all_free(llm)


def test_regex_and_ebnf(llm):
    pattern = r"(?:[a-z]{2,5}-\d{1,3}|N/A)"
    outs = llm.generate(["a", "b", "c"], [SamplingParams(temperature=t, seed=i, max_tokens=30,
                                                         structured_output=StructuredOutputParams(regex=pattern))
                                          for i, t in enumerate((0.0, 1.0, 1.5))])
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    # min_tokens cannot stretch a grammar: the grammar's end wins over the EOS ban
    out = llm.generate("d", SamplingParams(temperature=0.0, max_tokens=30, min_tokens=20,
                                           structured_output=StructuredOutputParams(regex=pattern)))[0].outputs[0]
    assert out.finish_reason == "stop" and out.error is None and re.fullmatch(pattern, out.text)
    ebnf = 'root ::= "(" expr ")"\nexpr ::= num | num " + " num\nnum ::= [1-9] [0-9]?'
    outs = llm.generate(["sum", "two", "x"], SamplingParams(
        temperature=1.0, seed=4, max_tokens=30, structured_output=StructuredOutputParams(grammar=ebnf)))
    for out in outs:
        assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)?\)", out.outputs[0].text), out.outputs[0].text
    _assert_all_free(llm)


def test_choice_is_exactly_one_of_the_strings(llm):
    # quotes, a backslash, a newline and non-ASCII text must reach the grammar as themselves; "ab" / "abc" share
    # a prefix, so the grammar has to decide where an answer may end
    choices = ["ab", "abc", 'say "hi"', "back\\slash", "two\nlines", "é中文"]
    so = StructuredOutputParams(choice=choices)
    assert so.choice == tuple(choices) and so.kind == "choice"
    outs = llm.generate(["a", "b", "c", "d"], [SamplingParams(temperature=t, seed=i, n=3, max_tokens=20,
                                                              structured_output=so)
                                               for i, t in enumerate((0.0, 1.0, 1.5, 2.0))])
    seen = set()
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop" and c.text in choices, c.text
            seen.add(c.text)
    assert len(seen) > 1  # sampling at high temperature picks more than one
    _assert_all_free(llm)


def test_mixed_batch_leaves_unconstrained_requests_identical(tiny_models):
    free = _prompts(21, [7, 19, 33])
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for overlap in (False, True):
        llm = _llm(tiny_models["llama"], overlap)
        alone = [o.outputs[0].token_ids for o in llm.generate(free, greedy)]
        constrained = [_json(SCHEMAS["enums"], temperature=0.0), _json(SCHEMAS["arrays"], temperature=0.7, seed=9)]
        outs = llm.generate([*free, "p", "q"], [greedy] * 3 + constrained)
        assert [o.outputs[0].token_ids for o in outs[:3]] == alone
        for o, schema in zip(outs[3:], (SCHEMAS["enums"], SCHEMAS["arrays"]), strict=True):
            jsonschema.validate(json.loads(o.outputs[0].text), schema)
        _assert_all_free(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_neither_resets_nor_double_advances_the_matcher(tiny_models, overlap):
    path = tiny_models["llama"]
    prompts = _prompts(5, [30, 40, 35, 45])
    params = [_json(LONG, temperature=0.0, max_tokens=60), _json(LONG, temperature=1.0, seed=7, max_tokens=60)] * 2
    reference = [o.outputs[0].token_ids for o in _llm(path, overlap).generate(prompts, params)]
    per_block = _llm(path).engine.core.runner.kv_bytes_per_block
    # 10 blocks = 160 tokens; four requests of ~40 prompt + ~30 JSON tokens need ~20 blocks together
    llm = _llm(path, overlap, kv_cache_memory=str(10 * per_block), max_model_len=160)
    outs = llm.generate(prompts, params)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), LONG)
    _assert_all_free(llm)


def test_bad_grammar_fails_cleanly(tiny_models):
    llm = _llm(tiny_models["llama"])
    bad = StructuredOutputParams(json_schema={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    with pytest.raises(ValueError, match="json_schema"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=5), SamplingParams(structured_output=bad)])
    with pytest.raises(ValueError, match="regex"):
        llm.generate("a", SamplingParams(structured_output=StructuredOutputParams(regex="(unclosed")))
    # straight into the engine (no precheck): the request ends with the error, its neighbour runs on
    engine = llm.engine
    ok = engine.add_request("a", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    broken = engine.add_request("b", SamplingParams(structured_output=StructuredOutputParams(grammar="root ::= (")))
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final[broken].outputs[0].finish_reason == "abort"
    assert "invalid grammar" in final[broken].outputs[0].error
    assert final[broken].outputs[0].token_ids == []
    assert len(final[ok].outputs[0].token_ids) == 4 and final[ok].outputs[0].error is None
    _assert_all_free(llm)


def test_abort_frees_blocks_while_compiling_and_while_running(tiny_models):
    llm = _llm(tiny_models["llama"])
    engine = llm.engine
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 50}
    running = engine.add_request("x" * 50, _json(schema, temperature=1.0, max_tokens=200))
    req = engine.core.scheduler.requests[running]
    for _ in range(500):  # the first compile also builds the tokenizer tables: step until tokens flow
        engine.step()
        if req.num_output_tokens >= 3:
            break
    assert req.num_output_tokens >= 3 and not req.finished
    assert engine.core.kv.pool.num_free < engine.core.kv.pool.num_blocks
    # a fresh schema: aborted before (or while) its grammar compiles
    waiting = engine.add_request("y", _json({"type": "object", "properties": {"q": {"type": "string"}}}))
    engine.abort_request(running)
    engine.abort_request(waiting)
    assert not engine.has_unfinished() and not engine.core.has_unfinished()
    _assert_all_free(llm)


def test_compiled_grammars_are_cached_by_schema(tiny_models):
    llm = _llm(tiny_models["llama"])
    cache = llm.engine.grammars
    params = [_json(SCHEMAS["enums"], temperature=1.0, seed=i) for i in range(4)]
    llm.generate(["a", "b", "c", "d"], params)
    llm.generate("e", _json(dict(SCHEMAS["enums"]), temperature=0.0))  # an equal dict: same key
    assert cache.num_compiles == 1 and len(cache) == 1


def test_logit_bias_forces_and_bans(tiny_models):
    llm = _llm(tiny_models["llama"])
    prompts = _prompts(3, [5, 12])
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    forced = llm.generate(prompts, SamplingParams(temperature=1.0, seed=0, max_tokens=6, ignore_eos=True,
                                                  logit_bias={1234: 100}))
    assert all(o.outputs[0].token_ids == [1234] * 6 for o in forced)
    first = plain[0].outputs[0].token_ids[0]
    banned = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=1, logit_bias={first: -100}))
    assert banned[0].outputs[0].token_ids[0] != first
    # a bias cannot re-allow what a grammar forbids
    out = llm.generate("a", SamplingParams(temperature=0.0, max_tokens=30, logit_bias={1234: 100},
                                           structured_output=StructuredOutputParams(regex=r"[0-9]{3}")))
    assert re.fullmatch(r"[0-9]{3}", out[0].outputs[0].text)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate("a", SamplingParams(logit_bias={10**7: 1.0}))


def test_allowed_token_ids_restrict_every_token(tiny_models):
    llm = _llm(tiny_models["llama"])
    prompts = _prompts(3, [5, 12, 9])
    allowed = [7, 300, 1234, 4000]
    outs = llm.generate(prompts, [SamplingParams(temperature=t, seed=i, max_tokens=8, ignore_eos=True,
                                                 allowed_token_ids=allowed) for i, t in enumerate((0.0, 1.0, 2.0))])
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in outs), [o.outputs[0].token_ids for o in outs]
    # greedy picks the best allowed token: the raw logprobs (before the restriction) rank it above the others
    out = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=1, logprobs=20,
                                                  allowed_token_ids=allowed))[0].outputs[0]
    plain = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=1, logprobs=20))[0].outputs[0]
    assert out.token_ids[0] in allowed and (plain.token_ids[0] in allowed) == (plain.token_ids == out.token_ids)
    # one allowed token: every step takes it, whatever the model prefers
    assert llm.generate(prompts[1], SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True,
                                                   allowed_token_ids=[4000]))[0].outputs[0].token_ids == [4000] * 5
    with pytest.raises(ValueError, match="out of range"):
        llm.generate("a", SamplingParams(allowed_token_ids=[10**7]))
    _assert_all_free(llm)


def test_bad_words_ban_a_word_at_its_last_token(tiny_models):
    llm = _llm(tiny_models["llama"])
    prompt = _prompts(4, [9])[0]
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    ids = plain.token_ids
    # a two-token word: its first token still comes, the second never right after it (the word starts at the
    # first token that did not come before, so the output up to it cannot change)
    i = next(j for j in range(1, 8) if ids[j] not in ids[:j])
    word = ids[i:i + 2]
    two = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                bad_words_token_ids=[word]))[0].outputs[0].token_ids
    assert two[:i + 1] == ids[:i + 1] and two[i + 1] != ids[i + 1]
    assert all(two[j:j + 2] != word for j in range(len(two) - 1))
    one = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                bad_words_token_ids=[[ids[0]]]))[0].outputs[0].token_ids
    assert ids[0] not in one
    # as words: the engine spells them with its tokenizer, with and without a leading space
    tok = llm.get_tokenizer()
    word = tok.decode(ids[5:6]).strip()
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=12, ignore_eos=True, bad_words=[word])
    for c in llm.generate([prompt], params)[0].outputs:
        assert word not in c.text, (word, c.text)
    _assert_all_free(llm)


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one"),
    ({"regex": "a", "grammar": 'root ::= "a"'}, "exactly one"),
    ({"json_schema": "{not json"}, "not valid JSON"),
    ({"json_schema": "[1, 2]"}, "JSON object"),
    ({"regex": ""}, "non-empty"),
    ({"choice": []}, "non-empty list"),
    ({"choice": "yes"}, "non-empty list"),
    ({"choice": ["yes", ""]}, "non-empty string"),
    ({"choice": ["yes", 1]}, "non-empty string"),
    ({"choice": ["a"], "regex": "a"}, "exactly one"),
])
def test_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputParams(**kwargs)


@pytest.mark.parametrize("bias, match", [({"5": 1.0}, "token ids"), ({5: 101}, r"\[-100, 100\]"),
                                         ({-1: 0}, "token ids")])
def test_logit_bias_validation(bias, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(logit_bias=bias)
