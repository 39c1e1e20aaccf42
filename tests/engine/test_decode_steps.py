"""Several greedy decode steps per scheduling pass (`num_scheduler_steps`, the whole-layer C path's
`decode_steps`): the same tokens, text and finish reasons as one step at a time, no KV block kept, and
only where every row is a plain greedy decode and nobody waits. On the default model (the C path needs
its GGUF blocks), float32; bfloat16 too, in the slow suite (on CPUs without native bf16 its prefill is
emulated and slow).

The engines compared use the `tokens` scheduler. Under `compute` the cost model, which learns from the
steps it sees, learns from other steps when they come several per call, so prompts can be chunked and
ordered differently; in bfloat16 a prompt's prefill rounds differently with the rows beside it (its
matmuls take oneDNN's kernels past 8 rows), so the two engines' outputs could part for that reason alone
(seen: four prompts after a first request, one row parted at its 27th token; with `tokens`, or either
engine run twice, they agree)."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from tests.engine.spec_utils import assert_all_free

PROMPTS = ["Tell me a long story about a dragon.", "def fib(n):", "The capital of France is", "List three colors:"]
STEPS = 4


def _llm(steps: int, dtype: str = "float32") -> LLM:
    return LLM(None, dtype=dtype, num_scheduler_steps=steps, profile_cost_model=False, kv_cache_memory="64MiB",
               scheduler="tokens")


def _outputs(llm: LLM, prompts: list[str], params: SamplingParams) -> list[tuple[list[int], str, str | None]]:
    return [(list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason)
            for o in llm.generate(prompts, params)]


CASES = [
    # one stream, a length that is no multiple of the steps
    (PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)),
    # four rows ending at different steps: EOS (inside a group of steps), length
    (PROMPTS, SamplingParams(temperature=0.0, max_tokens=45)),
    # stop tokens of the request (13 = "\n", 28 = "=" in this vocabulary)
    (PROMPTS, SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[13, 28])),
    # stop strings, matched on the text after the C call ran past them
    (PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=40, stop=[" the", "("])),
]


def _check(dtype: str) -> None:
    single, multi = _llm(1, dtype), _llm(STEPS, dtype)
    assert multi.engine.core.scheduler.decode_steps_rows == 8  # the C path serves this model
    for prompts, params in CASES:
        steps = {}
        outputs = {}
        for name, llm in (("single", single), ("multi", multi)):
            before = llm.engine.core.num_steps
            outputs[name] = _outputs(llm, prompts, params)
            steps[name] = llm.engine.core.num_steps - before
        assert outputs["multi"] == outputs["single"]
        # the tokens came several per engine step (else this would compare one step at a time with itself)
        assert steps["multi"] < steps["single"] * 0.6, steps
    for llm in (single, multi):
        assert_all_free(llm)


def test_decode_steps_are_token_identical_float32():
    _check("float32")


@pytest.mark.slow
def test_decode_steps_are_token_identical_bfloat16():
    _check("bfloat16")


def test_decode_steps_only_for_plain_greedy_decodes_with_nobody_waiting():
    """Step by step through the core: a greedy stream gets STEPS tokens per step; a sampled request in the
    batch, or a prompt waiting, puts it back to one token per step; max_tokens caps the last group."""
    llm = _llm(STEPS)
    engine = llm.engine
    core = engine.core

    def add(rid: str, params: SamplingParams) -> None:
        engine.add_request("", params, request_id=rid, prompt_token_ids=[1, 504, 3458, 282, 1303, 30])

    def tokens_per_step() -> list[int]:
        return sorted(len(o.new_token_ids) for o in core.step())

    add("greedy", SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True))
    assert tokens_per_step() == [1]  # the prefill samples the first token
    assert tokens_per_step() == [STEPS]
    add("sampled", SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, seed=1))
    assert tokens_per_step() == [1, 1]  # a prompt waits: one step (the new prompt prefills in it)
    assert tokens_per_step() == [1, 1]  # a sampled row in the batch: one step
    assert tokens_per_step() == [1, 1]
    assert tokens_per_step() == [1, 1]  # "sampled" finishes (4 tokens)
    # "greedy" has 1 + 4 + 4 = 9 of its 11 tokens: the last group is capped at 2
    assert tokens_per_step() == [2]
    assert not core.has_unfinished()
    assert_all_free(llm)


def test_speculative_engine_takes_several_steps_where_nobody_drafts():
    """With speculation, a step where no request drafts takes several decode steps too: the output is still
    the single-step engine's, drafts were verified, and fewer engine steps ran than tokens came out. The
    suffix proposer: with the n-gram one, batches of up to 7 plain greedy decodes speculate inside the C
    calls instead (test_spec_in_call.py)."""
    from tests.engine.spec_utils import spec_config

    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = PROMPTS[:2]
    reference = _outputs(_llm(1), prompts, params)
    spec = LLM(None, dtype="float32", num_scheduler_steps=STEPS, profile_cost_model=False, kv_cache_memory="64MiB",
               scheduler="tokens", speculative_config=spec_config("suffix", k=5, adaptive=True))
    assert spec.engine.core.scheduler.decode_steps_rows == 8
    runner = spec.engine.core.runner
    calls = []
    run_steps = runner._run_steps
    runner._run_steps = lambda *args: calls.append(args[0].num_steps) or run_steps(*args)  # counts, then runs
    got = _outputs(spec, prompts, params)
    assert got == reference
    m = spec.engine.core.speculator.metrics
    assert m.num_verifications > 0, "nothing was verified: the test would prove nothing"
    assert calls and max(calls) == STEPS, "no step ran several decode steps"
    assert_all_free(spec)
