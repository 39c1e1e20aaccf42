"""Speculative decoding through the engine: greedy output token-identical with and without speculation,
for each proposer, across model families and KV kinds, with chunked prefill, prefix hits, preemption and
structured output; rejected positions' KV blocks are given back; stop conditions and max_tokens hold."""

from __future__ import annotations

import json

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine.structured import StructuredOutputParams
from tests.engine.spec_utils import CorruptedOracle, assert_all_free, greedy, spec_config, token_ids

# repetitive prompts, so the n-gram / suffix proposers find matches in them
PROMPTS = [[5 + (i % 7) for i in range(40)], [100 + (i % 5) * 3 for i in range(23)],
           [7, 8, 9, 10, 11, 12] * 6 + [7, 8], list(range(300, 333))]
METHODS = ["ngram", "suffix", "oracle"]


def _llm(path, spec: dict | None = None, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "64MiB")
    kw.setdefault("profile_cost_model", False)
    return LLM(str(path), dtype="float32", speculative_config=spec, **kw)


def _check_identical(path, method: str, prompts=PROMPTS, max_tokens: int = 40, params=None, adaptive: bool = False,
                     **kw) -> LLM:
    params = params or greedy(max_tokens)
    reference = token_ids(_llm(path, **kw), prompts, params)
    # single-token matches allowed: a random model's output rarely repeats a bigram of its prompt
    spec = spec_config("ngram" if method == "oracle" else method, k=5, adaptive=adaptive,
                       prompt_lookup_min=1, suffix_min_match=1)
    llm = _llm(path, spec, **kw)
    if method == "oracle":
        llm.engine.core.speculator.proposer = CorruptedOracle(
            {tuple(p): r for p, r in zip(prompts, reference, strict=True)}, llm.engine.vocab_size)
    assert token_ids(llm, prompts, params) == reference
    m = llm.engine.core.speculator.metrics
    assert m.num_verifications > 0, "nothing was verified: the test would prove nothing"
    assert_all_free(llm)
    return llm


def test_greedy_identical_fast(tiny_models):
    """The default suite's quick check: two prompts, drafts with rejections, chunked prefill."""
    _check_identical(tiny_models["llama"], "oracle", prompts=PROMPTS[:2], max_tokens=24, max_num_batched_tokens=16)


@pytest.mark.slow
def test_greedy_identical_with_allowed_and_bad_tokens_and_bias(tiny_models):
    """Drafts are verified against the processed distribution: only allowed tokens, with their biases, and no
    bad word (whose ban depends on the drafts before it)."""
    allowed = sorted({t for p in PROMPTS[:2] for t in p} | {1234, 2000})
    _check_identical(tiny_models["llama"], "oracle", prompts=PROMPTS[:2], params=greedy(
        20, allowed_token_ids=allowed, logit_bias={1234: 3.0, 7: -2.0}, bad_words_token_ids=[[5, 6], [2000]]))


@pytest.mark.parametrize("method", METHODS)
def test_greedy_identical_llama_chunked_prefill(tiny_models, method):
    llm = _check_identical(tiny_models["llama"], method, max_num_batched_tokens=16, block_size=16, adaptive=True)
    if method == "oracle":  # 30% noise: some drafts are kept, some rejected
        m = llm.engine.core.speculator.metrics
        assert 0 < m.num_accepted_tokens < m.num_draft_tokens


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen2_swa", "gemma3", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_identical_families(tiny_models, arch, method):
    # block 16 and a 12 / 10-token window: rollbacks cross block boundaries and windows drop blocks
    _check_identical(tiny_models[arch], method, max_num_batched_tokens=24)


@pytest.mark.slow
def test_greedy_identical_sliding_window_oracle(tiny_models):
    _check_identical(tiny_models["qwen2_swa"], "oracle", max_num_batched_tokens=24)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["suffix", "oracle"])
