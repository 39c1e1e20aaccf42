"""Speculative decoding with host work overlapped (`overlap_host_work="on"`): nothing is scheduled behind a
step that verifies drafts, steps without drafts still overlap; greedy output token-identical to the plain
engine (no speculation, no overlap), with chunked prefill, rejections (corrupted oracle) and stop strings;
no KV block leaked."""

from __future__ import annotations

import pytest

from deepinfer import LLM
from tests.engine.spec_utils import CorruptedOracle, assert_all_free, greedy, spec_config, token_ids

PROMPTS = [[5 + (i % 7) for i in range(40)], [100 + (i % 5) * 3 for i in range(23)],
           [7, 8, 9, 10, 11, 12] * 6 + [7, 8], list(range(300, 333))]


def _llm(path, spec: dict | None = None, **kw) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory="64MiB", profile_cost_model=False,
               speculative_config=spec, max_num_batched_tokens=16, **kw)


def _check(path, method: str, prompts, max_tokens: int) -> LLM:
    reference = token_ids(_llm(path), prompts, greedy(max_tokens))
    spec = spec_config("ngram", k=4, prompt_lookup_min=1)
    llm = _llm(path, spec, overlap_host_work="on")
    assert llm.engine.overlap
    if method == "oracle":
        llm.engine.core.speculator.proposer = CorruptedOracle(
            {tuple(p): r for p, r in zip(prompts, reference, strict=True)}, llm.engine.vocab_size, noise=0.3)
    assert token_ids(llm, prompts, greedy(max_tokens)) == reference
    m = llm.engine.core.speculator.metrics
    assert m.num_verifications > 0 and m.num_draft_tokens > m.num_accepted_tokens > 0
    assert llm.engine.core.num_steps_ahead > 0, "no step was scheduled ahead: nothing overlapped"
    assert_all_free(llm)
    return llm


def test_overlap_with_speculation_fast(tiny_models):
    _check(tiny_models["llama"], "oracle", PROMPTS[:2], 24)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["oracle", "ngram"])
def test_overlap_with_speculation(tiny_models, method):
    _check(tiny_models["llama"], method, PROMPTS, 40)


@pytest.mark.slow
def test_overlap_with_speculation_stop_strings(tiny_models):
    path = tiny_models["llama"]
    plain = _llm(path)
    text = plain.generate([PROMPTS[2]], greedy(40))[0].outputs[0].text
    needle = text[len(text) // 2:len(text) // 2 + 3]
    want = plain.generate([PROMPTS[2]], greedy(40, stop=[needle]))[0].outputs[0]
    llm = _llm(path, spec_config("ngram", k=4, prompt_lookup_min=1), overlap_host_work="on")
    got = llm.generate([PROMPTS[2]] * 3, greedy(40, stop=[needle]))
    for g in got:
        assert (g.outputs[0].text, list(g.outputs[0].token_ids), g.outputs[0].finish_reason) == \
            (want.text, list(want.token_ids), "stop")
    assert_all_free(llm)
