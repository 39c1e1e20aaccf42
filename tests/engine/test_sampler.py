"""Sampler behaviour on synthetic logits (real Sampler, real Requests)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine import sampler as sampler_module
from deepinfer.engine.request import Request
from deepinfer.engine.sampler import Sampler
from deepinfer.engine.sampling_params import SamplingParams


def _req(params: SamplingParams, output: list[int] | None = None, prompt: list[int] | None = None,
         eos=frozenset()) -> Request:
    r = Request("r", prompt or [1, 2, 3], params, eos_token_ids=eos)
    r.token_ids.extend(output or [])
    return r


def test_greedy_and_top_k_one_agree():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    greedy = Sampler()(logits, [_req(SamplingParams(temperature=0))] * 4).token_ids
    topk1 = Sampler()(logits, [_req(SamplingParams(temperature=1.0, top_k=1))] * 4).token_ids
    assert greedy == topk1 == logits.argmax(-1).tolist()


def test_bfloat16_logits_give_the_float32_copys_tokens():
    """The runner hands over logits in the model's dtype: plain greedy rows take their argmax as they are,
    anything else (penalties, bias, min_tokens, logprobs, random rows) is widened first; every choice
    equals the one made from the float32 copy."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=gen).bfloat16()
    logits[1, 7] = logits[1, 250] = 9.0  # a tie: the first index, as from float32
    reqs = [_req(SamplingParams(temperature=0)) for _ in range(6)]
    greedy = Sampler()(logits, reqs).token_ids
    assert greedy == Sampler()(logits.float(), reqs).token_ids == logits.float().argmax(-1).tolist()
    def mixed() -> list[Request]:  # fresh requests per call: a seeded request's generator advances
        return [_req(SamplingParams(temperature=0)), _req(SamplingParams(temperature=0, presence_penalty=2.0), [5, 9]),
                _req(SamplingParams(temperature=0, logit_bias={11: 30.0})),
                _req(SamplingParams(temperature=0, logprobs=2)), _req(SamplingParams(temperature=0.7, seed=5)),
                _req(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4]))]

    a, b = Sampler(seed=2)(logits, mixed()), Sampler(seed=2)(logits.float(), mixed())
    assert a.token_ids == b.token_ids and a.token_ids[2] == 11
    assert a.logprobs[3].logprob == b.logprobs[3].logprob


def test_seeded_requests_reproduce_and_unseeded_rows_do_not_disturb_them():
    logits = torch.zeros(3, 1000)
    a = [Sampler(seed=1)(logits, [_req(SamplingParams(temperature=1, seed=42))]).token_ids[0] for _ in range(3)]
    r1 = _req(SamplingParams(temperature=1, seed=42))
    r2 = _req(SamplingParams(temperature=1, seed=42))
    seq1 = [Sampler(seed=1)(logits[:1], [r1]).token_ids[0] for _ in range(5)]
    seq2 = [Sampler(seed=99)(logits, [_req(SamplingParams(temperature=1)), r2,
                                     _req(SamplingParams(temperature=1))]).token_ids[1] for _ in range(5)]
    assert seq1 == seq2
    assert len(set(a)) == 1
    assert len(set(seq1)) > 1  # a uniform distribution over 1000 tokens


def test_top_p_keeps_the_nucleus_and_min_p_filters():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    s = Sampler(seed=3)
    seen = {s(logits, [_req(SamplingParams(temperature=1, top_p=0.7))]).token_ids[0] for _ in range(200)}
    assert seen == {0, 1}
    seen = {s(logits, [_req(SamplingParams(temperature=1, min_p=0.5))]).token_ids[0] for _ in range(200)}
    assert seen == {0, 1}  # 0.15 < 0.5 * 0.5
    seen = {s(logits, [_req(SamplingParams(temperature=1, top_k=3))]).token_ids[0] for _ in range(300)}
    assert seen == {0, 1, 2}


