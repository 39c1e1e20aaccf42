"""Host work overlapped with the model thread: same outputs as strict step-by-step, no leaked blocks."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from tests.conftest import hf_greedy
from tests.models.test_models_vs_hf import _assert_all_free, _prompts


def _run(path, overlap: bool, prompts, params):
    llm = LLM(str(path), dtype="float32", kv_cache_memory="64MiB", overlap_host_work="on" if overlap else "off")
    outs = llm.generate(prompts, params)
    return llm, outs


@pytest.mark.parametrize("arch", ["llama"])
def test_overlap_is_token_identical_and_leaks_nothing(arch, tiny_models, hf_models):
    prompts = _prompts(11, [3, 17, 33, 60])
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm, outs = _run(tiny_models[arch], True, prompts, greedy)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf_models[arch], p, 10)
    core = llm.engine.core
    assert core.num_idle_gaps > 0 and core.idle_gap_seconds >= 0.0
    assert core.num_steps_ahead > 0  # decodes were scheduled before the previous step's tokens existed
    _assert_all_free(llm)

    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=10, ignore_eos=True,
                             frequency_penalty=0.5, n=2)
    a = [o.outputs for o in _run(tiny_models[arch], True, prompts, sampled)[1]]
    b = [o.outputs for o in _run(tiny_models[arch], False, prompts, sampled)[1]]
    assert [[c.token_ids for c in x] for x in a] == [[c.token_ids for c in x] for x in b]


def test_stop_string_ending_with_a_token_in_flight(tiny_models):
    """A stop string is matched after the next step was launched: that step's token is dropped,
    the text stops where the sequential engine stops, and the request's blocks come back."""
    path = tiny_models["llama"]
    prompts = _prompts(12, [9, 25])
    probe = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm, outs = _run(path, False, prompts, probe)
    texts = [o.outputs[0].text for o in outs]
    stops = [t[len(t) // 2: len(t) // 2 + 3] for t in texts]  # a piece from the middle of each output
    results = {}
    for overlap in (False, True):
        llm, outs = _run(path, overlap, prompts,
                         [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[s]) for s in stops])
        results[overlap] = [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        _assert_all_free(llm)
    assert results[True] == results[False]
    assert all(r[2] == "stop" for r in results[True])
