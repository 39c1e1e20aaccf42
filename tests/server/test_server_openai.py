"""The real server (`deepinfer serve`, default model) through the official `openai` SDK."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.server_utils import KEY, metric, prefill_reference

MODEL = "SmolLM2-135M-Instruct"
Q = [{"role": "user", "content": "What is the capital of France?"}]




@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=20, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    u = r.usage
    assert u.completion_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens is not None
    extra = u.model_extra
    assert extra["prompt_cache_hit_tokens"] + extra["prompt_cache_miss_tokens"] == u.prompt_tokens


def test_chat_streaming_with_usage_matches_non_streaming(client):
    ref = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=Q, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [ref.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_put_running_usage_on_every_chunk(client):
    """vLLM's `stream_options.continuous_usage_stats` (guidellm asks for it): every chunk carries the usage so far."""
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=Q, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    final = chunks[-1].usage
    assert chunks[-1].choices == [] and final.completion_tokens == 8
    counts = [c.usage.completion_tokens for c in chunks[:-1]]
    assert counts == sorted(counts) and counts[-1] == 8 and counts[0] <= 1
    assert all(c.usage.prompt_tokens == final.prompt_tokens for c in chunks[:-1])
    texts = list(client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert [c.usage.completion_tokens for c in texts[:-1]][-1] == 5 == texts[-1].usage.completion_tokens


def test_continue_final_message_prefills_the_reply(client, server, default_model_dir):
    # vLLM's flags: the final (assistant) message is rendered open and the reply continues it
    prefill = [*Q, {"role": "assistant", "content": "The capital of France is"}]
    ids, expected = prefill_reference(server, default_model_dir, prefill, 12)
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    r = client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=12, temperature=0, extra_body=flags)
    assert expected.strip() and r.choices[0].message.content == expected and r.usage.prompt_tokens == len(ids)
    tokenized = httpx.post(f"{server}/tokenize", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                           json={"messages": prefill, **flags}).json()
    assert tokenized["tokens"] == ids
    with pytest.raises(openai.BadRequestError) as e:  # a new turn's header after a continued message
        client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=3,
                                       extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message"


def test_cors_answers_browsers_from_any_origin(server):
    # vLLM's defaults: any origin, method and header; a preflight needs no API key, the call itself does
    preflight = httpx.options(f"{server}/v1/chat/completions", timeout=10, headers={
        "Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    r = httpx.get(f"{server}/v1/models", headers={"Origin": "http://ui.example"}, timeout=10)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"  # an error a page can read
    r = httpx.get(f"{server}/v1/models", headers={"Origin": "http://ui.example", "Authorization": f"Bearer {KEY}"},
                  timeout=10)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_n_two(client):
    r = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=12, temperature=1.0, n=2, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.message.content for c in r.choices)


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy picks the top token


def test_stop_string(client):
    r = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=20, temperature=0, stop=["Paris"])
    assert "Paris" not in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    s = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=20, temperature=0, stop=["Paris"],
                                       stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == r.choices[0].message.content


