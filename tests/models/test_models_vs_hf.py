"""Greedy output token-identical to HF transformers (float32) on tiny random Llama / Qwen2 / Qwen3."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLM, SamplingParams
from tests.conftest import TINY_ARCHS, hf_greedy

ARCHS = list(TINY_ARCHS)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts(seed: int, lengths: list[int], vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _llm(path, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "64MiB")
    return LLM(str(path), dtype="float32", **kw)


def _assert_all_free(llm: LLM) -> None:
    pool = llm.engine.core.kv.pool
    assert pool.num_free == pool.num_blocks
    assert all(c == 0 for c in pool.ref_counts)
    assert not llm.engine.core.kv.block_tables


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_different_lengths(arch, tiny_models, hf_models):
    prompts = _prompts(1, [1, 5, 16, 17, 40, 73])
    llm = _llm(tiny_models[arch])
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf_models[arch], p, 12)
        assert o.outputs[0].finish_reason == "length"
    _assert_all_free(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_prefix_served_from_cache(arch, tiny_models, hf_models):
    prefix = _prompts(2, [50])[0]
    tails = _prompts(3, [3, 9, 20])
    prompts = [prefix + t for t in tails]
    llm = _llm(tiny_models[arch])
    first = llm.generate([prompts[0]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf_models[arch], p, 12)
    # 50 shared tokens = 3 full blocks of 16; the first prompt's own tail blocks are cached too
    assert outs[0].num_cached_tokens == (len(prompts[0]) - 1) // 16 * 16
    assert outs[1].num_cached_tokens == 48 and outs[2].num_cached_tokens == 48
    again = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    _assert_all_free(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill(arch, tiny_models, hf_models):
    prompts = _prompts(4, [70, 33, 2])
    llm = _llm(tiny_models[arch], max_num_batched_tokens=16, enable_prefix_caching=False)
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf_models[arch], p, 12)
    assert llm.engine.core.num_steps > 70 // 16
    _assert_all_free(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_under_small_kv_pool(arch, tiny_models, hf_models):
    prompts = _prompts(5, [30, 40, 35, 45])
    probe = _llm(tiny_models[arch])
    per_block = probe.engine.core.runner.kv_bytes_per_block
    # 12 blocks = 192 tokens: four requests of ~40 + 20 tokens need ~16 blocks together
    llm = _llm(tiny_models[arch], kv_cache_memory=str(12 * per_block), max_model_len=192)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert llm.engine.core.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf_models[arch], p, 20)
    _assert_all_free(llm)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_n_greater_than_one_shares_prompt(arch, tiny_models, hf_models):
    prompt = _prompts(6, [37])[0]
    llm = _llm(tiny_models[arch])
    out = llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    expected = hf_greedy(hf_models[arch], prompt, 10)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == expected for c in out.outputs)
    # siblings were served the first sibling's full prompt blocks
    assert llm.engine.core.kv.prefix_hits >= 2 * 32
    sampled = llm.generate([prompt], SamplingParams(n=4, temperature=1.5, seed=7, max_tokens=10))[0]
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1
    _assert_all_free(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_match_hf(arch, tiny_models, hf_models):
    prompt = _prompts(7, [21])[0]
    llm = _llm(tiny_models[arch])
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5))[0]
    comp = out.outputs[0]
    full = torch.tensor([prompt + comp.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf_models[arch](full).logits[0].float(), dim=-1)
    for i, tok in enumerate(comp.token_ids):
        row = ref[len(prompt) - 1 + i]
        entry = comp.logprobs[i]
        assert entry[tok].rank == 1
        assert abs(entry[tok].logprob - row[tok].item()) < 1e-4
        top = row.topk(5)
        for tid, val in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert tid in entry and abs(entry[tid].logprob - val) < 1e-4
    assert comp.cumulative_logprob == pytest.approx(sum(comp.logprobs[i][t].logprob
                                                        for i, t in enumerate(comp.token_ids)))


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_next_token_distribution_close_to_reference(arch, tiny_models, hf_models):
    """bf16 (the CPU default where AVX-512 BF16 / AMX exist) is not token-identical to float32, but the
    distribution after a prefill and after decodes through the paged kernels must stay close to float32 HF."""
    prompts = _prompts(7, [5, 23, 40])
    llm = LLM(str(tiny_models[arch]), dtype="bfloat16", kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)
    for p, o in zip(prompts, llm.generate(prompts, params), strict=True):
        seq = p + o.outputs[0].token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf_models[arch](torch.tensor([seq])).logits[0].float(), -1)
        for i, (tok, lps) in enumerate(zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)):
            row = ref[len(p) - 1 + i]
            assert row.max() - row[tok] < 0.05, f"token {i}: ours is not (nearly) the reference's best"
            assert abs(lps[tok].logprob - row[tok].item()) < 0.05
    _assert_all_free(llm)
