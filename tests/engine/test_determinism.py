"""Outputs that do not depend on load (issue #16).

Default mode: the GGUF block kernels (small batches) multiply with the same weight values as the
dense path (larger batches) in every dtype, so a batch size changes only the summation order.
`--deterministic`: every token runs through row-invariant kernels, so one request's greedy tokens
are the same whatever it is batched with, however its prompt is chunked, with host work overlapped
or not, wherever its prefix came from (device cache, the persistent store after a restart) and
through a 1P+1D cluster.

bf16 cases run only where the CPU multiplies bf16 natively (AVX-512 BF16 / AMX), the machines
where bf16 is the default dtype; elsewhere bf16 is emulated (~8x slower) and not what users get.
"""

from __future__ import annotations

import gc

import openai
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.runner import cpu_has_fast_bf16
from deepinfer.layers import gguf_kernels as gk
from deepinfer.weights import default_model_path
from tests.server_utils import running_cluster, running_server

pytestmark = pytest.mark.skipif(gk.load_library() is None, reason="needs x86-64 with AVX2 and gcc")

BF16_NATIVE = cpu_has_fast_bf16()
SKIP_BF16 = pytest.mark.skipif(not BF16_NATIVE, reason="bf16 is emulated on this CPU (no AVX-512 BF16 / AMX): "
                               "not the default dtype here")
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bfloat16", marks=SKIP_BF16)]


@pytest.fixture(scope="module")
def blocks():
    return gk.read_quantized_tensors(default_model_path())


@pytest.mark.parametrize("name", ["blk.0.ffn_up.weight", "blk.2.attn_output.weight", "token_embd.weight"])
def test_bf16_block_kernel_uses_the_dense_paths_weight_values(blocks, name):
    """The dense path of a bf16 model holds the dequantized weights rounded to bf16; the block kernel
    must multiply those values too. With the file's exact values (the old kernel) about a third of the
    bf16 outputs differed from the dense path's; with the same values only summation order remains."""
    w = blocks[name]
    x = torch.randn(8, w.k, generator=torch.Generator().manual_seed(1)).bfloat16()
    dense = w.dequantize().bfloat16()
    out = w.matmul(x)
    same_values = torch.nn.functional.linear(x, dense)
    exact_values = (x.double() @ w.dequantize().double().T).bfloat16()
    assert (out != same_values).float().mean().item() < 0.01
    assert (same_values != exact_values).float().mean().item() > 0.1  # the test can tell the two apart


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "dense"])
def test_a_rows_result_does_not_depend_on_the_other_rows(blocks, kind, dtype):
    w = blocks["token_embd.weight" if kind == "q8_0" else "blk.1.ffn_down.weight"]
    if kind == "dense":
        w = gk.QuantizedWeight.dense(w.dequantize().to(dtype))
    x = torch.randn(40, w.k, generator=torch.Generator().manual_seed(2)).to(dtype)
    if kind != "dense":  # keep the logits matrix small: 40 rows x 49152 is slow to recompute 6 times
        w = gk.QuantizedWeight(w.kind, w.qs[:512], w.d[:512], None if w.mn is None else w.mn[:512], 512, w.k)
    full = w.matmul(x)
    for rows in (1, 3, 8, 9, 17):
        assert torch.equal(w.matmul(x[:rows]), full[:rows])
    assert torch.equal(w.matmul(x[21:22]), full[21:22])  # a row computed alone, or 21st of 40


@SKIP_BF16
def test_bf16_blocks_and_their_dense_copy_give_bit_identical_rows(blocks):
    """Row-invariant mode serves large bf16 batches from the dense copy (no dequantizing per pass):
    it must be bit-identical to the blocks, or batch size would still change the result."""
    for name in ("blk.0.ffn_gate.weight", "token_embd.weight"):
        w = blocks[name]
        x = torch.randn(24, w.k, generator=torch.Generator().manual_seed(3)).bfloat16()
        assert torch.equal(w.matmul(x), gk.QuantizedWeight.dense(w.dequantize().bfloat16()).matmul(x))


