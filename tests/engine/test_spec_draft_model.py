"""The draft-model proposer: greedy output token-identical with and without speculation (a tiny random
draft for a tiny random target of the same vocabulary, a model drafting for itself, the default model
drafting for itself), the draft's KV given back, a clear error for a draft with another tokenizer, and
the token distribution with sampled drafts (rejection with min(1, p/q)) equal to the one without."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from deepinfer import LLM, SamplingParams
from deepinfer.engine.request import Request
from deepinfer.engine.sampler import Sampler
from deepinfer.engine.sampling_params import SamplingParams as Params
from deepinfer.engine.spec.verify import verify
from tests.conftest import TINY_ARCHS, _build_tiny
from tests.engine.spec_utils import assert_all_free, greedy, spec_config, token_ids
from tests.engine.test_spec_sampling import small_vocab_model  # noqa: F401 - a fixture used below

PROMPTS = [[5 + (i % 7) for i in range(40)], [100 + (i % 5) * 3 for i in range(23)], list(range(300, 333))]


@pytest.fixture(scope="module")
def draft_pair(tmp_path_factory, tokenizer_dir):
    """A tiny llama target and a smaller, differently seeded llama draft with the same tokenizer."""
    root = tmp_path_factory.mktemp("draft")
    target = _build_tiny("llama", root, tokenizer_dir)
    draft = _build_tiny("llama_draft", root, tokenizer_dir, dict(TINY_ARCHS["llama"], num_hidden_layers=1))
    return target, draft


def _llm(path, spec: dict | None = None, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "64MiB")
    kw.setdefault("profile_cost_model", False)
    return LLM(str(path), dtype="float32", speculative_config=spec, **kw)


def _assert_draft_free(llm: LLM) -> None:
    proposer = llm.engine.core.speculator.proposer
    assert not proposer.shadows
    for g in proposer.kv.groups:
        assert g.pool.num_used == 0, "a draft KV block leaked"


def test_greedy_identical_tiny_draft(draft_pair):
    """Random draft for a random target: mostly rejections (every rollback length), chunked prefill."""
    target, draft = draft_pair
    kw = dict(max_num_batched_tokens=16, block_size=16)
    reference = token_ids(_llm(target, **kw), PROMPTS[:2], greedy(20))
    llm = _llm(target, spec_config("draft_model", k=4, model=str(draft)), **kw)
    assert token_ids(llm, PROMPTS[:2], greedy(20)) == reference
    assert llm.engine.core.speculator.metrics.num_verifications > 0
    assert_all_free(llm)
    _assert_draft_free(llm)


@pytest.mark.slow
def test_greedy_self_draft_accepts_everything(draft_pair):
    """A model drafting for itself: every draft is the target's argmax, so all are kept (and the bonus
    token, which the draft never saw, is caught up at the next step)."""
    target, _ = draft_pair
    reference = token_ids(_llm(target), PROMPTS, greedy(30))
    llm = _llm(target, spec_config("draft_model", k=4, model=str(target)))
    assert token_ids(llm, PROMPTS, greedy(30)) == reference
    m = llm.engine.core.speculator.metrics
    assert m.num_draft_tokens > 0 and m.num_accepted_tokens == m.num_draft_tokens
    stats = llm.engine.core.speculator.stats()
    assert stats["spec_acceptance_rate"] == 1.0
    _assert_draft_free(llm)


@pytest.mark.slow
def test_greedy_default_model_self_draft():
    """SmolLM2-135M (GGUF) as target and draft: token-identical, acceptance 1.0."""
    from deepinfer.weights import resolve_model

    path = resolve_model(None).source
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8] * 3, list(range(300, 340))]
    reference = token_ids(_llm(path), prompts, greedy(24))
    llm = _llm(path, spec_config("draft_model", k=4, model=str(path)))
    assert token_ids(llm, prompts, greedy(24)) == reference
    assert llm.engine.core.speculator.stats()["spec_acceptance_rate"] == 1.0
    _assert_draft_free(llm)


def test_draft_with_another_tokenizer_is_refused(draft_pair, tmp_path):
    target, draft = draft_pair
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(draft))
    tok.add_tokens(["<not-in-the-target>"])
    other = tmp_path / "other"
    import shutil

    shutil.copytree(draft, other)
    tok.save_pretrained(other)
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        _llm(target, spec_config("draft_model", k=3, model=str(other)))
    with pytest.raises(ValueError, match='needs "model"'):
        _llm(target, spec_config("draft_model", k=3))


def test_rejection_with_draft_distribution_keeps_the_target_distribution():
    """Verification of drafts sampled from q (min(1, p/q), residual max(0, p - q)): chi-square goodness of
    fit (alpha = 0.001, n = 4000) of the first emitted token to p, for q close to p and q far from it."""
    torch.manual_seed(0)
    vocab = 6
    logits = torch.randn(2, vocab) * 1.5
    sampler = Sampler(seed=3)
    params = dict(temperature=1.0)
    p = sampler.target_probs(logits[:1], [Request("p", [0], Params(**params))])[0].double()
    gen = torch.Generator().manual_seed(5)
    n = 4000
    for q in (torch.softmax(logits[0] + 0.5 * torch.randn(vocab, generator=gen), 0),
              torch.softmax(-logits[0], 0)):
        items = []
        for i in range(n):
            r = Request(f"r{i}", [0], Params(**params))
            d = int(torch.multinomial(q, 1, generator=gen)[0])
            r.draft_probs = q.unsqueeze(0)
            items.append((r, 0, [d]))
        verdicts = verify(sampler, logits, items)
        first = np.array([(v.accepted + [v.token])[0] for v in verdicts])
        counts = np.bincount(first, minlength=vocab)
        assert chisquare(counts, n * p.numpy()).pvalue > 1e-3
        accepted = sum(bool(v.accepted) for v in verdicts)
        assert 0 < accepted < n  # both branches (kept, residual draw) were taken


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    """A 16-token target and draft (no tokenizer: token-id prompts), random and differently seeded."""
    import transformers

    root = tmp_path_factory.mktemp("vocab16")
    paths = []
    for name, layers, seed in (("target", 2, 7), ("draft", 1, 8)):
        cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                       num_key_value_heads=2, num_hidden_layers=layers, max_position_embeddings=256,
                                       initializer_range=0.3, tie_word_embeddings=False, bos_token_id=0,
                                       eos_token_id=1)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.save_pretrained(root / name)
        paths.append(root / name)
    return paths


@pytest.mark.slow
def test_sampled_drafts_keep_the_token_distribution(small_vocab_pair):
    """Temperature 1 with sampled drafts (q returned and used): the tokens at positions 2..4 (those that
    go through verification) have the same distribution with and without speculation. Two-sample
    chi-square (contingency) per position, alpha = 0.001, 3000 samples per arm, 16-token vocabulary."""
    target, draft = small_vocab_pair
    n = 3000
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    prompts = [[2, 3, 4, 5]] * n
    kw = dict(max_num_seqs=256, seed=11)
    plain = np.array(token_ids(_llm(target, **kw), prompts, params))
    llm = _llm(target, spec_config("draft_model", k=3, model=str(draft)), **kw)
    spec = np.array(token_ids(llm, prompts, params))
    m = llm.engine.core.speculator.metrics
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens  # q differs from p: both kept and rejected drafts
    for pos in range(1, 4):
        table = np.stack([np.bincount(plain[:, pos], minlength=16), np.bincount(spec[:, pos], minlength=16)])
        table = table[:, table.sum(0) > 0]
        assert chi2_contingency(table).pvalue > 1e-3, f"position {pos + 1}"
    _assert_draft_free(llm)


@pytest.mark.slow
def test_sampled_draft_model_matches_the_exact_target_distribution(small_vocab_model, tmp_path):  # noqa: F811
    """Against the exact distribution (HF transformers, same weights) as in test_spec_sampling.py: a
    differently seeded 12-token draft model samples its drafts (q handed over); 3000 continuations;
    chi-square goodness of fit, alpha = 0.001, of token 1, the pair (1, 2) and token 3."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.engine.test_spec_sampling import VOCAB, N, assert_first_three_tokens_follow

    path, model, prompt = small_vocab_model
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                      num_key_value_heads=1, num_hidden_layers=1, max_position_embeddings=128,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=VOCAB - 1, initializer_range=1.0)
    torch.manual_seed(8)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "draft12")
    temperature = 0.8
    llm = LLM(str(path), dtype="float32", kv_cache_memory="64MiB", profile_cost_model=False, max_num_seqs=256,
              enable_prefix_caching=False,
              speculative_config=spec_config("draft_model", k=3, model=str(tmp_path / "draft12")))
    params = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True)
    outs = [list(o.outputs[0].token_ids)[:3] for o in llm.generate([prompt] * N, params)]
    m = llm.engine.core.speculator.metrics
    assert m.num_draft_tokens > N and 0 < m.num_accepted_tokens < m.num_draft_tokens
    assert_first_three_tokens_follow(model, prompt, temperature, outs)
    _assert_draft_free(llm)
