"""A tiny random Qwen3-MoE GGUF file (written with the `gguf` package, Q8_0 and Q4_1) served by deepinfer with
its routed experts multiplying their quantized blocks, against transformers loading the same file.

- default suite: the loader reads the expert width transformers' GGUF reader drops;
- slow: the converted checkpoint's expert tensors are exactly the blocks' values; greedy output token-identical
  to transformers in fp32 (in bf16, each token transformers' best or a near tie: see the test) with every expert
  slot on blocks and the blocks used; EP=2 with EPLB
  re-placing a skewed router's experts mid-generation keeps the output and the moved experts' blocks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deepinfer import LLM, SamplingParams
from deepinfer.layers import gguf_kernels as gk
from tests.conftest import hf_greedy
from tests.models.gguf_moe_tiny import TINY_QWEN3_MOE, hf_from_gguf, write_qwen3_moe_gguf

pytestmark = pytest.mark.skipif(gk.load_library() is None, reason="needs x86-64 with AVX2 and gcc")

E, LAYERS = TINY_QWEN3_MOE["num_experts"], TINY_QWEN3_MOE["num_hidden_layers"]
PROMPTS = [[1, 500, 600, 700, 800, 901], [5, 17, 300, 41, 9], [100, 200, 300], [7] * 12]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
COMMON = dict(kv_cache_memory="32MiB", profile_cost_model=False, max_num_batched_tokens=16, gguf_kernels="on")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3_moe_gguf")
    return {q: write_qwen3_moe_gguf(root / f"tiny-qwen3-moe-{q}.gguf", q) for q in ("q8_0", "q4_1")}


def test_loader_reads_the_expert_width_transformers_drops(tmp_path):
    from deepinfer.weights.loader import gguf_config_overrides

    path = write_qwen3_moe_gguf(tmp_path / "t.gguf", "q8_0", tokenizer=False, moe_intermediate_size=160)
    assert gguf_config_overrides(path) == {"moe_intermediate_size": 160}


def test_mixtral_style_gguf_is_refused_not_loaded_dense(tmp_path):
    """llama.cpp writes Mixtral as a llama-architecture file with stacked experts; transformers' GGUF reader
    (5.x) has no Mixtral mapping and would build a dense Llama with random MLP weights."""
    import gguf
    import numpy as np

    from deepinfer.weights import resolve_model

    path = tmp_path / "mixtral-style.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_expert_count(4)
    rng = np.random.default_rng(0)
    for name, shape in [("token_embd", (256, 64)), ("blk.0.ffn_gate_inp", (4, 64)), ("blk.0.ffn_gate_exps", (4, 96, 64)),
                        ("blk.0.ffn_up_exps", (4, 96, 64)), ("blk.0.ffn_down_exps", (4, 64, 96))]:
        w.add_tensor(f"{name}.weight", rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="llama-architecture GGUF with routed experts .* not supported"):
        resolve_model(path)


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["q8_0", "q4_1"])
def test_converted_experts_are_the_blocks_values(files, quant):
    from deepinfer.weights import resolve_model

    path = files[quant]
    sd = {}
    for f in resolve_model(path).safetensors_files():
        sd.update(load_file(str(f)))
    experts = gk.read_quantized_experts(path)
    inter = TINY_QWEN3_MOE["moe_intermediate_size"]
    for b in range(LAYERS):
        gate_up, down = sd[f"model.layers.{b}.mlp.experts.gate_up_proj"], sd[f"model.layers.{b}.mlp.experts.down_proj"]
        assert gate_up.shape == (E, 2 * inter, TINY_QWEN3_MOE["hidden_size"])
        for e in range(E):
            assert torch.equal(experts[f"blk.{b}.ffn_gate_exps.weight"][e].dequantize(), gate_up[e, :inter])
            assert torch.equal(experts[f"blk.{b}.ffn_up_exps.weight"][e].dequantize(), gate_up[e, inter:])
            assert torch.equal(experts[f"blk.{b}.ffn_down_exps.weight"][e].dequantize(), down[e])


def _generate(path: Path, dtype: str, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), dtype=dtype, **COMMON, **kw)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)], llm


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quant", ["q8_0", "q4_1"])
def test_greedy_matches_transformers_with_quantized_experts(files, quant, dtype):
    path = files[quant]
    ours, llm = _generate(path, dtype)
    with llm:  # closes it
        experts = [layer.mlp.experts for layer in llm.engine.core.runner.model.layers]
        assert [ex.num_quantized for ex in experts] == [E] * LAYERS  # every expert slot has its blocks
        assert all(ex.quantized_calls > 0 for ex in experts)  # ... and decode steps multiplied them
        # the dense weights hold the blocks' values in the model dtype (the kernels' contract)
        q13, q2 = experts[1].quantized[5]
        assert torch.equal(q13.dequantize().to(experts[1].w13.dtype), experts[1].w13[5].detach())
        assert torch.equal(q2.dequantize().to(experts[1].w2.dtype), experts[1].w2[5].detach())
    hf = hf_from_gguf(path, getattr(torch, dtype))
    if dtype == "float32":
        assert ours == [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
        return
    # bf16: this random model's float32 top-two margins are 0.002-0.03 nats at several positions, under bf16's
    # resolution of a logit (0.031 at |logit| in [4, 8)), so token identity with transformers' bf16 run depends
    # on how each side rounds, not on which is more accurate. Since prefill attention runs on the paged kernel
    # (float32 probabilities) instead of torch's flash attention (probabilities rounded to bf16), q4_1 flips a
    # tie at token 11-13 of two prompts; both sides are equally far from float32 (max |logprob - fp32| over the
    # top 20 after each prompt: ours 0.023 / 0.019 / 0.285 / 0.683, transformers 0.024 / 0.016 / 0.286 / 0.683).
    # So, as for the other tiny models in bf16 (test_models_vs_hf.py): every token we pick is transformers'
    # best, or within 0.05 nats of it, on our own sequence.
    for p, toks in zip(PROMPTS, ours, strict=True):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p + toks])).logits[0].float(), -1)
        for i, tok in enumerate(toks):
            row = ref[len(p) - 1 + i]
            assert row.max() - row[tok] < 0.05, f"token {i}: ours is not (nearly) transformers' best"


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["on", "off"])
def test_deterministic_mode_serves_the_moe(files, kernels):
    """--deterministic: router and every expert through the row-invariant kernel (blocks with GGUF kernels on,
    the dense kind off): a prompt alone and inside a batch gives the same tokens and the same logprobs."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    with LLM(str(files["q4_1"]), dtype="float32", deterministic=True, **{**COMMON, "gguf_kernels": kernels}) as llm:
        experts = [layer.mlp.experts for layer in llm.engine.core.runner.model.layers]
        assert all(ex.row_invariant is not None for ex in experts)
        alone = llm.generate([PROMPTS[3]], params)[0].outputs[0]
        batch = llm.generate(PROMPTS + [[9] * 30], params)[3].outputs[0]
        assert (sum(ex.quantized_calls for ex in experts) > 0) == (kernels == "on")
    assert list(alone.token_ids) == list(batch.token_ids)
    assert [{t: lp.logprob for t, lp in row.items()} for row in alone.logprobs] == \
        [{t: lp.logprob for t, lp in row.items()} for row in batch.logprobs]
    with pytest.raises(ValueError, match="deterministic mode does not serve expert parallelism"):
        LLM(str(files["q8_0"]), dtype="float32", deterministic=True, enable_eplb=True, **COMMON)