def test_cached_tokens_on_repeated_long_prompt(client):
    long_msgs = [{"role": "system", "content": "You are a careful assistant. " * 30}, *Q]
    client.chat.completions.create(model=MODEL, messages=long_msgs, max_tokens=2, temperature=0)
    r = client.chat.completions.create(model=MODEL, messages=long_msgs, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= 160
    salted = client.chat.completions.create(model=MODEL, messages=long_msgs, max_tokens=2, temperature=0,
                                            extra_body={"cache_salt": "tenant-b"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_completions_text_and_token_ids(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                  logprobs=2)
    assert r.object == "text_completion" and r.choices[0].text
    assert len(r.choices[0].logprobs.tokens) == r.usage.completion_tokens
    ids = client.post("/../tokenize", body={"prompt": "The capital of France is"}, cast_to=httpx.Response).json()
    r2 = client.completions.create(model=MODEL, prompt=ids["tokens"], max_tokens=5, temperature=0)
    assert r2.choices[0].text == r.choices[0].text
    s = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                  stream=True)
    assert "".join(c.choices[0].text for c in s if c.choices) == r.choices[0].text


def test_errors_map_to_sdk_exceptions(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=Q, temperature=-1)
    assert "temperature" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 3000}])
    assert "maximum context length is 2048" in e.value.message and "prompt has" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=Q, max_tokens=5000)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=Q)
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=Q)
    raw = httpx.post(f"{server}/v1/chat/completions", json={"messages": "nope"},
                     headers={"Authorization": f"Bearer {KEY}"})
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}
    # a batch of prompts is checked whole before any runs: one empty or out-of-vocabulary prompt is a 400
    for prompts, words in (([[1, 2, 3], []], "empty"), ([[1, 2], [5, 10**7]], "out of range")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=prompts, max_tokens=3)
        assert words in e.value.message and e.value.param == "prompt"
    # the engine is unharmed
    assert client.chat.completions.create(model=MODEL, messages=Q, max_tokens=3).choices


def test_admin_endpoints(server):
    assert httpx.get(f"{server}/health").status_code == 200
    assert httpx.get(f"{server}/version").json()["version"]
    h = {"Authorization": f"Bearer {KEY}"}
    toks = httpx.post(f"{server}/tokenize", json={"prompt": "hello world"}, headers=h).json()
    assert toks["count"] == len(toks["tokens"]) > 0
    assert httpx.post(f"{server}/detokenize", json={"tokens": toks["tokens"]}, headers=h).json()["prompt"] \
        == "hello world"
    for name in ("deepinfer:num_requests_running", "deepinfer:num_requests_waiting", "deepinfer:kv_cache_usage_perc",
                 "deepinfer:prefix_cache_queries_total", "deepinfer:prefix_cache_hits_total",
                 "deepinfer:prompt_tokens_total", "deepinfer:generation_tokens_total",
                 "deepinfer:time_to_first_token_seconds_count", "deepinfer:inter_token_latency_seconds_count",
                 "deepinfer:e2e_request_latency_seconds_count", "deepinfer:request_queue_time_seconds_count",
                 "deepinfer:cost_model_coefficient", "deepinfer:step_time_seconds",
                 "deepinfer:step_time_predicted_seconds", "deepinfer:step_time_prediction_abs_error_ema",
                 "deepinfer:step_time_budget_seconds", "deepinfer:step_time_budget_utilization",
                 "deepinfer:step_idle_gap_seconds_total", "deepinfer:step_idle_gaps_total",
                 "deepinfer:step_idle_gap_last_seconds"):
        metric(server, name)
    assert metric(server, "deepinfer:step_idle_gaps_total") > 0  # consecutive steps of earlier requests
    # the engine process froze what start-up built (the model's modules and tensors alone are thousands)
    assert metric(server, "deepinfer:engine_gc_frozen_objects") > 10_000
    metric(server, "deepinfer:engine_gc_full_collections_total")
    assert metric(server, "deepinfer:step_time_budget_seconds") > 0
    assert metric(server, "deepinfer:generation_tokens_total") > 0


def _wait_idle(server: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(server, "deepinfer:num_requests_running") == 0 and \
                metric(server, "deepinfer:kv_cache_blocks_used") == 0:
            return
        time.sleep(0.2)
    raise AssertionError("requests still running / KV blocks still used after the client left")


def test_stream_closed_halfway_frees_everything(client, server):
    _wait_idle(server)
    stream = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=500, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 5:
            break
    assert metric(server, "deepinfer:num_requests_running") == 1
    stream.close()
    _wait_idle(server)
    assert metric(server, 'deepinfer:request_success_total') >= 1


def test_abandoned_non_streaming_request_is_aborted(server):
    _wait_idle(server)

    async def abandon():
        async with httpx.AsyncClient(timeout=1.5) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post(f"{server}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                             json={"messages": Q, "max_tokens": 1000, "ignore_eos": True})

    asyncio.run(abandon())
    _wait_idle(server)