# ---------------------------------------------------------------------------- the engine, end to end

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _llm(dtype: str, **kw) -> LLM:
    return LLM(None, dtype=dtype, deterministic=True, kv_cache_memory="192MiB", profile_cost_model=False, **kw)


@pytest.fixture(scope="module")
def prompts():
    """A ~1000-token prompt (a document to summarise) and 32 other prompts of mixed lengths."""
    from transformers import AutoTokenizer

    from deepinfer.weights import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(None).directory))
    doc = "\n".join(f"Entry {i}: the shipment of {i * 7 % 23} crates left dock {i % 5} at {i % 12 + 1} o'clock "
                    f"and reached the warehouse {i * 3 % 11} hours later." for i in range(60))
    long = tok.encode(f"Read the log below, then answer: which dock was busiest?\n{doc}\nAnswer:")
    others = [tok.encode(f"Question {i}: " + "tell me about the weather in spring. " * (1 + i % 9)) for i in range(32)]
    return long, others


def _tokens(out) -> list[int]:
    return list(out.outputs[0].token_ids)


@pytest.mark.slow  # ~66 s per dtype on an AVX2 machine
@pytest.mark.parametrize("dtype", [p.id for p in DTYPES] if BF16_NATIVE else ["float32"])
def test_deterministic_greedy_ignores_batching_chunking_and_cache_tiers(dtype, prompts, tmp_path):
    long, others = prompts
    assert len(long) > 900
    store = tmp_path / "kv"
    llm = _llm(dtype, kv_store=str(store))
    cold = llm.generate([long], GREEDY)[0]
    assert cold.num_cached_tokens == 0
    # the same prompt again inside a batch of 32 others: a device prefix hit, the rest computed with them
    batch = llm.generate(others[:16] + [long] + others[16:], GREEDY)
    assert batch[16].num_cached_tokens > 0
    assert _tokens(batch[16]) == _tokens(cold)
    assert llm.engine.flush_kv_store(timeout=60)
    del llm
    gc.collect()

    # after a restart, the prefix comes back from the persistent store
    llm = _llm(dtype, kv_store=str(store))
    warm = llm.generate([long], GREEDY)[0]
    assert warm.num_cached_tokens_by_tier["store"] > 0
    assert _tokens(warm) == _tokens(cold)
    del llm
    gc.collect()

    # computed fresh in small chunks, sharing every step with 32 other prompts, host work overlapped
    llm = _llm(dtype, enable_prefix_caching=False, max_num_batched_tokens=160, overlap_host_work="on")
    mixed = llm.generate(others[:16] + [long] + others[16:], GREEDY)
    assert mixed[16].num_cached_tokens == 0
    assert _tokens(mixed[16]) == _tokens(cold)
    # and the short prompts too: alone vs with the others
    alone = llm.generate([others[5]], GREEDY)[0]
    assert _tokens(alone) == _tokens(mixed[5])


@pytest.mark.slow  # ~100 s: a cluster of worker processes per dtype
@pytest.mark.parametrize("dtype", [p.id for p in DTYPES] if BF16_NATIVE else ["float32"])
def test_deterministic_cluster_matches_unified(dtype, prompts, tmp_path):
    """A 1P+1D cluster (the prefill worker computes the prompt and the first token, ships the KV, the
    decode worker continues) gives the unified server's greedy tokens."""
    long, others = prompts
    flags = ("--deterministic", "--dtype", dtype, "--kv-cache-memory", "192MiB", "--no-profile-cost-model",
             "--max-model-len", "2048")
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": MAX_TOKENS, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    batch = [long, *others[:3]]
    with running_server(*flags) as base:
        unified = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)
        ref = [unified.completions.create(prompt=p, **body).choices[0].text for p in batch]
    with running_cluster(*flags, "--prefill-workers", "1", "--decode-workers", "1",
                         log=tmp_path / "cluster.log") as base:
        cluster = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)
        got = [cluster.completions.create(prompt=p, **body).choices[0].text for p in batch]
    assert got == ref
