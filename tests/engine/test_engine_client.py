"""Both EngineClients (engine on a thread, engine in its own process) against the offline engine:
the same outputs, assembled from deltas across the process boundary; calls; abort frees blocks."""

from __future__ import annotations

import asyncio

import pytest

from deepinfer.config import EngineConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.process_engine import ProcessEngine
from deepinfer.engine.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13] * 7, [3] * 40]


def _config(model) -> EngineConfig:
    return EngineConfig.from_kwargs(model=str(model), dtype="float32", kv_cache_memory="16MiB", max_model_len=512)


@pytest.fixture(scope="module", params=["thread", "process"])
def client(request, tiny_models):
    cls = AsyncEngine if request.param == "thread" else ProcessEngine
    engine = cls(_config(tiny_models["llama"]))
    yield engine
    engine.shutdown()


def _reference(model, params: SamplingParams) -> list:
    engine = LLMEngine(_config(model))
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, params, f"r{i}")
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    engine.close()
    return [finals[f"r{i}"] for i in range(len(PROMPTS))]


async def _run_all(client, params: SamplingParams) -> list:
    async def one(i: int):
        seen = []
        async for out in client.generate(PROMPTS[i], params, request_id=f"c{i}-{id(params)}"):
            seen.append(out)
        # each state extends the previous one: outputs only grow
        for a, b in zip(seen, seen[1:], strict=False):
            assert b.outputs[0].token_ids[:len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
        return seen[-1]
    return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))


def test_outputs_match_the_offline_engine(client, tiny_models):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, n=2, seed=1)
    want = _reference(tiny_models["llama"], params)
    got = asyncio.run(_run_all(client, params))
    for w, g in zip(want, got, strict=True):
        assert g.finished and g.prompt_token_ids == w.prompt_token_ids
        for wo, go in zip(w.outputs, g.outputs, strict=True):
            assert go.token_ids == wo.token_ids and go.text == wo.text and go.finish_reason == wo.finish_reason
            assert len(go.logprobs) == len(wo.logprobs) == 12
            assert [set(e) for e in go.logprobs] == [set(e) for e in wo.logprobs]
            assert go.cumulative_logprob == pytest.approx(wo.cumulative_logprob, abs=1e-4)


def test_stop_string_text_matches(client, tiny_models):
    base = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    text = _reference(tiny_models["llama"], base)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("the tiny model's text has no usable stop string here")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
    want = _reference(tiny_models["llama"], params)
    got = asyncio.run(_run_all(client, params))
    assert [g.outputs[0].text for g in got] == [w.outputs[0].text for w in want]
    assert got[0].outputs[0].finish_reason == "stop"


def test_calls_and_abort(client):
    async def scenario():
        assert isinstance(await client.call("stats"), dict)
        with pytest.raises(ValueError, match="cannot be called"):
            await client.call("close")
        gen = client.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await gen.aclose()  # leaving early aborts the request
        for _ in range(100):
            stats = await client.call("stats")
            if stats["kv_blocks_used"] == 0 and stats["num_running"] == 0:
                break
            await asyncio.sleep(0.05)
        return stats

    stats = asyncio.run(scenario())
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0


def test_bad_prompt_is_rejected_before_queueing(client):
    async def scenario():
        with pytest.raises(ValueError, match="out of range"):
            async for _ in client.generate([10**9], SamplingParams(max_tokens=2)):
                pass
        with pytest.raises(ValueError, match="retention"):
            async for _ in client.generate([5], SamplingParams(max_tokens=2), retention_class="forever"):
                pass
    asyncio.run(scenario())
