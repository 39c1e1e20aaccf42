"""A 1 prefill + 1 decode cluster on a model with full and sliding-window layers (tiny random Qwen2, window
12, fp32) answers token-identically to a unified server: the prefill worker ships the full layer's blocks and
the window's sliding blocks, and the decode worker continues from them without a replay."""

from __future__ import annotations

import random

import openai

from tests.server_utils import cluster_workers, metric, running_cluster, running_server

FLAGS = ("--dtype", "float32", "--kv-cache-memory", "32MiB", "--no-profile-cost-model", "--max-model-len", "512",
         "--block-size", "4")


def test_sliding_window_model_through_prefill_and_decode_workers(tiny_models, tmp_path):
    model = str(tiny_models["qwen2_swa"])
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (9, 37, 83)]

    def complete(base: str) -> list[list[str]]:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        outs = []
        for p in prompts:
            r = client.completions.create(model=name, prompt=p, max_tokens=10, temperature=0, logprobs=1,
                                          extra_body={"ignore_eos": True})
            outs.append(r.choices[0].logprobs.tokens)
        return outs

    with running_server("--model", model, *FLAGS, log=tmp_path / "unified.log") as base:
        want = complete(base)
    with running_cluster("--model", model, *FLAGS, "--prefill-workers", "1", "--decode-workers", "1",
                         log=tmp_path / "cluster.log") as base:
        assert complete(base) == want
        decode = next(w["url"] for w in cluster_workers(base) if w["role"] == "decode")
        # the decode worker found the shipped prompts (full blocks: 9 // 4 + 37 // 4 + 83 // 4 = 31 blocks)
        assert metric(decode, "deepinfer:prefix_cache_hits_total") >= 31 * 4
        assert metric(decode, "deepinfer:swa_replayed_tokens_total") == 0
