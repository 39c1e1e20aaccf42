"""Reasoning separated from the answer, on a real server running a tiny random "thinking" model.

The model is Qwen3-shaped with a 14-token word-level vocabulary, `<think>` / `</think>` as added
(non-special) tokens, and a chat template that opens `<think>` in the generation prompt (as
DeepSeek-R1 does). A random model writes random words, but with so few tokens it writes `</think>`
within a few dozen steps for most seeds. The reference is the same prompt and seed through
/v1/completions (no parsing): everything before the first `</think>` must come back as reasoning,
everything after it as the answer, in every API, streaming or not.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
import torch

from tests.server_utils import running_server

MODEL = "tiny-thinker"
MSGS = [{"role": "user", "content": "hello world"}]
SEEDS = range(8)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


def _build(path):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "alpha", "beta", "gamma", "delta", "user", "assistant", "system", "hello", "world"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    backend.add_tokens(["<think>", "</think>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>",
                                  pad_token="<unk>")
    tok.chat_template = TEMPLATE
    cfg = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                                   max_position_embeddings=512, eos_token_id=tok.eos_token_id,
                                   bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"), tie_word_embeddings=False)
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("thinker")
    model = _build(root / "model")
    with running_server("--model", str(model), "--served-model-name", MODEL, "--dtype", "float32",
                        "--kv-cache-memory", "32MiB", "--max-model-len", "512", log=root / "server.log") as base:
        yield base


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def prompt_ids(server):
    return httpx.post(f"{server}/tokenize", json={"messages": MSGS}, timeout=30).json()["tokens"]


def reference(oai, prompt_ids, seed: int, ignore_eos: bool) -> tuple[str, str, int]:
    """(reasoning, answer, reasoning tokens) from the raw completion of the same prompt and seed."""
    r = oai.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=40, temperature=1.0, seed=seed, logprobs=0,
                               extra_body={"ignore_eos": ignore_eos})
    text, tokens = r.choices[0].text, r.choices[0].logprobs.tokens
    before, tag, after = text.partition("</think>")
    n = tokens.index("</think>") + 1 if "</think>" in tokens else len(tokens)
    return before.lstrip(), after.lstrip() if tag else "", n


def test_the_server_detected_the_think_parser(server):
    r = httpx.post(f"{server}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": MSGS, "max_tokens": 3, "temperature": 0})
    assert "reasoning_content" in r.json()["choices"][0]["message"]


def test_chat_reasoning_content(oai, prompt_ids):
    closed = 0
    for seed in SEEDS:
        want_reasoning, want_content, n = reference(oai, prompt_ids, seed, ignore_eos=True)
        kwargs = dict(model=MODEL, messages=MSGS, max_tokens=40, temperature=1.0, seed=seed,
                      extra_body={"ignore_eos": True})
        r = oai.chat.completions.create(**kwargs)
        msg = r.choices[0].message
        extra = msg.model_extra
        assert (extra["reasoning_content"] or "") == want_reasoning == (extra["reasoning"] or "")
        assert msg.content == want_content
        assert r.usage.completion_tokens_details.reasoning_tokens == n
        chunks = list(oai.chat.completions.create(stream=True, **kwargs))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == want_reasoning
        assert "".join(d.content or "" for d in deltas) == want_content
        closed += bool(want_content)
    assert closed >= 2, "too few seeds closed the thinking section to test the split"


def test_responses_reasoning_item(oai, prompt_ids):
    closed = 0
    for seed in SEEDS:
        want_reasoning, want_content, n = reference(oai, prompt_ids, seed, ignore_eos=False)
        kwargs = dict(model=MODEL, input=MSGS[0]["content"], max_output_tokens=40, temperature=1.0,
                      extra_body={"seed": seed})
        r = oai.responses.create(**kwargs)
        kinds = [o.type for o in r.output]
        if want_reasoning:
            assert kinds[0] == "reasoning" and r.output[0].content[0].text == want_reasoning
        assert r.output_text == want_content
        assert r.usage.output_tokens_details.reasoning_tokens == n
        events = list(oai.responses.create(stream=True, **kwargs))
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == want_reasoning
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want_content
        assert events[-1].response.output_text == want_content
        closed += bool(want_reasoning and want_content)
    assert closed >= 1


def test_anthropic_thinking_blocks(server, oai, prompt_ids):
    client = anthropic.Anthropic(base_url=server, api_key="none", max_retries=0, timeout=60)
    closed = 0
    for seed in SEEDS:
        want_reasoning, want_content, _ = reference(oai, prompt_ids, seed, ignore_eos=False)
        kwargs = dict(model=MODEL, max_tokens=40, messages=MSGS, extra_body={"temperature": 1.0, "seed": seed})
        m = client.messages.create(**kwargs)
        thinking = [b.thinking for b in m.content if b.type == "thinking"]
        text = "".join(b.text for b in m.content if b.type == "text")
        assert thinking == ([want_reasoning] if want_reasoning else []) and text == want_content
        with client.messages.stream(**kwargs) as stream:
            final = stream.get_final_message()
        assert [b.model_dump(include={"type", "thinking", "text"}) for b in final.content] == \
            [b.model_dump(include={"type", "thinking", "text"}) for b in m.content]
        closed += bool(want_reasoning and want_content)
    assert closed >= 1
