"""A 1 prefill + 1 decode cluster on models with several kinds of KV groups answers token-identically to a
unified server (fp32): full and sliding-window layers (tiny random Qwen2, window 12), and DeepSeek-V4 (window,
compressor rows, compressed entries). The prefill worker ships every group's blocks of each position it still
holds, and the decode worker continues from them without a replay."""

from __future__ import annotations

import random

import pytest

from tests.server_utils import (
    cluster_workers,
    greedy_completion_tokens,
    metric,
    running_cluster,
    running_server,
)

FLAGS = ("--dtype", "float32", "--kv-cache-memory", "32MiB", "--no-profile-cost-model", "--max-model-len", "512",
         "--block-size", "4")


def _v4(tmp_path, default_model_dir) -> str:
    from tests.models.v4_tiny import build_v4

    path = tmp_path / "tiny-v4"
    build_v4(path, seed=5, tokenizer_dir=default_model_dir)
    return str(path)


# qwen2_swa: slow (~35 s), the window alone; deepseek_v4 also has a window and stays in the default suite
@pytest.mark.parametrize("arch", [pytest.param("qwen2_swa", marks=pytest.mark.slow), "deepseek_v4"])
def test_hybrid_kv_models_through_prefill_and_decode_workers(arch, tiny_models, default_model_dir, tmp_path):
    model = str(tiny_models[arch]) if arch in tiny_models else _v4(tmp_path, default_model_dir)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (9, 37, 83)]

    def complete(base: str) -> list[list[str]]:
        return greedy_completion_tokens(base, prompts, 10)

    with running_server("--model", model, *FLAGS, log=tmp_path / "unified.log") as base:
        want = complete(base)
    with running_cluster("--model", model, *FLAGS, "--prefill-workers", "1", "--decode-workers", "1",
                         log=tmp_path / "cluster.log") as base:
        assert complete(base) == want
        decode = next(w["url"] for w in cluster_workers(base) if w["role"] == "decode")
        # the decode worker found the shipped prompts (full blocks: 9 // 4 + 37 // 4 + 83 // 4 = 31 blocks)
        assert metric(decode, "deepinfer:prefix_cache_hits_total") >= 31 * 4
        assert metric(decode, "deepinfer:swa_replayed_tokens_total") == 0
