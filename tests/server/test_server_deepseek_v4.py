"""`deepinfer serve` on a tiny random DeepSeek-V4 checkpoint answers a completion with the tokens of
transformers' full forward (greedy, float32)."""

from __future__ import annotations

import httpx
import torch

from tests.models.v4_tiny import build_v4, hf_full_logits
from tests.server_utils import running_server


def test_serve_v4_completion(tmp_path, default_model_dir):
    path = tmp_path / "tiny-v4"
    hf = build_v4(path, seed=4, tokenizer_dir=default_model_dir)
    prompt = [7, 901, 33, 4120, 77, 15, 2048, 9, 610, 12, 3141, 5926, 53, 5]  # crosses window and groups
    expected: list[int] = []
    for _ in range(8):  # the full forward's greedy chain
        expected.append(int(torch.argmax(hf_full_logits(hf, prompt + expected)[-1])))
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
