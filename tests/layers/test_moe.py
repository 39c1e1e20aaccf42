"""layers/moe.py: the grouped expert compute against a naive per-token loop, routing numerics against
transformers' routers, empty experts, ties, and experts held elsewhere (the expert-parallel seam)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.layers.moe import RoutedExperts, SoftmaxTopKRouter, softmax_topk


def _experts(e=6, hidden=32, inter=24, seed=0, **kw) -> RoutedExperts:
    torch.manual_seed(seed)
    ex = RoutedExperts(e, hidden, inter, **kw)
    with torch.no_grad():
        ex.w13.normal_(0, 0.2)
        ex.w2.normal_(0, 0.2)
    return ex


def _naive(ex: RoutedExperts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One token, one expert at a time (global ids; experts not held contribute nothing)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e not in ex.local_experts:
                continue
            s = ex.local_experts.index(e)
            gate, up = F.linear(x[t:t + 1], ex.w13[s]).chunk(2, dim=-1)
            if ex.swiglu_limit is not None:
                gate, up = gate.clamp(max=ex.swiglu_limit), up.clamp(-ex.swiglu_limit, ex.swiglu_limit)
            out[t] += (F.linear(F.silu(gate) * up, ex.w2[s]) * w[t, j])[0].to(x.dtype)
    return out


@pytest.mark.parametrize("limit", [None, 0.5])
def test_grouped_equals_naive_per_token(limit):
    ex = _experts(swiglu_limit=limit)
    x = torch.randn(29, 32)
    ids, w = softmax_topk(torch.randn(29, 6), 3, True, torch.float32)
    torch.testing.assert_close(ex(x, ids, w), _naive(ex, x, ids, w), rtol=1e-5, atol=1e-6)


def test_empty_experts_and_empty_batch():
    ex = _experts()
    x = torch.randn(5, 32)
    ids = torch.tensor([[1, 4]] * 5)  # experts 0, 2, 3, 5 get no tokens
    w = torch.rand(5, 2)
    groups = ex.group(ids, w)
    assert groups.counts == [0, 5, 0, 0, 5, 0]
    assert groups.tokens.tolist() == list(range(5)) * 2  # each expert's tokens in token order
    torch.testing.assert_close(ex(x, ids, w), _naive(ex, x, ids, w), rtol=1e-5, atol=1e-6)
    empty = ex(torch.zeros(0, 32), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert empty.shape == (0, 32)


def test_local_experts_slices_sum_to_the_whole():
    """Two modules holding complementary expert slices (two expert-parallel ranks) add up to the whole."""
    full = _experts()
    lo, hi = RoutedExperts(6, 32, 24, local_experts=[0, 1, 2]), RoutedExperts(6, 32, 24, local_experts=[3, 4, 5])
    for part in (lo, hi):
        for e in part.local_experts:
            for proj in ("gate", "up", "down"):
                with torch.no_grad():
                    part.expert_weight(e, proj).copy_(full.expert_weight(e, proj))
    assert lo.expert_weight(4, "gate") is None and hi.expert_weight(0, "down") is None
    x = torch.randn(17, 32)
    ids, w = softmax_topk(torch.randn(17, 6), 2, True, torch.float32)
    torch.testing.assert_close(lo(x, ids, w) + hi(x, ids, w), full(x, ids, w), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lo(x, ids, w), _naive(lo, x, ids, w), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="ascending"):
        RoutedExperts(6, 32, 24, local_experts=[3, 1])


def test_topk_ties_are_a_function_of_the_row():
    """Tied probabilities (bf16 logits tie often) pick the experts torch.topk picks, as transformers does:
    the same row picks the same experts in any batch, at any thread count, and the tied weights are equal."""
    torch.manual_seed(5)
    rows = (torch.randn(48, 64) * 2).round() / 2  # many exact ties per row
    rows[0] = 0.0
    rows[0, ::3] = 1.0  # 22 tied maxima
    ids, w = softmax_topk(rows, 4, True, torch.float32)
    assert len(set(ids[0].tolist())) == 4 and all(i % 3 == 0 for i in ids[0].tolist())
    assert torch.equal(w[0], torch.full((4,), 0.25))
    assert torch.equal(ids, torch.topk(torch.softmax(rows, -1, dtype=torch.float32), 4).indices)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for i in (0, 7, 47):
                assert torch.equal(softmax_topk(rows[i:i + 1], 4, True, torch.float32)[0][0], ids[i])
            batch = torch.cat([torch.randn(40, 64), rows, torch.randn(7, 64)])
            assert torch.equal(softmax_topk(batch, 4, True, torch.float32)[0][40:88], ids)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_matches_transformers(family, dtype):
    """Ids, weights and their dtype equal transformers' routers' (Qwen3-MoE: weights in the model dtype,
    optionally not renormalised; Mixtral: float32 weights, always renormalised)."""
    import transformers

    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(hidden_size=48, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False)
        ref = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(cfg)
        ours = SoftmaxTopKRouter(48, 16, 4, renormalize=False, float32_weights=False)
    else:
        cfg = transformers.MixtralConfig(hidden_size=48, num_local_experts=16, num_experts_per_tok=4)
        ref = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(cfg)
        ours = SoftmaxTopKRouter(48, 16, 4, renormalize=True, float32_weights=True)
    torch.manual_seed(3)
    with torch.no_grad():
        ref.weight.normal_(0, 0.3)
        ours.weight.copy_(ref.weight)
    ref, ours = ref.to(dtype), ours.to(dtype)
    x = torch.randn(64, 48).to(dtype)
    _, ref_w, ref_ids = ref(x)
    ids, w = ours(x)
    assert torch.equal(ids, ref_ids)
    assert w.dtype == ref_w.dtype and torch.equal(w, ref_w)


def test_grouped_equals_transformers_experts():
    """The expert compute against transformers' Qwen3MoeExperts on the same weights and routing."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(hidden_size=32, num_experts=6, moe_intermediate_size=24)
    ref = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(cfg)
    ex = _experts()
    with torch.no_grad():
        ref.gate_up_proj.copy_(ex.w13)
        ref.down_proj.copy_(ex.w2)
    x = torch.randn(33, 32)
    ids, w = softmax_topk(torch.randn(33, 6), 2, True, torch.float32)
    torch.testing.assert_close(ex(x, ids, w), ref(x, ids, w), rtol=1e-6, atol=1e-6)
