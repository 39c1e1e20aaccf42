"""LoRA adapters behind the real server (the default model, float32), through the official `openai` and
`anthropic` SDKs: `/v1/models` lists them, a request naming one as its `model` equals peft's model of the default
model with that adapter (streamed or not, Chat Completions, Completions, Responses and Anthropic Messages) and
reports its name, requests for the base model and two adapters run together unchanged, and adapters are added and removed while
serving (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter)."""

from __future__ import annotations

import concurrent.futures
import functools

import anthropic
import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from tests.lora.adapters import ALL_PROJECTIONS, peft_model, write_adapter
from tests.server_utils import KEY, SHARED_SERVER_FLAGS, metric, running_server

Q = [{"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 24
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def adapter_dirs(default_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    # small random adapters: they change the reply, and it stays text
    return {"colours": write_adapter(default_model_dir, root / "colours", ALL_PROJECTIONS, rank=8, alpha=16, seed=3,
                                     std=0.05),
            "terse": write_adapter(default_model_dir, root / "terse", ["q_proj", "v_proj", "down_proj"], rank=4,
                                   alpha=4, seed=4, std=0.08)}


@pytest.fixture(scope="module")
def server(adapter_dirs, tmp_path_factory):
    log = tmp_path_factory.mktemp("srv") / "server.log"
    with running_server(*SHARED_SERVER_FLAGS, "--enable-lora", "--lora-modules",
                        f"colours={adapter_dirs['colours']}", "--max-loras", "2", log=log) as base:
        yield base


@functools.cache
def _model(default_model_dir, adapter):
    """peft's model of the default model with `adapter` (None: transformers' model alone), loaded once."""
    if adapter is not None:
        return peft_model(default_model_dir, adapter, stop_at_eos=True)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()


def _reference(default_model_dir, adapter, prompt_ids: list[int]) -> str:
    """peft's greedy reply (stopping at EOS, as the server does), as text."""
    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    model = _model(default_model_dir, adapter)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return tok.decode(out[0, len(prompt_ids):], skip_special_tokens=True)


def _chat_ids(base: str) -> list[int]:
    r = httpx.post(f"{base}/tokenize", headers=AUTH, json={"messages": Q}, timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


def test_models_lists_adapters(server, adapter_dirs):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
    models = {m.id: m for m in client.models.list().data}
    base = next(iter(models))
    assert set(models) == {base, "colours"}
    card = models["colours"].model_dump()
    assert card["parent"] == base and card["root"] == str(adapter_dirs["colours"])
    assert client.models.retrieve("colours").id == "colours"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=Q, max_tokens=4)


def test_adapter_replies_equal_peft(server, adapter_dirs, default_model_dir):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)
    ids = _chat_ids(server)
    want = _reference(default_model_dir, adapter_dirs["colours"], ids)
    base_want = _reference(default_model_dir, None, ids)
    assert want != base_want  # the adapter changes the reply
    r = client.chat.completions.create(model="colours", messages=Q, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == want and r.model == "colours"
    stream = client.chat.completions.create(model="colours", messages=Q, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert {c.model for c in chunks} == {"colours"}
    base_name = client.models.list().data[0].id
    r = client.chat.completions.create(model=base_name, messages=Q, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == base_want
    c = client.completions.create(model="colours", prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert c.choices[0].text == want and c.model == "colours"
    resp = client.responses.create(model="colours", input=Q, max_output_tokens=MAX_TOKENS, temperature=0)
    assert resp.output_text == want and resp.model == "colours"
    a = anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=120)
    # this SDK version has no temperature parameter: greedy decoding goes in extra_body
    m = a.messages.create(model="colours", messages=Q, max_tokens=MAX_TOKENS, extra_body={"temperature": 0})
    assert m.content[0].text == want and m.model == "colours"


def test_load_mixed_batch_and_unload(server, adapter_dirs, default_model_dir):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)
    r = httpx.post(f"{server}/v1/load_lora_adapter", headers=AUTH, timeout=60,
                   json={"lora_name": "terse", "lora_path": str(adapter_dirs["terse"])})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server}/v1/load_lora_adapter", headers=AUTH, timeout=60,
                   json={"lora_name": "terse", "lora_path": str(adapter_dirs["terse"])})
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/load_lora_adapter", headers=AUTH, timeout=60,
                   json={"lora_name": "broken", "lora_path": "/nonexistent"})
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
    assert {m.id for m in client.models.list().data} >= {"colours", "terse"}
    ids = _chat_ids(server)
    base_name = client.models.list().data[0].id
    want = {"terse": _reference(default_model_dir, adapter_dirs["terse"], ids),
            "colours": _reference(default_model_dir, adapter_dirs["colours"], ids),
            base_name: _reference(default_model_dir, None, ids)}
    names = [base_name, "terse", "colours", "terse", base_name, "colours"]

    def ask(name: str) -> str:
        r = client.chat.completions.create(model=name, messages=Q, max_tokens=MAX_TOKENS, temperature=0)
        return r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        replies = list(pool.map(ask, names))
    assert replies == [want[n] for n in names]
    assert metric(server, "deepinfer:lora_adapters_loaded") == 2
    assert metric(server, "deepinfer:lora_requests_running") == 0
    r = httpx.post(f"{server}/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "terse"}, timeout=60)
    assert r.status_code == 200, r.text
    assert metric(server, "deepinfer:lora_adapters_loaded") == 1
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="terse", messages=Q, max_tokens=4)
    r = httpx.post(f"{server}/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "terse"}, timeout=60)
    assert r.status_code == 404
    assert "terse" not in {m.id for m in client.models.list().data}
    # unauthenticated callers cannot change what is served
    r = httpx.post(f"{server}/v1/load_lora_adapter", timeout=60,
                   json={"lora_name": "terse", "lora_path": str(adapter_dirs["terse"])})
    assert r.status_code == 401
