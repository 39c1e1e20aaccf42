"""Routed experts on a GGUF file's quantized expert blocks (fast; the whole model against transformers is in
tests/models/test_qwen3_moe_gguf.py).

- the stacked `ffn_{gate,up,down}_exps` tensors read as one [N, K] weight per expert whose values are the
  `gguf` package's own dequantization of the file;
- an expert with at most `max_rows()` tokens multiplies the blocks, more the dense weights, and the result
  equals the dense path up to summation order (the dense weights hold the blocks' values in the model dtype);
- a slot's blocks follow its dense weights through an EPLB re-placement (never stale); validation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from deepinfer.eplb.placement import Placement, initial_placement
from deepinfer.layers import gguf_kernels as gk
from deepinfer.layers.ep_moe import ExpertParallelExperts
from deepinfer.layers.moe import RoutedExperts
from tests.models.gguf_moe_tiny import TINY_QWEN3_MOE, write_qwen3_moe_gguf

pytestmark = pytest.mark.skipif(gk.load_library() is None, reason="needs x86-64 with AVX2 and gcc")

E, H, INTER = TINY_QWEN3_MOE["num_experts"], TINY_QWEN3_MOE["hidden_size"], TINY_QWEN3_MOE["moe_intermediate_size"]


@pytest.fixture(scope="module", params=["q8_0", "q4_1"])
def gguf_file(request, tmp_path_factory) -> Path:
    return write_qwen3_moe_gguf(tmp_path_factory.mktemp("moe_gguf") / f"tiny-{request.param}.gguf", request.param,
                                tokenizer=False)


def test_expert_blocks_are_the_files_values_per_expert(gguf_file):
    import gguf

    experts = gk.read_quantized_experts(gguf_file)
    assert sorted(experts) == sorted(f"blk.{b}.ffn_{p}_exps.weight" for b in range(2) for p in ("gate", "up", "down"))
    assert not any("_exps" in name for name in gk.read_quantized_tensors(gguf_file))  # 2-D tensors only there
    for t in gguf.GGUFReader(str(gguf_file)).tensors:
        if t.name not in experts:
            continue
        ref = torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type))  # [E, N, K]
        blocks = experts[t.name]
        assert len(blocks) == E and ref.shape[0] == E
        assert (blocks[0].n, blocks[0].k) == ((H, INTER) if "down" in t.name else (INTER, H))
        for e, w in enumerate(blocks):
            assert torch.equal(w.dequantize(), ref[e]), (t.name, e)


def _experts_from_file(path: Path, dtype: torch.dtype, layer: int = 0) -> RoutedExperts:
    """RoutedExperts whose dense weights are the file's values (in `dtype`) with the blocks attached."""
    blocks = gk.read_quantized_experts(path)
    gate, up, down = (blocks[f"blk.{layer}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
    ex = RoutedExperts(E, H, INTER).to(dtype)
    with torch.no_grad():
        for e in range(E):
            ex.expert_weight(e, "gate").copy_(gate[e].dequantize())
            ex.expert_weight(e, "up").copy_(up[e].dequantize())
            ex.expert_weight(e, "down").copy_(down[e].dequantize())
    assert ex.attach_expert_blocks(gate, up, down) == E
    return ex


def _routing(t: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """t tokens, top-2; expert 0 gets every token (past max_rows() once t > 8), the others a few each."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).to(dtype)
    other = torch.randint(1, E, (t,), generator=g)
    ids = torch.stack([torch.zeros(t, dtype=torch.long), other], dim=1)
    w = torch.rand(t, 2, generator=g).to(dtype)
    return x, ids, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_blocks_serve_small_experts_and_match_the_dense_path(gguf_file, dtype):
    ex = _experts_from_file(gguf_file, dtype)
    x, ids, w = _routing(20, 0, dtype)  # expert 0: 20 tokens (dense), experts 1-7: ~3 each (blocks)
    active = len(set(ids[:, 1].tolist()))
    fast = ex(x, ids, w)
    assert ex.quantized_calls == active  # every small expert used its blocks, expert 0 (20 > 8 rows) did not
    saved, ex.quantized = ex.quantized, [None] * E
    dense = ex(x, ids, w)
    ex.quantized = saved
    # only the summation order differs: fp32 to ~1e-5 relative; bf16 within bf16 rounding of each product
    err = ((fast.double() - dense.double()).abs().max() / dense.double().abs().max()).item()
    assert err < (1e-5 if dtype == torch.float32 else 8e-3), err
    # one expert alone: the kernel against the exact product with the dense weights' values
    xe = x[:5]
    h = ex.quantized[3][0].matmul(xe)
    ref = xe.double() @ ex.w13[3].double().T
    rel = ((h.double() - ref).abs().max() / ref.abs().max()).item()
    assert rel < (1e-5 if dtype == torch.float32 else 8e-3), rel


@torch.inference_mode()
def test_blocks_follow_their_expert_through_a_re_placement(gguf_file):
    ref = _experts_from_file(gguf_file, torch.float32)
    blocks = gk.read_quantized_experts(gguf_file)
    ep = ExpertParallelExperts(RoutedExperts(E, H, INTER), initial_placement(E, 1, 0), 0, None)
    with torch.no_grad():
        for e in range(E):
            for proj in ("gate", "up", "down"):
                ep.expert_weight(e, proj).copy_(ref.expert_weight(e, proj))
    ep.attach_expert_blocks(*(blocks[f"blk.0.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")))
    ep.apply_placement(Placement(E, 1, (7, 6, 5, 4, 3, 2, 1, 0)))  # every slot gets another expert
    assert ep.num_quantized == E
    for s in range(E):  # each slot's blocks are its new expert's, equal to its dense weights
        q13, q2 = ep.quantized[s]
        assert torch.equal(q13.dequantize(), ep.w13[s]) and torch.equal(q2.dequantize(), ep.w2[s])
    x, ids, w = _routing(6, 1, torch.float32)
    out = ep(x, ids, w)
    assert ep.quantized_calls > 0
    assert torch.allclose(out, ref(x, ids, w), rtol=1e-5, atol=1e-5)


def test_blocks_serialise_for_a_move_between_ranks(gguf_file):
    w = gk.read_quantized_experts(gguf_file)["blk.1.ffn_down_exps.weight"][5]
    buf = w.to_bytes()
    assert buf.dtype == torch.uint8 and buf.numel() == gk.QuantizedWeight.nbytes(w.kind, w.n, w.k)
    back = gk.QuantizedWeight.from_bytes(w.kind, w.n, w.k, buf.clone())
    assert torch.equal(back.dequantize(), w.dequantize())
    with pytest.raises(ValueError, match="bytes for a"):
        gk.QuantizedWeight.from_bytes(w.kind, w.n, w.k, buf[1:])


@pytest.mark.parametrize("blocks", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_row_invariant_experts_give_a_row_the_same_bits_in_any_batch(gguf_file, blocks, dtype):
    """--deterministic: every expert through the kernel (its blocks, or its dense weights as the kernel's
    dense kind) whatever its token count; a token's output alone equals its row in a batch of 20 where
    expert 0 has all 20 tokens (past max_rows()) and the router's logits as well."""
    from deepinfer.layers.moe import SoftmaxTopKRouter

    ex = _experts_from_file(gguf_file, dtype)
    if not blocks:
        ex.quantized = [None] * E
    ex.make_row_invariant()
    assert [q[0].kind == "dense" for q in ex.row_invariant] == [not blocks] * E
    x, ids, w = _routing(20, 3, dtype)
    batch = ex(x, ids, w)
    for t in (0, 7, 19):
        assert torch.equal(ex(x[t:t + 1], ids[t:t + 1], w[t:t + 1])[0], batch[t])
    router = SoftmaxTopKRouter(H, E, 2, True, False).to(dtype)
    with torch.no_grad():
        router.weight.normal_()
    router.make_row_invariant()
    (ids_b, w_b), (ids_1, w_1) = router(x), router(x[7:8])
    assert torch.equal(ids_b[7], ids_1[0]) and torch.equal(w_b[7], w_1[0])


def test_attach_validation(gguf_file):
    blocks = gk.read_quantized_experts(gguf_file)
    gate, up, down = (blocks[f"blk.0.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
    ex = RoutedExperts(E, H, INTER)
    with pytest.raises(ValueError, match="blocks"):
        ex.attach_quantized(0, gate[0], down[0])  # gate alone is [INTER, H], the slot's gate/up [2I, H]
    with pytest.raises(ValueError, match="together"):
        ex.attach_quantized(0, None, down[0])
    with pytest.raises(ValueError, match="experts"):
        ex.attach_expert_blocks(gate[:4], up[:4], down[:4])
    ex.attach_expert_blocks(gate, up, down)
    ex.attach_quantized(2, None, None)
    assert ex.num_quantized == E - 1 and ex.block_kinds == (gate[0].kind, down[0].kind)


def _same_blocks(a: gk.QuantizedWeight, b: gk.QuantizedWeight) -> bool:
    return (a.kind, a.n, a.k) == (b.kind, b.n, b.k) and torch.equal(a.qs, b.qs) and torch.equal(a.d, b.d) and (
        (a.mn is None and b.mn is None) or torch.equal(a.mn, b.mn))


def test_block_cache_returns_the_files_blocks_and_replaces_a_torn_or_damaged_one(gguf_file, tmp_path):
    parsed_tensors, parsed_experts = gk.read_quantized(gguf_file)
    cache = tmp_path / "blocks" / "blocks.bin"
    gk.read_quantized(gguf_file, cache)  # parses and writes the cache

    def check(got: gk.QuantizedTensors) -> None:
        tensors, experts = got
        assert sorted(tensors) == sorted(parsed_tensors) and sorted(experts) == sorted(parsed_experts)
        assert all(_same_blocks(tensors[n], parsed_tensors[n]) for n in tensors)
        assert all(len(experts[n]) == E and all(map(_same_blocks, experts[n], parsed_experts[n])) for n in experts)

    def tear(f, size):
        f.truncate(size // 2)

    def flip(f, size):  # one bit of the last tensor's data: without the digest, a wrong weight served
        f.seek(size - 5)
        b = f.read(1)
        f.seek(size - 5)
        f.write(bytes([b[0] ^ 0x10]))

    for damage in (None, tear, flip):
        if damage is not None:
            with open(cache, "r+b") as f:
                damage(f, cache.stat().st_size)
            assert gk._load_cached(cache) is None  # refused, not loaded
        check(gk.read_quantized(gguf_file, cache))  # from the cache, or parsed again and the cache rewritten
        cached = gk._load_cached(cache)
        assert cached is not None
        check(cached)


def test_block_cache_that_cannot_be_written_only_costs_the_parse(gguf_file, tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    cache = blocker / "blocks.bin"  # its parent is a file: mkdir fails
    tensors, experts = gk.read_quantized(gguf_file, cache)
    parsed_tensors, parsed_experts = gk.read_quantized(gguf_file)
    assert sorted(tensors) == sorted(parsed_tensors) and sorted(experts) == sorted(parsed_experts)
    assert all(_same_blocks(tensors[n], parsed_tensors[n]) for n in tensors)
    assert not cache.exists() and gk._load_cached(cache) is None
