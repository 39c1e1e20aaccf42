"""Gemma 3 behind the real server, through the official `openai` and `anthropic` SDKs.

A model without a chat template (a base model, like the Gemma 3 270M GGUF) serves completions and answers
chat requests of every API with a 400 naming --chat-template; with `--chat-template FILE` chat, Responses and
Anthropic Messages work. The default suite checks this on a tiny random Gemma 3 whose tokenizer has no
template; the slow tests on the real GGUF (skipped when its package is not installed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.server_utils import running_server

# Gemma's turn format (<start_of_turn>role ... <end_of_turn>, the assistant's role named "model"); a system
# message is put before the first user turn's text
GEMMA_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system='') -%}
{%- for m in messages -%}
{%- if m['role'] == 'system' -%}
{%- set ns.system = m['content'] ~ '\\n\\n' -%}
{%- else -%}
{{ '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else 'user') ~ '\\n' }}
{%- if m['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif -%}
{{ m['content'] | trim }}{{ '<end_of_turn>\\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif -%}
"""
Q = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the capital of France?"}]
ARGS = ("--dtype", "float32", "--kv-cache-memory", "256MiB", "--max-model-len", "2048")


def _without_chat_template(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tpl") / "gemma.jinja"
    path.write_text(GEMMA_TEMPLATE)
    return path


def _assert_chat_refused(base: str, model: str) -> None:
    """Chat Completions, Responses, Anthropic Messages (and /tokenize of messages): a 400 saying what to do."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="--chat-template"):
        client.chat.completions.create(model=model, messages=Q, max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="--chat-template"):
        client.chat.completions.create(model=model, messages=Q, max_tokens=5, stream=True)
    with pytest.raises(openai.BadRequestError, match="--chat-template"):
        client.responses.create(model=model, input="Hi", max_output_tokens=5)
    aclient = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError, match="--chat-template"):
        aclient.messages.create(model=model, max_tokens=5, messages=Q[1:])
    r = httpx.post(f"{base}/tokenize", json={"messages": Q}, timeout=30)
    assert r.status_code == 400 and "--chat-template" in r.text
    # completions need no template
    done = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
    assert done.usage.completion_tokens == 4


# ---------------------------------------------------------------- tiny random Gemma 3 (default suite)


@pytest.fixture(scope="module")
def tiny_base(tiny_models, tmp_path_factory) -> Path:
    return _without_chat_template(tiny_models["gemma3"], tmp_path_factory.mktemp("g3") / "tiny-gemma3")


def test_tiny_model_without_template_refuses_chat_with_400(tiny_base):
    with running_server("--model", str(tiny_base), *ARGS) as base:
        _assert_chat_refused(base, "tiny-gemma3")


def test_tiny_model_with_chat_template_file_serves_chat(tiny_base, template_file):
    with running_server("--model", str(tiny_base), "--chat-template", str(template_file), *ARGS) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="tiny-gemma3", messages=Q, max_tokens=6, temperature=0)
        assert r.usage.completion_tokens == 6
        ids = httpx.post(f"{base}/tokenize", json={"messages": Q}, timeout=30).json()["tokens"]
        assert r.usage.prompt_tokens == len(ids)
        text = httpx.post(f"{base}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
        assert "<start_of_turn>user\nAnswer briefly.\n\nWhat is the capital" in text
        assert text.endswith("<start_of_turn>model\n")


@pytest.mark.slow  # a server of its own for one field
def test_documents_reach_the_chat_template(tiny_base, tmp_path):
    # vLLM's `documents` (RAG templates render them); the template here writes each before the messages
    template = tmp_path / "rag.jinja"
    template.write_text("{% for d in documents or [] %}[{{ d['title'] }}: {{ d['text'] }}]\n{% endfor %}"
                        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    with running_server("--model", str(tiny_base), "--chat-template", str(template), *ARGS) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        docs = [{"title": "Paris", "text": "the capital of France"}, {"title": "Rome", "text": "the capital of Italy"}]
        r = client.chat.completions.create(model="tiny-gemma3", messages=Q, max_tokens=2, extra_body={"documents": docs})
        text = "".join(f"[{d['title']}: {d['text']}]\n" for d in docs) + "".join(
            f"{m['role']}: {m['content']}\n" for m in Q)
        ids = httpx.post(f"{base}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30).json()
        assert r.usage.prompt_tokens == ids["count"]
        plain = client.chat.completions.create(model="tiny-gemma3", messages=Q, max_tokens=2)
        assert plain.usage.prompt_tokens < r.usage.prompt_tokens


def test_missing_chat_template_file_fails_at_start(tiny_base, tmp_path):
    with pytest.raises(RuntimeError, match="server exited"), \
            running_server("--model", str(tiny_base), "--chat-template", str(tmp_path / "nope.jinja"), *ARGS,
                           timeout=60):
        pass


# ---------------------------------------------------------------- Gemma 3 270M GGUF (slow)


@pytest.mark.slow
def test_gguf_without_template_serves_completions_and_refuses_chat(gemma3_gguf):
    with running_server("--model", str(gemma3_gguf), *ARGS, timeout=400) as base:
        _assert_chat_refused(base, "gemma-3-270m-q4_k_m")


@pytest.mark.slow
def test_gguf_with_template_answers_every_api(gemma3_gguf, template_file, tmp_path):
    model = "gemma-3-270m-q4_k_m"
    with running_server("--model", str(gemma3_gguf), "--chat-template", str(template_file), *ARGS,
                        timeout=400, log=tmp_path / "server.log") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [model]

        # completions, plain and streamed (the same greedy text)
        done = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=24, temperature=0)
        assert "return" in done.choices[0].text and done.usage.completion_tokens == 24
        chunks = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=24, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text

        # chat through the template, plain and streamed
        chat = client.chat.completions.create(model=model, messages=Q, max_tokens=16, temperature=0)
        text = chat.choices[0].message.content
        assert chat.choices[0].message.role == "assistant" and text.strip()
        ids = httpx.post(f"{base}/tokenize", json={"messages": Q}, timeout=30).json()["tokens"]
        assert chat.usage.prompt_tokens == len(ids) and ids[0] == 2 and 105 in ids  # <bos>, <start_of_turn>
        stream = client.chat.completions.create(model=model, messages=Q, max_tokens=16, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text

        # Responses, plain and streamed
        r = client.responses.create(model=model, input=Q[1:], instructions="Answer briefly.", max_output_tokens=16,
                                    temperature=0)
        assert r.status in ("completed", "incomplete") and r.output_text.strip()
        events = list(client.responses.create(model=model, input=Q[1:], instructions="Answer briefly.",
                                              max_output_tokens=16, temperature=0, stream=True))
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert events[-1].response.output_text == r.output_text

        # Anthropic Messages, plain and streamed
        aclient = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=120)
        m = aclient.messages.create(model=model, max_tokens=16, system="Answer briefly.", messages=Q[1:],
                                    extra_body={"temperature": 0})
        assert m.content[0].type == "text" and m.content[0].text.strip() and m.usage.output_tokens > 0
        with aclient.messages.stream(model=model, max_tokens=16, system="Answer briefly.", messages=Q[1:],
                                     extra_body={"temperature": 0}) as s:
            assert "".join(s.text_stream) == m.content[0].text
