"""SWA bounded replay through the server: a model with full and sliding-window layers, served twice over
one KV store; the second server finds the prompt's full-layer KV in the store, replays the window, and
reports it in the API's usage and in /metrics (tiny random Qwen2, fp32)."""

from __future__ import annotations

import random

import httpx
import openai

from tests.server_utils import metric, running_server


def test_replayed_tokens_in_usage_and_metrics(tiny_models, tmp_path):
    model = tiny_models["qwen2_swa"]  # layer 0 full, layers 1-2 a window of 12
    rng = random.Random(3)
    prefix = [rng.randrange(3, 49152) for _ in range(40)]
    args = ("--model", str(model), "--dtype", "float32", "--kv-cache-memory", "16MiB", "--block-size", "4",
            "--kv-store", str(tmp_path / "store"), "--kv-store-admit", "always", "--max-model-len", "512")
    with running_server(*args) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        first = client.completions.create(model=client.models.list().data[0].id, prompt=prefix, max_tokens=4,
                                          temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
    # the first server flushed its blocks to the store when it stopped; the second starts with an empty device
    with running_server(*args) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        out = client.completions.create(model=client.models.list().data[0].id, prompt=prefix + [5, 6, 7],
                                        max_tokens=4, temperature=0)
        details = out.usage.prompt_tokens_details
        assert details.cached_tokens == 40
        assert details.model_extra["replayed_tokens"] == 12  # 40 - 12 = 28: a block boundary
        assert metric(base, "deepinfer:swa_replayed_tokens_total") == 12
        # without a replay the usage keeps OpenAI's shape
        again = httpx.post(f"{base}/v1/completions", json={"prompt": prefix + [5, 6, 7], "max_tokens": 2},
                           timeout=60).json()
        assert "replayed_tokens" not in again["usage"]["prompt_tokens_details"]
