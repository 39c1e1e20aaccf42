"""GGUF block kernels: exact weight values, numerics against float32, and engine output against the float32 path."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from deepinfer import LLM, SamplingParams
from deepinfer.layers import gguf_kernels as gk
from deepinfer.weights import default_model_path, resolve_model

pytestmark = pytest.mark.skipif(gk.load_library() is None, reason="needs x86-64 with AVX2 and gcc")


@pytest.fixture(scope="module")
def blocks():
    return gk.read_quantized_tensors(default_model_path())


def test_blocks_equal_the_dequantized_checkpoint(blocks):
    sd = load_file(str(resolve_model(None).safetensors_files()[0]))
    q = blocks["blk.3.attn_q.weight"].permute_rows(gk.llama_unpermute_order(576, 9))
    k = blocks["blk.3.attn_k.weight"].permute_rows(gk.llama_unpermute_order(192, 3))
    assert torch.equal(q.dequantize(), sd["model.layers.3.self_attn.q_proj.weight"])
    assert torch.equal(k.dequantize(), sd["model.layers.3.self_attn.k_proj.weight"])
    assert torch.equal(blocks["blk.3.ffn_down.weight"].dequantize(), sd["model.layers.3.mlp.down_proj.weight"])
    assert torch.equal(blocks["token_embd.weight"].dequantize(), sd["model.embed_tokens.weight"])


@pytest.mark.parametrize("name", ["blk.0.ffn_up.weight", "blk.0.ffn_down.weight", "token_embd.weight"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_kernel_matches_float32_matmul(blocks, name, rows):
    w = blocks[name]
    x = torch.randn(rows, w.k, generator=torch.Generator().manual_seed(rows))
    ref = x.double() @ w.dequantize().double().T
    out = w.matmul(x)
    assert out.shape == (rows, w.n)
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


@pytest.mark.parametrize("name", ["blk.0.ffn_up.weight", "token_embd.weight"])
def test_kernel_takes_and_returns_bfloat16(blocks, name):
    w = blocks[name]
    x = torch.randn(4, w.k, generator=torch.Generator().manual_seed(0)).bfloat16()
    out = w.matmul(x)
    assert out.dtype == torch.bfloat16 and out.shape == (4, w.n)
    ref = (x.double() @ w.dequantize().double().T)
    # exact products of the bf16 inputs, then one rounding to bf16 (relative 2^-8)
    assert ((out.double() - ref).abs() / ref.abs().clamp_min(1e-3)).median().item() < 4e-3


def _odd_shaped(kind: str, n: int, nb: int, seed: int) -> gk.QuantizedWeight:
    """Random blocks of an odd block count and feature count: the kernels' odd-block and thread-split tails."""
    g = torch.Generator().manual_seed(seed)
    width = 16 if kind == "q4_1" else 32
    qs = torch.randint(0, 256, (n, nb * width), dtype=torch.uint8, generator=g)
    d = torch.rand(n, nb, generator=g) * 0.05
    mn = -torch.rand(n, nb, generator=g) * 0.4 if kind == "q4_1" else None
    return gk.QuantizedWeight(kind, qs, d, mn, n, nb * gk.QK)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_count_gives_each_row_the_bits_of_a_single_row_call(blocks, dtype):
    """Speculative verification and --deterministic rely on a row's result not depending on how many rows
    share the call (1..16 rows: one and two passes of max_rows()): every row of an M-row call must equal
    the same row multiplied alone, bit for bit, and the float64 product within the tolerances above."""
    embd = blocks["token_embd.weight"]
    weights = {
        "q4_1": blocks["blk.0.ffn_up.weight"], "q4_1_wide_k": blocks["blk.0.ffn_down.weight"],
        "q8_0": gk.QuantizedWeight("q8_0", embd.qs[:2051], embd.d[:2051], None, 2051, embd.k),
        "q4_1_odd": _odd_shaped("q4_1", 37, 5, 0), "q8_0_odd": _odd_shaped("q8_0", 37, 5, 1),
        "dense": gk.QuantizedWeight.dense(torch.randn(45, 160, generator=torch.Generator().manual_seed(2)).to(dtype)),
    }
    for name, w in weights.items():
        x = torch.randn(16, w.k, generator=torch.Generator().manual_seed(3)).to(dtype)
        alone = torch.cat([w.matmul(x[i:i + 1]) for i in range(16)])
        ref = x.double() @ w.dequantize().double().T
        if dtype == torch.float32:
            assert ((alone.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5, name
        else:
            assert ((alone.double() - ref).abs() / ref.abs().clamp_min(1e-3)).median().item() < 4e-3, name
        for rows in range(2, 17):
            out = w.matmul(x[:rows])
            bad = (out != alone[:rows]).any(dim=1).nonzero().flatten().tolist()
            assert not bad, f"{name}: rows {bad} of a {rows}-row call differ from the same rows alone"



@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("nb", [1, 2, 3, 4, 7, 8, 9, 12, 16, 17, 18])
def test_block_and_feature_tails(kind, nb):
    """The float32 kernels' tails: an odd last block (AVX2: two accumulator chains), a short last quad of
    1-3 blocks and an odd count of quads (AVX-512: four blocks per load, quads alternating between two
    chains), block counts around the 8 (AVX2) or 16 (AVX-512) blocks per lane of Q4_1's offset sum
    (masked remainder), and feature counts that leave a group of features short (the one-row kernel's
    pairs, AVX-512's 16 / rows features per reduction); each row count matches float64 and a single
    row's bits."""
    for n in (1, 2, 3, 9):
        w = _odd_shaped(kind, n, nb, 10 * nb + n)
        x = torch.randn(9, w.k, generator=torch.Generator().manual_seed(nb))
        alone = torch.cat([w.matmul(x[i:i + 1]) for i in range(9)])
        ref = x.double() @ w.dequantize().double().T
        assert ((alone.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5, (n, nb)
        for rows in range(2, 10):
            assert torch.equal(w.matmul(x[:rows]), alone[:rows]), (n, nb, rows)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("nb", [1, 2, 3, 17, 18])
def test_bf16_block_pairs_and_a_lone_last_block_give_the_dense_copys_bits(kind, nb):
    """bfloat16 activations: blocks go through in pairs (one shared lookup table, x permuted to match) and an
    odd K / 32 leaves a last block alone. Every row count must give each row the bits of a single-row call
    and of the weight's dense bf16 copy (what the whole-layer C path multiplies past max_rows() rows), and
    stay near the float64 product of the bf16-rounded weights."""
    for n in (1, 2, 9):
        w = _odd_shaped(kind, n, nb, 7 * nb + n)
        dense = gk.QuantizedWeight.dense(w.dequantize().bfloat16())
        x = torch.randn(9, w.k, generator=torch.Generator().manual_seed(nb)).bfloat16()
        alone = torch.cat([w.matmul(x[i:i + 1]) for i in range(9)])
        ref = x.double() @ dense.dequantize().double().T
        assert ((alone.double() - ref).abs() / ref.abs().clamp_min(1e-2)).max().item() < 1e-2, (n, nb)
        for rows in range(1, 10):
            assert torch.equal(w.matmul(x[:rows]), alone[:rows]), (n, nb, rows)
            assert torch.equal(dense.matmul(x[:rows]), alone[:rows]), (n, nb, rows)


@pytest.mark.skipif(not getattr(gk.load_library(), "gguf_rows_take_fmas", lambda: 0)(),
                    reason="bf16 rows take VDPBF16PS itself on this CPU (its results are not two FMAs')")
def test_rows_on_two_fmas_keep_vdpbf16ps_bits_down_to_denormals():
    """On CPUs whose VDPBF16PS is two FMAs (odd pair member first, DAZ / FTZ), bf16 calls of 2-8 rows compute their
    products that way (faster there) while one row keeps VDPBF16PS: every row of a multi-row call must still have
    the bits of the same row alone, also where x, the weights and the sums reach the denormal range (the FMAs run
    with the denormal flags set; unset, most such outputs would differ), and the process's flags are left as
    they were."""
    n, nb = 40, 6
    w = _odd_shaped("q4_1", n, nb, 3)
    g = torch.Generator().manual_seed(4)
    scale = torch.tensor([1.0, 1e-36, 1e-38, 3e-39, 1e-39, 1e-30, 1e-37, 2.0])
    x = (torch.randn(8, w.k, generator=g) * scale[:, None]).bfloat16()
    x[:, ::7] = torch.tensor(1e-39).bfloat16()  # bf16 denormals beside normal values
    alone = torch.cat([w.matmul(x[i:i + 1]) for i in range(8)])
    assert (alone.view(torch.int16) != 0).any()
    for rows in range(2, 9):
        assert torch.equal(w.matmul(x[:rows]).view(torch.int16), alone[:rows].view(torch.int16)), rows
    # a float32 denormal product still comes out denormal here: the flags were restored after the calls
    tiny = torch.tensor([1e-20], dtype=torch.float32)
    assert (tiny * tiny).item() != 0.0


def _amx_library():
    lib = gk.load_library()
    return lib if lib is not None and hasattr(lib, "gguf_amx_gemm") and lib.amx_tiles_granted() else None


@pytest.mark.skipif(_amx_library() is None, reason="needs AMX tiles (the kernel exists only in AMX builds)")
@pytest.mark.parametrize("rows", [9, 16, 17, 40, 64, 100])
def test_blocks_on_amx_tiles_give_the_dense_panels_bits(blocks, rows):
    """gguf_amx_gemm(_silu): GGUF blocks dequantized into the core's cache and multiplied as A tiles against x^T must
    give every output the bits of the AMX panels of the dense bf16 copy (panel_gemm_bf16(_silu), what a batch of more
    than max_rows() rows took before): Q4_1 (a layer's gate/up, its SiLU*mul fused as the panels fuse it; its
    down projection, K = 1536) and Q8_0 (LM head rows), row counts off and on the tiles' 16, an odd number of
    16-row groups; and stay near the float64 product."""
    from deepinfer.layers.linear import pack_panels

    lib = _amx_library()
    embd = blocks["token_embd.weight"]
    gate_up = gk.QuantizedWeight.concat([blocks["blk.2.ffn_gate.weight"], blocks["blk.2.ffn_up.weight"]])
    cases = {"gate_up": gate_up, "down": blocks["blk.2.ffn_down.weight"],
             "q8_0": gk.QuantizedWeight("q8_0", embd.qs[:1056], embd.d[:1056], None, 1056, embd.k)}
    for name, w in cases.items():
        dense = w.dequantize().bfloat16()
        panels = pack_panels(dense)
        x = (torch.randn(rows, w.k, generator=torch.Generator().manual_seed(rows)) * 0.5).bfloat16()
        mn = w.mn.data_ptr() if w.mn is not None else None
        y, ref = torch.empty(rows, w.n, dtype=torch.bfloat16), torch.empty(rows, w.n, dtype=torch.bfloat16)
        assert lib.gguf_amx_gemm(x.data_ptr(), rows, w.k, gk.KIND_CODES[w.kind], w.qs.data_ptr(), w.d.data_ptr(), mn,
                                 y.data_ptr(), w.n) == 1
        assert lib.panel_gemm_bf16(x.data_ptr(), rows, w.k, panels.data_ptr(), None, ref.data_ptr(), w.n, 0) == 1
        assert torch.equal(y.view(torch.int16), ref.view(torch.int16)), (name, rows)
        exact = x.double() @ dense.double().T
        assert ((y.double() - exact).abs() / exact.abs().clamp_min(1e-1)).max().item() < 2e-2, (name, rows)
        if name == "gate_up":
            inter = w.n // 2
            act, act_ref = torch.empty(rows, inter, dtype=torch.bfloat16), torch.empty(rows, inter, dtype=torch.bfloat16)
            assert lib.gguf_amx_gemm_silu(x.data_ptr(), rows, w.k, gk.KIND_CODES[w.kind], w.qs.data_ptr(), w.d.data_ptr(), mn,
                                          act.data_ptr(), inter) == 1
            assert lib.panel_gemm_bf16_silu(x.data_ptr(), rows, w.k, panels.data_ptr(), act_ref.data_ptr(), inter) == 1
            assert torch.equal(act.view(torch.int16), act_ref.view(torch.int16)), rows


@pytest.mark.skipif(_amx_library() is None, reason="needs AMX tiles (the kernel exists only in AMX builds)")
def test_a_gate_up_linear_takes_the_blocks_past_max_rows_with_the_panels_bits(blocks):
    """Linear.silu_mul_into on an AMX CPU: a bf16 batch of more than max_rows() rows of a gate/up projection with GGUF
    blocks takes gguf_amx_gemm_silu, whose output is what forward() followed by silu_mul gives; at max_rows() rows
    and below (the blocks' vector kernel serves forward) and for float32 it declines."""
    from deepinfer.layers.activation import silu_and_mul
    from deepinfer.layers.linear import Linear

    w = gk.QuantizedWeight.concat([blocks["blk.5.ffn_gate.weight"], blocks["blk.5.ffn_up.weight"]])
    lin = Linear(w.k, w.n, bias=False)
    lin.weight.data = w.dequantize().bfloat16()
    lin.attach(w)
    lin.pack()
    x = (torch.randn(37, w.k, generator=torch.Generator().manual_seed(5)) * 0.5).bfloat16()
    out = torch.empty(37, w.n // 2, dtype=torch.bfloat16)
    assert lin._blocks_on_amx(x, out)
    assert lin.silu_mul_into(x, out)
    assert torch.equal(out.view(torch.int16), silu_and_mul(lin(x)).view(torch.int16))
    small = x[:gk.max_rows()]
    assert not lin.silu_mul_into(small, torch.empty(small.shape[0], w.n // 2, dtype=torch.bfloat16))
    assert not lin._blocks_on_amx(x.float(), out.float())


@pytest.mark.slow  # ~25 s: two default-model engines
def test_engine_with_kernels_matches_float32_path():
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3)
    prompt = [{"role": "user", "content": "Name three colors of the rainbow."}]
    fast = LLM(None, dtype="float32", kv_cache_memory="64MiB", gguf_kernels="on")
    assert fast.engine.core.runner.gguf_kernels
    ref = LLM(None, dtype="float32", kv_cache_memory="64MiB", gguf_kernels="off")
    a, b = fast.chat(prompt, params)[0].outputs[0], ref.chat(prompt, params)[0].outputs[0]
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)):
        if x != y:  # only a near-tie may flip
            assert abs(a.logprobs[i][x].logprob - b.logprobs[i][y].logprob) < 0.05
            break
        assert abs(a.logprobs[i][x].logprob - b.logprobs[i][y].logprob) < 1e-3


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_whole_layer_c_path_matches_the_torch_layer_loop(dtype):
    """Small all-decode steps run each layer as one C call (layers/fused_decode.py); same kernels and
    rounding points as the torch path, so bf16 output is bit-identical and fp32 equal to ~1e-5."""
    llm = LLM(None, dtype=dtype, kv_cache_memory="64MiB", enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    assert model.fused is not None
    prompts = [[2000 + i, 17, 18, 19, 20] * 6 for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    fused = llm.generate(prompts, params)
    model.fused, saved = None, model.fused
    model.batched, saved_batched = None, model.batched  # the per-layer torch path itself
    try:
        loop = llm.generate(prompts, params)
    finally:
        model.fused, model.batched = saved, saved_batched
    tol = 0.0 if dtype == "bfloat16" else 1e-4
    for a, b in zip(fused, loop, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb, tok in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids, strict=True):
            assert abs(la[tok].logprob - lb[tok].logprob) <= tol


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_the_c_path_final_norm_is_the_torch_norm_of_the_gathered_rows(dtype):
    """`FusedDecoder.final_hidden` finishes the model's final RMSNorm of the logits rows inside the layers' C
    call: the same bits as gathering x and residual in torch and calling the norm, for any rows in any
    order; a row outside the step is an IndexError, not a read past the buffers. One decode step per pass:
    several (`num_scheduler_steps`) run as one `decode_steps` call, which finishes its rows without
    `final_hidden`."""
    llm = LLM(None, dtype=dtype, kv_cache_memory="64MiB", enable_prefix_caching=False, num_scheduler_steps=1)
    model = llm.engine.core.runner.model
    fused, original, norm = model.fused, model.fused.final_hidden, model.norm
    checked = []

    def checking(input_ids, positions, caches, meta, rows):
        out = original(input_ids, positions, caches, meta, rows)
        # running the step again writes the same K / V into the same slots
        x, residual = fused.run(input_ids, positions, caches, meta)
        m = input_ids.shape[0]
        for pick in (rows, torch.arange(m - 1, -1, -1), torch.tensor([m - 1])):
            got = original(input_ids, positions, caches, meta, pick)
            assert torch.equal(got, norm(x[pick], residual[pick])[0])
        assert torch.equal(out, norm(x[rows], residual[rows])[0])
        with pytest.raises(IndexError):
            original(input_ids, positions, caches, meta, torch.tensor([0, m]))
        checked.append(m)
        return out

    fused.final_hidden = checking
    prompts = [[2000 + i, 17, 18, 19, 20] * 3 for i in range(3)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert max(checked) == 3
