"""Speculative decoding keeps the target distribution when sampling: on a tiny random Llama with a
12-token vocabulary, 3000 sampled continuations per proposer are tested against the exact distribution
of the first three output tokens, computed with HF transformers from the same weights (chi-square goodness
of fit, alpha = 0.001 per test; cells with expected count < 5 pooled). Tokens 2 and 3 are the ones
speculation decides (token 1 comes from the prefill); requests run 4 tokens so the first decode may
verify up to 2 drafts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from deepinfer import LLM, SamplingParams
from tests.engine.spec_utils import spec_config

VOCAB = 12
N = 3000
ALPHA = 1e-3


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                      num_key_value_heads=1, num_hidden_layers=2, max_position_embeddings=128,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=VOCAB - 1, initializer_range=1.0)
    torch.manual_seed(7)
    model = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("small_vocab") / "llama12"
    model.save_pretrained(path)
    # the prompt repeats the model's own greedy continuation, so drafts copied from it are often likely
    with torch.no_grad():
        seq = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=9, do_sample=False, pad_token_id=0)[0].tolist()
    return path, model, seq + seq[:4]


def _exact(model, prefix: list[int], temperature: float) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([prefix])).logits[0, -1].double()
    return torch.softmax(logits / temperature, -1).numpy()


def _gof(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    expected = n * probs / probs.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert counts[probs == 0].sum() == 0
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def assert_first_three_tokens_follow(model, prompt: list[int], temperature: float, outs: list[list[int]]) -> None:
    """Chi-square goodness of fit (alpha `ALPHA`) of sampled continuations' token 1, pair (1, 2) and token 3
    against the exact distributions p(t1), p(t1, t2) and p(t3) computed from `model` (HF transformers)."""
    p1 = _exact(model, prompt, temperature)
    p2 = np.array([_exact(model, prompt + [a], temperature) for a in range(VOCAB)])  # [t1, t2]
    joint12 = p1[:, None] * p2
    p3 = np.zeros(VOCAB)
    for a, b in itertools.product(range(VOCAB), range(VOCAB)):
        if joint12[a, b] > 1e-4:
            p3 += joint12[a, b] * _exact(model, prompt + [a, b], temperature)
    p3 /= p3.sum()
    arr = np.array(outs)
    assert _gof(np.bincount(arr[:, 0], minlength=VOCAB), p1) > ALPHA
    assert _gof(np.bincount(arr[:, 0] * VOCAB + arr[:, 1], minlength=VOCAB * VOCAB), joint12.ravel()) > ALPHA
    assert _gof(np.bincount(arr[:, 2], minlength=VOCAB), p3) > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("method", ["none", "ngram", "suffix"])
def test_sampled_distribution_matches_target(small_vocab_model, method):
    path, model, prompt = small_vocab_model
    temperature = 0.8
    spec = None if method == "none" else spec_config(method, k=4, adaptive=False, prompt_lookup_min=1,
                                                       suffix_min_match=1, suffix_min_confidence=0.0)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="64MiB", profile_cost_model=False, max_num_seqs=256,
              enable_prefix_caching=False, speculative_config=spec)
    params = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True)
    outs = [list(o.outputs[0].token_ids)[:3] for o in llm.generate([prompt] * N, params)]
    if spec is not None:
        m = llm.engine.core.speculator.metrics
        assert m.num_draft_tokens > N and 0.05 * m.num_draft_tokens < m.num_accepted_tokens < m.num_draft_tokens
    assert_first_three_tokens_follow(model, prompt, temperature, outs)