def test_prefix_hits_register_only_accepted_tokens(tiny_models, method):
    """A second run of the same prompts hits blocks that the first run's verification registered
    (prompt and output); the output must not change, and no block may hold a rejected draft's KV."""
    path = tiny_models["llama"]
    params = greedy(48)
    reference = token_ids(_llm(path), PROMPTS, params)
    llm = _llm(path, spec_config("ngram" if method == "oracle" else method, adaptive=False))
    if method == "oracle":
        llm.engine.core.speculator.proposer = CorruptedOracle(
            {tuple(p): r for p, r in zip(PROMPTS, reference, strict=True)}, llm.engine.vocab_size, noise=0.5)
    assert token_ids(llm, PROMPTS, params) == reference
    # prompt + output as new prompts: their blocks (computed under speculation) are hits now
    longer = [p + r[:40] for p, r in zip(PROMPTS, reference, strict=True)]
    plain = token_ids(_llm(path), longer, greedy(8))
    outs = llm.generate(longer, greedy(8))
    assert [list(o.outputs[0].token_ids) for o in outs] == plain
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert_all_free(llm)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "oracle"])
def test_preemption(tiny_models, method):
    path = tiny_models["llama"]
    per_block = _llm(path).engine.core.runner.kv_bytes_per_block
    llm = _check_identical(path, method, max_tokens=60, kv_cache_memory=str(12 * per_block), max_model_len=192)
    assert llm.engine.core.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_max_tokens_stop_tokens_and_stop_strings(tiny_models):
    path = tiny_models["llama"]
    ref_llm = _llm(path)
    reference = token_ids(ref_llm, PROMPTS, greedy(40))
    llm = _llm(path, spec_config("ngram", adaptive=False))
    llm.engine.core.speculator.proposer = CorruptedOracle(
        {tuple(p): r for p, r in zip(PROMPTS, reference, strict=True)}, llm.engine.vocab_size, noise=0.0)
    for n in (1, 2, 7, 13):  # never past max_tokens, whatever a step could emit
        assert token_ids(llm, PROMPTS, greedy(n)) == [r[:n] for r in reference]
    # a stop token inside a run of kept drafts ends the output there (the stop token is the last one)
    stop = reference[0][9]
    first = reference[0].index(stop)
    out = llm.generate([PROMPTS[0]], greedy(40, stop_token_ids=[stop]))[0].outputs[0]
    assert list(out.token_ids) == reference[0][:first + 1] and out.finish_reason == "stop"
    # stop strings: text and token ids cut where the plain engine cuts them
    text = ref_llm.generate([PROMPTS[2]], greedy(40))[0].outputs[0].text
    needle = text[len(text) // 2:len(text) // 2 + 3]
    want = ref_llm.generate([PROMPTS[2]], greedy(40, stop=[needle]))[0].outputs[0]
    got = llm.generate([PROMPTS[2]], greedy(40, stop=[needle]))[0].outputs[0]
    assert (got.text, list(got.token_ids), got.finish_reason) == (want.text, list(want.token_ids), "stop")
    assert_all_free(llm)


@pytest.mark.slow
def test_logprobs_per_emitted_token(tiny_models):
    path = tiny_models["llama"]
    params = greedy(30, logprobs=3)
    want = _llm(path).generate(PROMPTS, params)
    llm = _llm(path, spec_config("ngram", adaptive=False))
    llm.engine.core.speculator.proposer = CorruptedOracle(
        {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, want, strict=True)}, llm.engine.vocab_size)
    got = llm.generate(PROMPTS, params)
    for w, g in zip(want, got, strict=True):
        assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids)
        assert len(g.outputs[0].logprobs) == len(w.outputs[0].token_ids)
        for a, b in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            for t in a:
                assert b[t].logprob == pytest.approx(a[t].logprob, abs=1e-4) and b[t].rank == a[t].rank


@pytest.mark.slow
def test_structured_output(tiny_models):
    path = tiny_models["llama"]
    schema = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 6, "maxItems": 6}
    params = SamplingParams(max_tokens=80, temperature=0.0,
                            structured_output=StructuredOutputParams(json_schema=schema))
    prompts = PROMPTS[:3]
    reference = token_ids(_llm(path), prompts, params)
    for method in ("suffix", "oracle"):
        llm = _llm(path, spec_config("ngram" if method == "oracle" else method, adaptive=False))
        if method == "oracle":
            llm.engine.core.speculator.proposer = CorruptedOracle(
                {tuple(p): r for p, r in zip(prompts, reference, strict=True)}, llm.engine.vocab_size)
        outs = llm.generate(prompts, params)
        assert [list(o.outputs[0].token_ids) for o in outs] == reference
        for o in outs:
            assert len(json.loads(o.outputs[0].text)) == 6
        assert llm.engine.core.speculator.metrics.num_verifications > 0
        assert_all_free(llm)


@pytest.mark.slow
def test_per_request_metrics_and_engine_stats(tiny_models):
    llm = _llm(tiny_models["llama"], spec_config("suffix", adaptive=True))
    outs = llm.generate(PROMPTS, greedy(40))
    s = llm.engine.stats()
    assert s["spec_verifications"] > 0 and 0 <= s["spec_acceptance_rate"] <= 1
    assert sum(s[f"spec_k_chosen_{k}"] for k in range(6)) > 0
    m = [o.metrics for o in outs if "spec_draft_tokens" in o.metrics]
    assert m and sum(x["spec_accepted_tokens"] for x in m) == s["spec_accepted_tokens"]
    assert all(x["spec_mean_accepted_length"] >= 1 for x in m if x["spec_verifications"])
    # the server's /metrics renders them, labelled by proposer
    from deepinfer.server.metrics import ServerMetrics

    text = ServerMetrics(llm.engine.stats, "tiny").render().decode()
    assert f'deepinfer:spec_decode_num_accepted_tokens_total{{model_name="tiny",proposer="suffix"}} ' \
           f'{float(s["spec_accepted_tokens"])}' in text
    assert 'deepinfer:spec_decode_draft_length_bucket{le="+Inf",model_name="tiny",proposer="suffix"}' in text


def test_refusals(tiny_models):
    with pytest.raises(ValueError, match="needs a DeepSeek-V4 checkpoint"):
        _llm(tiny_models["llama"], {"method": "mtp", "num_speculative_tokens": 2})


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_identical_default_model(method):
    """The default model (SmolLM2-135M GGUF) on a code edit, where drafts are long and mostly kept. In
    `deterministic` mode: without it a plain decode runs the whole-layer C path and a verification chunk
    the dense path, whose float sums differ in the last bits, and near-ties of the 135M model's logits
    then flip (measured: the outputs part after ~30 tokens, with and without speculation alike a
    batch-shape effect); row-invariant kernels make a row's logits independent of the step's shape."""
    from benchmarks.spec import code_edit_prompt

    prompts = [code_edit_prompt(i) for i in range(3)]
    params = SamplingParams(max_tokens=64, temperature=0.0)
    reference = token_ids(LLM(kv_cache_memory="256MiB", profile_cost_model=False, deterministic=True), prompts, params)
    llm = LLM(kv_cache_memory="256MiB", profile_cost_model=False, deterministic=True,
              speculative_config=spec_config(method, k=6, adaptive=True))
    assert token_ids(llm, prompts, params) == reference
    m = llm.engine.core.speculator.metrics
    assert m.num_accepted_tokens > 0.3 * sum(len(r) for r in reference)  # drafts did most of the work
    assert_all_free(llm)
