"""`deepinfer serve` on a tiny random DeepSeek-V4 checkpoint answers a completion, a chat (openai SDK) and
an Anthropic message (anthropic SDK) with the tokens of transformers' full forward (greedy, float32)."""

from __future__ import annotations

import anthropic
import httpx
import openai
import torch

from tests.models.v4_tiny import build_v4, hf_full_logits
from tests.server_utils import running_server


def _greedy_chain(hf, prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(torch.argmax(hf_full_logits(hf, prompt + out)[-1])))
    return out


def test_serve_v4_completion_chat_and_messages(tmp_path, default_model_dir):
    path = tmp_path / "tiny-v4"
    hf = build_v4(path, seed=4, tokenizer_dir=default_model_dir)
    prompt = [7, 901, 33, 4120, 77, 15, 2048, 9, 610, 12, 3141, 5926, 53, 5]  # crosses window and groups
    expected = _greedy_chain(hf, prompt, 8)
    with running_server("--model", str(path), "--dtype", "float32", "--kv-cache-memory", "16MiB",
                        "--max-model-len", "512") as base:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 1}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["prompt_tokens"] == len(prompt) and out["usage"]["completion_tokens"] == 8
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
        assert out["choices"][0]["text"] == tok.decode(expected)
        assert len(out["choices"][0]["logprobs"]["tokens"]) == 8
        # chat and Anthropic messages: the same conversation through the tokenizer's chat template
        from deepinfer.recipe.tokenizer import render_chat

        messages = [{"role": "user", "content": "Where do compressed entries live?"}]
        want = tok.decode(_greedy_chain(hf, render_chat(tok, messages), 6), skip_special_tokens=True)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                              extra_body={"ignore_eos": True})
        assert chat.choices[0].message.content == want
        msg = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=120).messages.create(
            model=model, max_tokens=6, messages=messages, extra_body={"temperature": 0, "ignore_eos": True})
        assert msg.content[0].text == want and msg.usage.output_tokens == 6
