"""vLLM's request extras and OpenAI's nullable fields on the real server (default model, started with a `vllm
serve` command line), through the official SDKs: `prompt_logprobs`, `truncate_prompt_tokens`, `allowed_token_ids`, `bad_words`, Completions' `best_of`; the
extras this server does not implement are a 400 naming the field; `null` for an optional field is its default."""

from __future__ import annotations

import math

import anthropic
import httpx
import openai
import pytest

from tests.server_utils import KEY, SHARED_SERVER_FLAGS, running_server

MODEL = "SmolLM2-135M-Instruct"
ALIAS = "smollm2"  # a second --served-model-name


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Started the way a `vllm serve` launch script starts vLLM (deepinfer/vllm_cli.py): the model positional,
    vLLM's tool flags, and flags that change nothing here."""
    from deepinfer.weights.loader import default_model_path

    log = tmp_path_factory.mktemp("srv") / "server.log"
    with running_server(str(default_model_path()), *SHARED_SERVER_FLAGS, "--served-model-name", MODEL, ALIAS,
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--trust-remote-code",
                        "--enforce-eager", "--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.9",
                        "--disable-log-requests", "--allowed-origins", '["http://ui.test"]', log=log) as base:
        yield base


def test_every_served_model_name_answers(client):
    assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]
    assert client.models.retrieve(ALIAS).id == ALIAS
    r = client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.model == MODEL  # responses report the first name, as vLLM's do
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_cors_only_for_the_allowed_origins(server):
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(f"{server}/v1/chat/completions", timeout=10, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})

    ok = preflight("http://ui.test")
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://ui.test"
    refused = preflight("http://other.test")
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


def _ids(client, text: str) -> list[int]:
    base = str(client.base_url).removesuffix("/").removesuffix("/v1")
    r = httpx.post(f"{base}/tokenize", json={"prompt": text}, headers={"Authorization": f"Bearer {KEY}"})
    r.raise_for_status()
    return r.json()["tokens"]


def test_null_optional_fields_take_their_defaults(server):
    """OpenAI's schemas make optional fields nullable; clients that serialize every field send nulls."""
    headers = {"Authorization": f"Bearer {KEY}"}
    nulls = {k: None for k in ("n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "stop", "seed",
                               "logit_bias", "stream", "stream_options", "logprobs", "top_logprobs", "max_tokens",
                               "min_tokens", "repetition_penalty", "ignore_eos", "tools", "tool_choice", "user")}
    r = httpx.post(f"{server}/v1/chat/completions", headers=headers, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi", "name": None}], **nulls, "max_tokens": 3})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = httpx.post(f"{server}/v1/completions", headers=headers, timeout=60, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 3, "n": None, "echo": None, "logprobs": None, "best_of": None,
        "suffix": None})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = httpx.post(f"{server}/v1/responses", headers=headers, timeout=60, json={
        "model": MODEL, "input": "hi", "max_output_tokens": 3, "store": None, "stream": None, "temperature": None})
    assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete"), r.text
    claude = anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=60)
    m = claude.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"stop_sequences": None, "stream": None, "system": None})
    assert m.content
    # a required field is still required
    r = httpx.post(f"{server}/v1/chat/completions", headers=headers, timeout=60,
                   json={"model": MODEL, "messages": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_vllm_prompt_logprobs(client, server):
    prompt = "The capital of France is Paris"
    ids = _ids(client, prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    echo = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=1,
                                     temperature=0).choices[0].logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for i, (tid, entry) in enumerate(zip(ids[1:], plp[1:], strict=True), start=1):
        # the prompt's own token (whatever its rank) and the two most likely, as vLLM returns them
        assert math.isclose(entry[str(tid)]["logprob"], echo.token_logprobs[i], abs_tol=1e-5)
        assert entry[str(tid)]["decoded_token"] == echo.tokens[i]
        assert sorted(e["rank"] for e in entry.values() if e["rank"] <= 2) == [1, 2]
        assert len(entry) == 2 + (entry[str(tid)]["rank"] > 2)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    plp = chat.model_extra["prompt_logprobs"]
    assert len(plp) == chat.usage.prompt_tokens and plp[0] is None and all(len(e) == 1 for e in plp[1:])
    for body in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 21}):
        r = httpx.post(f"{server}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_vllm_truncate_prompt_tokens_and_allowed_token_ids(client, default_model_dir):
    from transformers import AutoTokenizer

    prompt = "The capital of France is Paris, and the capital of Italy is"
    ids = _ids(client, prompt)
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                    extra_body={"truncate_prompt_tokens": 3})
    same = client.completions.create(model=MODEL, prompt=ids[-3:], max_tokens=4, temperature=0, echo=True)
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].text == same.choices[0].text  # the echo is what ran
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    allowed = tok.encode(" Rome Paris London", add_special_tokens=False)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.5, seed=4, n=3,
                                  extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    for c in r.choices:
        got = tok.encode(c.text, add_special_tokens=False)
        assert set(got) <= set(allowed) and r.usage.completion_tokens == 18, c.text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                  extra_body={"allowed_token_ids": [10**8]})
    assert e.value.body["param"] == "allowed_token_ids"


def test_completions_best_of_keeps_the_best_per_token(client):
    def mean(c) -> float:
        return sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs)

    ask = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.2, "seed": 7}
    best = client.completions.create(**ask, n=2, best_of=5, logprobs=0)
    # the same seed samples the same five candidates with n=5: best_of keeps the two of highest mean logprob
    five = client.completions.create(**ask, n=5, logprobs=0)
    ranked = sorted(five.choices, key=mean, reverse=True)
    assert len({c.text for c in five.choices}) > 2  # candidates differ, so the choice is a real one
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]] and [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == five.usage.completion_tokens  # every candidate was generated
    plain = client.completions.create(**ask, n=1, best_of=3)
    assert plain.choices[0].logprobs is None  # ranked by logprobs the client did not ask for
    for bad in ({"n": 3, "best_of": 2}, {"best_of": 2, "stream": True}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{**ask, **bad})
        assert e.value.body["param"] == "best_of"


@pytest.mark.parametrize("field, value", [("use_beam_search", True), ("chat_template", "{{ messages }}"),
                                          ("logits_processors", ["x"]), ("return_tokens_as_token_ids", True),
                                          ("echo", True), ("priority", 1)])
def test_vllm_fields_not_implemented_are_400s_not_ignored(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={field: value})
    assert e.value.body["param"] == field
    # unset (null / false) they are accepted, as clients that send every field by default do
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={field: 0 if field == "priority" else False if value is True else None})
    assert r.choices[0].message.content is not None


def test_vllm_bad_words(client):
    q = [{"role": "user", "content": "What is the capital of France?"}]
    plain = client.chat.completions.create(model=MODEL, messages=q, max_tokens=20, temperature=0)
    assert "Paris" in plain.choices[0].message.content
    r = client.chat.completions.create(model=MODEL, messages=q, max_tokens=20, temperature=0,
                                       extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in r.choices[0].message.content and r.choices[0].message.content
    for bad in (["x"] * 33, [" "], "Paris"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=q, max_tokens=2, extra_body={"bad_words": bad})
        assert e.value.status_code == 400