@pytest.mark.slow
def test_expert_parallel_eplb_moves_blocks_and_keeps_the_output(tmp_path):
    """Experts 0-3 hot (a skewed router): EP=2 with 2 redundant slots re-places them mid-generation; the
    moved experts arrive with their blocks (every slot of both ranks still on blocks) and the output equals
    one process's."""
    path = write_qwen3_moe_gguf(tmp_path / "skewed.gguf", "q8_0", seed=1, skew=True)
    single, llm = _generate(path, "float32")
    llm.close()
    with LLM(str(path), dtype="float32", **COMMON, expert_parallel_size=2, enable_eplb=True,
             num_redundant_experts=2, eplb_step_interval=5, eplb_window_steps=5) as ep:
        outs = [list(o.outputs[0].token_ids) for o in ep.generate(PROMPTS, GREEDY)]
        stats = ep.stats()["eplb"]
    assert outs == single
    assert stats["rebalances"] >= 1 and stats["placement"] != [list(range(E)) + [0, 1]] * LAYERS
    slots_per_rank = (E + 2) // 2
    # some rank now holds an expert it did not hold before: its weights and blocks came from the other rank
    initial = [set(range(slots_per_rank)), set(range(slots_per_rank, E)) | {0, 1}]
    assert any(set(row[r * slots_per_rank:(r + 1) * slots_per_rank]) - initial[r]
               for row in stats["placement"] for r in range(2))
    for rank in stats["ranks"]:
        assert rank["quantized_slots"] == LAYERS * slots_per_rank  # moved experts kept their blocks
        assert rank["quantized_expert_calls"] > 0
