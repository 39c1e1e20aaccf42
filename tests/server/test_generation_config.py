"""The model's generation_config.json as the sampling defaults of requests that leave a parameter unset
(`--generation-config`, as vLLM and SGLang take it), on every API of the real server and offline: a tiny random
model whose config recommends top_k = 1 (so an unset request decodes greedily) and 5 new tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anthropic
import openai
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.recipe.tokenizer import sampling_defaults
from tests.server_utils import running_server

MODEL = "tiny-recommended"
MSGS = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def model_dir(tiny_models, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gen") / MODEL
    shutil.copytree(tiny_models["llama"], path)
    gen = path / "generation_config.json"
    config = json.loads(gen.read_text()) if gen.is_file() else {}
    gen.write_text(json.dumps({**config, "do_sample": True, "top_k": 1, "max_new_tokens": 5}))
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("srv") / "server.log"
    with running_server("--model", str(model_dir), "--dtype", "float32", "--kv-cache-memory", "64MiB",
                        "--max-model-len", "512", log=log) as base:
        yield base


def test_reading_a_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.05, "max_new_tokens": 300, "pad_token_id": None}))
    assert sampling_defaults("auto", tmp_path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                                   "repetition_penalty": 1.05, "max_tokens": 300}
    assert sampling_defaults("vllm", tmp_path) == {}
    assert sampling_defaults("auto", tmp_path / "elsewhere") == {}  # a model without one
    assert sampling_defaults(str(tmp_path), tmp_path / "elsewhere")["top_k"] == 20  # a directory given
    with pytest.raises(FileNotFoundError, match="generation_config.json"):
        sampling_defaults(str(tmp_path / "nope"), tmp_path)


@pytest.mark.slow  # a server of its own; test_offline_defaults checks the same defaults in the default suite
def test_unset_parameters_take_the_models_defaults(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=60)
    greedy = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, temperature=0,
                                            extra_body={"ignore_eos": True})
    unset = client.chat.completions.create(model=MODEL, messages=MSGS, extra_body={"ignore_eos": True})
    assert unset.usage.completion_tokens == 5 and unset.choices[0].message.content == greedy.choices[0].message.content
    # a request that sets the parameter gets what it set: top_k off samples from the whole vocabulary
    sampled = [client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, seed=s,
                                              extra_body={"top_k": 0, "ignore_eos": True}).choices[0].message.content
               for s in range(3)]
    assert any(text != greedy.choices[0].message.content for text in sampled)
    # Completions keep their own default length (16), as vLLM's do; Responses take the model's
    done = client.completions.create(model=MODEL, prompt="Hello", extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 16
    assert done.choices[0].text == client.completions.create(model=MODEL, prompt="Hello", max_tokens=16,
                                                             temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    r = client.responses.create(model=MODEL, input="Say something.")
    assert r.usage.output_tokens <= 5
    claude = anthropic.Anthropic(base_url=server, api_key="x", max_retries=0, timeout=60)
    m = claude.messages.create(model=MODEL, max_tokens=5, messages=MSGS)
    g = claude.messages.create(model=MODEL, max_tokens=5, messages=MSGS, extra_body={"temperature": 0})
    assert m.content[0].text == g.content[0].text


def test_offline_defaults(model_dir):
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="32MiB")
    params = llm.get_default_sampling_params()
    assert params.top_k == 1 and params.max_tokens == 5
    out = llm.generate(["Hello"])[0].outputs[0]
    greedy = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert out.token_ids == greedy.token_ids[:len(out.token_ids)]
    llm.close()
    plain = LLM(str(model_dir), dtype="float32", kv_cache_memory="32MiB", generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    plain.close()
