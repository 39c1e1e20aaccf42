"""The batched path (layers/batched_decode.py: C calls between the matmuls) against the per-layer torch
path it replaces: the same kernels at the same rounding points, so hidden states are equal exactly, in
float32 and bfloat16, for prefill steps (every new token a row of the attention kernel) and decode steps,
with and without a cached prefix every sequence shares."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.layers import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="needs x86-64 with AVX2 and gcc")


def _captured_steps(llm: LLM, prompts: list[list[int]]) -> list[list]:
    """The arguments of every forward of a greedy generation (each step's inputs, metadata included)."""
    model = llm.engine.core.runner.model
    steps: list[list] = []
    forward = model.hidden_states

    def capture(*args):
        steps.append([a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        return forward(*args)

    model.hidden_states = capture
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    finally:
        del model.hidden_states
    return steps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("arch", "shared"), [("llama", False), ("llama", True), ("qwen2", False)])
def test_batched_path_equals_the_layer_loop(tiny_models, arch, dtype, shared):
    """Each step of a real generation (the prompts' prefill, then 12-row decodes), run again on the same
    inputs with the batched path and with the layer loop: bit-identical final hidden states (rewriting a step's KV slots writes the same values).
    Comparing per step on the same inputs keeps run-to-run differences (thread counts, scheduling) out.
    The token-budget scheduler admits all twelve prompts in one step, so the decodes that follow have twelve
    rows; the compute policy groups prompts by timed costs and may stagger them (then no step holds all 12)."""
    llm = LLM(str(tiny_models[arch]), dtype=dtype, kv_cache_memory="64MiB", enable_prefix_caching=shared,
              scheduler="tokens")
    model = llm.engine.core.runner.model
    batched = model.batched
    assert batched is not None
    prefix = [300 + (7 * i) % 500 for i in range(80)] if shared else []
    prompts = [prefix + [1000 + 13 * j + i for i in range(3 + j % 5)] for j in range(12)]
    if shared:  # the prefix's blocks are cached first, so every decode's table starts with the same blocks
        llm.generate([{"prompt_token_ids": prefix + [5]}], SamplingParams(max_tokens=1))
    steps = _captured_steps(llm, prompts)
    taken = [args for args in steps if batched.accepts(args[0].view(-1, 1), args[3][0])]
    assert len(taken) == len(steps)  # prefill rows too
    rows = [args[0].shape[0] for args in taken]
    # every prompt token (after the cached prefix) and 5 decode tokens per sequence
    assert sum(rows) == sum(len(p) - len(prefix) for p in prompts) + 5 * len(prompts) and 12 in rows
    with torch.inference_mode():
        for args in taken:
            fast = model.hidden_states(*args)
            model.batched = None
            try:
                loop = model.hidden_states(*args)
            finally:
                model.batched = batched
            assert torch.equal(fast, loop)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "gemma3", "qwen2_swa"])
def test_models_the_path_does_not_compute_stay_on_the_layer_loop(tiny_models, arch):
    """q/k norms, mixture-of-experts MLPs, Gemma's layer, sliding windows: not Llama's dense layer."""
    llm = LLM(str(tiny_models[arch]), dtype="float32", kv_cache_memory="64MiB")
    assert getattr(llm.engine.core.runner.model, "batched", None) is None
