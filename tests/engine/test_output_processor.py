"""The one output path (engine/output_processor.py) and the one request validator (engine/validation.py),
against the real engine with a tiny model: a stop string ends a request with one finish that frees its KV
blocks at once; n > 1 sequences fan in to one output per step; streamed deltas add up to the offline text
(in-process, engine thread and engine process); each entry path rejects what the validator rejects."""

from __future__ import annotations

import asyncio

import pytest

from deepinfer.config import EngineConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.llm import LLM
from deepinfer.engine.process_engine import ProcessEngine
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.structured import StructuredOutputParams
from deepinfer.engine.validation import RequestError, RequestValidator

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13] * 7, [3] * 40]
MAX_MODEL_LEN = 256


def _kwargs(**extra) -> dict:
    return dict(dtype="float32", kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN, **extra)


def _engine(model, **extra) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(model=str(model), **_kwargs(**extra)))


def _run(engine: LLMEngine, params: SamplingParams, prompts=PROMPTS) -> tuple[dict, dict]:
    """Run `prompts` to the end; (request id -> every output in order, request id -> final output)."""
    for i, p in enumerate(prompts):
        engine.add_request(p, params, f"r{i}")
    seen: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen, {rid: outs[-1] for rid, outs in seen.items()}


def _stop_string(model) -> str:
    """A stop string the greedy continuation of PROMPTS[0] reaches mid-way."""
    with LLM(str(model), **_kwargs()) as llm:
        text = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0] \
            .outputs[0].text
    for start in range(len(text) // 3, len(text) - 2):
        stop = text[start:start + 2]
        if stop.strip() and text.find(stop) == start:
            return stop
    pytest.skip("the tiny model's text has no usable stop string here")


@pytest.fixture(scope="module")
def stop(tiny_models) -> str:
    return _stop_string(tiny_models["llama"])


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_stop_string_finishes_the_request_and_frees_its_blocks_at_once(tiny_models, stop, overlap):
    engine = _engine(tiny_models["llama"], overlap_host_work=overlap)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    engine.add_request(PROMPTS[0], params, "r0")
    final = None
    while final is None:
        outs = engine.step()
        assert engine.core.kv.pool.num_used > 0 or outs  # it holds blocks until the output that ends it
        final = next((o for o in outs if o.finished), None)
    c = final.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop and not c.text.endswith(stop)
    # the output that reports the stop string is the step that freed the request in the core
    assert engine.core.kv.pool.num_used == 0
    assert not engine.core.scheduler.running and "r0" not in engine.core.scheduler.requests
    assert not engine.has_unfinished() and len(engine.processor) == 0
    engine.close()


def test_n_sequences_fan_in_to_one_output_per_step(tiny_models):
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, n=3, seed=7, logprobs=1)
    engine = _engine(tiny_models["llama"])
    seen, finals = _run(engine, params, PROMPTS[:2])
    engine.close()
    with LLM(str(tiny_models["llama"]), **_kwargs()) as llm:
        offline = llm.generate(PROMPTS[:2], params)
    for i, want in enumerate(offline):
        outs = seen[f"r{i}"]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        for out in outs:  # every output carries all n sequences, in order
            assert [c.index for c in out.outputs] == [0, 1, 2]
        got = finals[f"r{i}"].outputs
        assert [c.token_ids for c in got] == [c.token_ids for c in want.outputs]
        assert [c.text for c in got] == [c.text for c in want.outputs]
        assert len({tuple(c.token_ids) for c in got}) > 1  # different seeds, different sequences
        for j in range(3):
            assert "".join(o.outputs[j].delta_text for o in outs) == got[j].text
            assert [t for o in outs for t in o.outputs[j].delta_token_ids] == got[j].token_ids
            assert len(got[j].logprobs) == len(got[j].token_ids)


def _offline(model, params: SamplingParams) -> list:
    with LLM(str(model), **_kwargs()) as llm:
        return llm.generate(PROMPTS, params)


async def _stream(client, params: SamplingParams) -> list[list]:
    async def one(i: int) -> list:
        return [out async for out in client.generate(PROMPTS[i], params, request_id=f"s{i}-{id(params)}")]
    return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))