def _nucleus_by_full_sort(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """The reference: sort every row, keep rank < k and mass-before < top_p (the first always)."""
    out = torch.zeros_like(probs)
    for i in range(probs.shape[0]):
        sorted_p, order = probs[i].sort(descending=True)
        k = top_k[i] if top_k[i] > 0 else probs.shape[1]
        keep = ((torch.arange(len(sorted_p)) < k) & (sorted_p.cumsum(0) - sorted_p < top_p[i] * probs[i].sum()))
        keep[0] = True
        out[i, order[keep]] = sorted_p[keep]
    return out


def test_top_k_top_p_from_candidates_equals_a_full_sort():
    gen = torch.Generator().manual_seed(5)
    vocab = 3000
    # peaked rows (nucleus inside the 256 candidates) and flat rows (nucleus far wider), mixed
    scale = torch.tensor([8.0, 0.05, 4.0, 0.01, 8.0, 0.05]).unsqueeze(1)
    probs = torch.softmax(torch.randn(6, vocab, generator=gen) * scale, dim=-1)
    top_k = [0, 0, 50, 0, 1000, 0]
    top_p = [0.9, 0.95, 1.0, 0.5, 0.99, 1.0]  # the last row: no top-k / top-p (min-p only) keeps everything
    for rows in ([0, 2, 4], [0, 1, 2, 3, 4, 5], [0, 5]):  # nuclei within the candidates; some far wider
        sub = probs[rows]
        got = _dense(*sampler_module._top_k_top_p(sub, [top_k[i] for i in rows], [top_p[i] for i in rows]), vocab)
        want = _nucleus_by_full_sort(sub, [top_k[i] for i in rows], [top_p[i] for i in rows])
        assert torch.equal(got > 0, want > 0)
        torch.testing.assert_close(got, want)
    assert (want[1] > 0).sum() > sampler_module._TOP_CANDIDATES


def _dense(weights: torch.Tensor, ids: torch.Tensor | None, vocab: int) -> torch.Tensor:
    if ids is None:
        return weights
    return torch.zeros(weights.shape[0], vocab).scatter_(1, ids, weights)


@pytest.mark.parametrize("params", [dict(temperature=0.8), dict(temperature=1.3, top_p=0.9),
                                    dict(temperature=1.0, top_k=5, min_p=0.05)])
def test_random_rows_follow_the_filtered_distribution(params):
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(1, 40, generator=gen) * 2
    sp = SamplingParams(**params)
    probs = torch.softmax(logits / sp.temperature, dim=-1)
    probs = _dense(*sampler_module.Sampler._filter(probs, [_req(sp)]), 40)[0]
    probs = probs / probs.sum()
    batch = 4000
    sampler = Sampler(seed=2)
    counts = torch.zeros(40, dtype=torch.float64)
    for _ in range(5):
        tokens = sampler(logits.expand(batch, 40), [_req(sp)] * batch).token_ids
        counts += torch.bincount(torch.tensor(tokens), minlength=40).double()
    freq = counts / counts.sum()
    sigma = (probs.double() * (1 - probs.double()) / counts.sum()).sqrt()
    assert ((freq - probs.double()).abs() <= 5 * sigma + 1e-4).all()
    assert freq[probs == 0].sum() == 0


def test_penalties():
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.0]])
    assert Sampler()(logits, [_req(SamplingParams(temperature=0))]).token_ids == [0]
    # token 0 already generated twice: frequency penalty pushes it below token 1
    r = _req(SamplingParams(temperature=0, frequency_penalty=0.1), output=[0, 0])
    assert Sampler()(logits, [r]).token_ids == [1]
    r = _req(SamplingParams(temperature=0, presence_penalty=0.2), output=[0])
    assert Sampler()(logits, [r]).token_ids == [1]
    # repetition penalty applies to prompt tokens too (HF semantics: positive logits divided)
    r = _req(SamplingParams(temperature=0, repetition_penalty=1.2), prompt=[0])
    assert Sampler()(logits, [r]).token_ids == [1]


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.tensor([[5.0, 1.0, 4.0, 0.0]])
    r = _req(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2]), eos=frozenset({0}))
    assert Sampler()(logits, [r]).token_ids == [1]
    r.token_ids.extend([1, 1])  # min_tokens reached
    assert Sampler()(logits, [r]).token_ids == [0]


def test_logprobs_are_raw_and_ranked():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = Sampler()(logits, [_req(SamplingParams(temperature=0, logprobs=2, presence_penalty=2.0), output=[1])])
    lp = out.logprobs[0]
    ref = torch.log_softmax(logits[0], -1)
    assert out.token_ids == [2]  # the penalty moved the choice ...
    assert lp.logprob == pytest.approx(ref[2].item()) and lp.rank == 2  # ... but logprobs are raw
    assert [t for t, _ in lp.top] == [1, 2]


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                    dict(n=0), dict(max_tokens=0), dict(min_tokens=5, max_tokens=2),
                                    dict(logprobs=21), dict(presence_penalty=3), dict(repetition_penalty=0),
                                    dict(stop=[""]), dict(min_p=2)])
def test_invalid_params_raise_clear_errors(kwargs):
    with pytest.raises(ValueError, match="invalid sampling parameter"):
        SamplingParams(**kwargs)
