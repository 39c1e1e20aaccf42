"""Speculative decoding with DeepSeek-V4's MTP layer through the engine, on a tiny random V4 of
sliding-window layers with an MTP layer (tests/models/v4_mtp_tiny.py): greedy output token-identical with
and without speculation, with prompts past the sliding window, chunked prefill and a small kept-streams
budget; the MTP window's blocks given back; clear errors for models without an MTP layer."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from tests.engine.spec_utils import assert_all_free, greedy, spec_config, token_ids
from tests.models.v4_mtp_tiny import build_v4_with_mtp

# window 6: every prompt but the last runs past it; chunked prefill at 8 tokens a step
PROMPTS = [[5 + (i % 7) for i in range(30)], [3, 4, 5] * 4, list(range(10, 60)), [7, 9]]


@pytest.fixture(scope="module")
def v4_mtp(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4mtp_engine") / "m"
    build_v4_with_mtp(path)
    return path


def _llm(path, spec: dict | None = None, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "16MiB")
    kw.setdefault("profile_cost_model", False)
    kw.setdefault("max_num_batched_tokens", 8)
    return LLM(str(path), dtype="float32", speculative_config=spec, **kw)


def _assert_mtp_free(llm: LLM) -> None:
    proposer = llm.engine.core.speculator.proposer
    assert not proposer.states
    for g in proposer.kv.groups:
        assert g.pool.num_used == 0, "an MTP window block leaked"


def _check_identical(path, k: int, prompts, max_tokens: int) -> LLM:
    reference = token_ids(_llm(path), prompts, greedy(max_tokens))
    llm = _llm(path, spec_config("mtp", k=k))
    assert token_ids(llm, prompts, greedy(max_tokens)) == reference
    m = llm.engine.core.speculator.metrics
    assert m.num_verifications > 0 and m.num_draft_tokens > 0
    stats = llm.engine.core.speculator.stats()  # what /metrics shows, labelled by proposer
    assert stats["spec_proposer"] == "mtp" and stats["spec_draft_tokens"] == m.num_draft_tokens
    assert_all_free(llm)
    _assert_mtp_free(llm)
    return llm


def test_greedy_identical_with_mtp_fast(v4_mtp):
    """The default suite's check: a prompt past the window with chunked prefill, and a short one."""
    _check_identical(v4_mtp, 3, PROMPTS[2:], 12)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_identical_with_mtp(v4_mtp, k):
    _check_identical(v4_mtp, k, PROMPTS, 24)


@pytest.mark.slow
def test_sampled_mtp_drafts_run(v4_mtp):
    """Temperature > 0: drafts are sampled from the MTP distribution and verified with min(1, p/q)."""
    llm = _llm(v4_mtp, spec_config("mtp", k=3))
    outs = token_ids(llm, PROMPTS, SamplingParams(max_tokens=16, temperature=0.8, ignore_eos=True, seed=1))
    assert all(len(o) == 16 for o in outs)
    assert llm.engine.core.speculator.metrics.num_draft_tokens > 0
    _assert_mtp_free(llm)


def test_mtp_needs_an_mtp_layer(v4_mtp, tiny_models):
    with pytest.raises(ValueError, match="needs a DeepSeek-V4 checkpoint"):
        _llm(tiny_models["llama"], spec_config("mtp", k=2), kv_cache_memory="64MiB")


def _direct_drafts(model, layer, tokens: list[int], k: int) -> list[int]:
    """The MTP chain computed directly: the target's streams over the whole sequence in one step, the MTP
    layer over every position at once, then chained k - 1 times (fresh caches, no proposer)."""
    import torch

    from deepinfer.layers.attention import AttentionBatch

    n = len(tokens)
    model.full_logits(torch.tensor(tokens[:-1]))
    streams = model.step_streams  # positions 0 .. n - 2
    bs = 4
    blocks = -(-(n + k) // bs) + 1
    cache = layer.allocate_cache(blocks, bs, torch.float32, torch.device("cpu"))
    table = list(range(blocks))

    def step(start: int, s, ids):
        q = s.shape[0]
        batch = AttentionBatch([q], [start + q], [table], int(q == 1), torch.zeros(0, dtype=torch.long), bs)
        pos = torch.arange(start, start + q)
        return layer(s, ids, pos, model, cache, layer.prepare(batch, pos.device))

    logits, out = step(0, streams, torch.tensor(tokens[1:]))
    drafts = [int(logits[-1].argmax())]
    for j in range(1, k):
        logits, out = step(n - 2 + j, out[-1:], torch.tensor([drafts[-1]]))
        drafts.append(int(logits[-1].argmax()))
    return drafts


@pytest.mark.slow
def test_mtp_proposer_drafts_equal_the_direct_chain(v4_mtp):
    """The proposer's drafts (kept streams, paged window, catch-up after verification, chained positions
    recomputed) equal the MTP chain computed directly from the full sequence, for every proposal made
    while the whole sequence's streams were still kept (no window floor)."""
    import torch

    k = 3
    llm = _llm(v4_mtp, spec_config("mtp", k=k))
    proposer = llm.engine.core.speculator.proposer
    log = []
    inner = proposer.propose_batch

    def recording(reqs, ks):
        out = inner(reqs, ks)
        log.extend((list(r.token_ids), list(d.token_ids)) for r, d in zip(reqs, out, strict=True) if len(d))
        return out

    proposer.propose_batch = recording
    token_ids(llm, PROMPTS[:2] + PROMPTS[3:], greedy(16))
    model = llm.engine.core.runner.model
    checked = 0
    with torch.inference_mode():
        for tokens, drafts in log:
            if len(tokens) + k <= proposer.keep:
                assert _direct_drafts(model, proposer.layer, tokens, len(drafts)) == drafts, tokens
                checked += 1
    assert checked >= 10


@pytest.mark.slow
def test_sampled_mtp_drafts_keep_the_token_distribution(v4_mtp):
    """Temperature 1 with drafts sampled from the MTP layer's q: the tokens at positions 2..4 have the
    same distribution with and without speculation. Two-sample chi-square (contingency) per position over
    the tokens seen at least 5 times in either arm (the rest pooled), alpha = 0.001, 2000 samples per arm,
    64-token vocabulary."""
    import numpy as np
    from scipy.stats import chi2_contingency

    n = 2000
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10]] * n
    kw = dict(max_num_seqs=256, max_num_batched_tokens=2048, seed=5)
    plain = np.array(token_ids(_llm(v4_mtp, **kw), prompts, params))
    llm = _llm(v4_mtp, spec_config("mtp", k=3), **kw)
    spec = np.array(token_ids(llm, prompts, params))
    m = llm.engine.core.speculator.metrics
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens
    vocab = llm.engine.vocab_size
    for pos in range(1, 4):
        table = np.stack([np.bincount(plain[:, pos], minlength=vocab), np.bincount(spec[:, pos], minlength=vocab)])
        big = table.max(0) >= 5
        table = np.concatenate([table[:, big], table[:, ~big].sum(1, keepdims=True)], axis=1)
        table = table[:, table.sum(0) > 0]
        assert chi2_contingency(table).pvalue > 1e-3, f"position {pos + 1}"
    _assert_mtp_free(llm)