@pytest.fixture(scope="module", params=["thread", "process"])
def client(request, tiny_models):
    config = EngineConfig.from_kwargs(model=str(tiny_models["llama"]), **_kwargs())
    engine = AsyncEngine(config) if request.param == "thread" else ProcessEngine(config)
    yield engine
    engine.shutdown()


def test_streamed_deltas_add_up_to_the_offline_text(client, tiny_models, stop):
    for params in (SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]),
                   SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop],
                                  include_stop_str_in_output=True, logprobs=1)):
        want = _offline(tiny_models["llama"], params)
        got = asyncio.run(_stream(client, params))
        for w, outs in zip(want, got, strict=True):
            final = outs[-1].outputs[0]
            assert final.text == w.outputs[0].text and final.token_ids == w.outputs[0].token_ids
            assert (final.finish_reason, final.stop_reason) == (w.outputs[0].finish_reason, w.outputs[0].stop_reason)
            assert "".join(o.outputs[0].delta_text for o in outs) == final.text
            assert [t for o in outs for t in o.outputs[0].delta_token_ids] == final.token_ids
            for o in outs:  # each output's text ends with its delta
                assert o.outputs[0].text.endswith(o.outputs[0].delta_text)
        assert want[0].outputs[0].finish_reason == "stop"


def test_a_stop_string_frees_the_sequence_in_the_engine(client, stop):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, stop=[stop])

    async def scenario():
        outs = [out async for out in client.generate(PROMPTS[0], params)]
        assert outs[-1].outputs[0].finish_reason == "stop"
        for _ in range(100):  # the engine process gets the finish command a moment later
            stats = await client.call("stats")
            if stats["kv_blocks_used"] == 0 and stats["num_running"] == 0:
                break
            await asyncio.sleep(0.02)
        return stats

    stats = asyncio.run(scenario())
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0


def test_every_entry_path_validates(client, tiny_models):
    too_long = [5] * MAX_MODEL_LEN

    async def scenario():
        with pytest.raises(RequestError, match="maximum context length") as e:
            async for _ in client.generate(too_long, SamplingParams(max_tokens=2)):
                pass
        assert e.value.code == "context_length_exceeded"
        with pytest.raises(RequestError, match="logit_bias token id"):
            async for _ in client.generate([5], SamplingParams(max_tokens=2, logit_bias={10**7: 1.0})):
                pass
        # the grammar compiles where the engine uses it (once), not on a cache of the client's own
        with pytest.raises(ValueError):
            await client.compile_grammar(StructuredOutputParams(regex="(unclosed"))
        await client.compile_grammar(StructuredOutputParams(regex="[ab]+"))
        assert client._grammars is None

    asyncio.run(scenario())
    assert client.validator.max_model_len == MAX_MODEL_LEN


def test_offline_entry_paths_validate(tiny_models):
    engine = _engine(tiny_models["llama"])
    with pytest.raises(RequestError, match="maximum context length"):
        engine.add_request([5] * MAX_MODEL_LEN, SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="n == 1"):
        engine.add_request([5], SamplingParams(n=2), output_prefix=[6])
    assert not engine.has_unfinished()
    engine.close()
    with LLM(str(tiny_models["llama"]), **_kwargs()) as llm, pytest.raises(RequestError, match="out of range"):
        llm.generate([[5, 6], [10**9]], SamplingParams(max_tokens=2))


def test_the_validator_api_rule():
    v = RequestValidator(100, lambda: 10, True)
    assert v.max_tokens_for(4, None, "prompt") == 6
    assert v.max_tokens_for(4, 6, "prompt") == 6
    with pytest.raises(RequestError) as e:
        v.max_tokens_for(4, 7, "messages")
    assert (e.value.param, e.value.code) == ("max_tokens", "context_length_exceeded")
    with pytest.raises(RequestError) as e:
        v.max_tokens_for(10, 1, "messages")
    assert (e.value.param, e.value.code) == ("messages", "context_length_exceeded")
    with pytest.raises(RequestError, match="tokenizer"):
        RequestValidator(100, 10, False).check_params(SamplingParams(structured_output=StructuredOutputParams(
            regex="a")))
