"""The batched decode path (layers/batched_decode.py: C calls between the matmuls) against the per-layer
torch path it replaces: the same kernels at the same rounding points, so tokens and logprobs are equal
exactly, in float32 and bfloat16, with and without a prefix every decode shares (cascade attention)."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.layers import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="needs x86-64 with AVX2 and gcc")


def _generate(llm: LLM, prompts: list[list[int]], batched: bool) -> tuple[list, list[bool]]:
    """Greedy outputs with the batched path on or off, and for each batched step whether it had a
    shared prefix."""
    model = llm.engine.core.runner.model
    saved = model.batched
    steps: list[bool] = []
    run = saved.run

    def counted(x, cos, sin, caches, meta):
        steps.append(meta.shared_blocks is not None)
        return run(x, cos, sin, caches, meta)

    saved.run = counted
    model.batched = saved if batched else None
    try:
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params), steps
    finally:
        model.batched = saved
        del saved.run


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("arch", "shared"), [("llama", False), ("llama", True), ("qwen2", False)])
def test_batched_path_equals_the_layer_loop(tiny_models, arch, dtype, shared):
    llm = LLM(str(tiny_models[arch]), dtype=dtype, kv_cache_memory="64MiB", enable_prefix_caching=shared,
              num_threads=1)  # one thread: oneDNN's float32 sums do not vary with the thread count
    assert llm.engine.core.runner.model.batched is not None
    prefix = [300 + (7 * i) % 500 for i in range(80)] if shared else []
    prompts = [prefix + [1000 + 13 * j + i for i in range(3 + j % 5)] for j in range(12)]
    if shared:  # the prefix's blocks are cached first, so every decode's table starts with the same blocks
        llm.generate([{"prompt_token_ids": prefix + [5]}], SamplingParams(max_tokens=1))
    fast, steps = _generate(llm, prompts, batched=True)
    loop, off = _generate(llm, prompts, batched=False)
    assert steps and not off
    assert any(steps) == shared  # the cascade (shared-prefix) attention was exercised, or not
    for a, b in zip(fast, loop, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert {t: v.logprob for t, v in la.items()} == {t: v.logprob for t, v in lb.items()}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "gemma3", "qwen2_swa"])
def test_models_the_path_does_not_compute_stay_on_the_layer_loop(tiny_models, arch):
    """q/k norms, mixture-of-experts MLPs, Gemma's layer, sliding windows: not Llama's dense layer."""
    llm = LLM(str(tiny_models[arch]), dtype="float32", kv_cache_memory="64MiB")
    assert getattr(llm.engine.core.runner.model, "batched", None) is None
