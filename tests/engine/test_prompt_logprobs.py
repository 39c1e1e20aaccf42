"""Prompt logprobs (completions `echo` + `logprobs`) are computed in row chunks: a long prompt's entries
equal the unchunked computation and HF transformers' log-softmax, with the prompt in one step or split over
several (chunked prefill), on the tiny float32 Llama."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLM, SamplingParams

K = 3
PARAMS = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=K)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(3, 49152) for _ in range(700)]


def _prompt_logprobs(path, prompt: list[int], chunk: int, **kw) -> list:
    llm = LLM(str(path), dtype="float32", kv_cache_memory="64MiB", **kw)
    llm.engine.core.runner.prompt_logprobs_chunk = chunk
    out = llm.generate([prompt], PARAMS)[0].prompt_logprobs
    assert len(out) == len(prompt) and out[0] is None
    return [{t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in out[1:]]


def test_chunked_equals_unchunked(tiny_models, prompt):
    """700 rows in chunks of 64 (the last one partial) against all of them at once."""
    whole = _prompt_logprobs(tiny_models["llama"], prompt, 10**9)
    chunked = _prompt_logprobs(tiny_models["llama"], prompt, 64)
    assert [e.keys() for e in chunked] == [e.keys() for e in whole]
    for a, b in zip(chunked, whole, strict=True):
        for t in a:
            assert a[t][1] == b[t][1] and a[t][0] == pytest.approx(b[t][0], abs=1e-5)


@pytest.mark.parametrize("step_tokens", [2048, 96])
def test_chunked_matches_hf(tiny_models, hf_models, prompt, step_tokens):
    """Against HF's log-softmax: each prompt token's logprob and the K most likely tokens there (ranks are
    left out: among 49,152 random logits, float noise moves a middling token's rank). 96-token steps: the
    prompt's rows come over several steps, each split into chunks of 40."""
    got = _prompt_logprobs(tiny_models["llama"], prompt, 40, max_num_batched_tokens=step_tokens)
    with torch.no_grad():
        logits = hf_models["llama"](torch.tensor([prompt])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    top_vals, top_ids = ref.topk(K, dim=-1)
    for i, entry in enumerate(got):  # entry i: prompt token i + 1, from row i
        target = prompt[i + 1]
        assert entry[target][0] == pytest.approx(ref[i, target].item(), abs=1e-4)
        for t, v in zip(top_ids[i].tolist(), top_vals[i].tolist(), strict=True):
            assert entry[t][0] == pytest.approx(v, abs=1e-4)
