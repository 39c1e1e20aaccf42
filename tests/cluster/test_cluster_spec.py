"""Speculative decoding in a real 1 prefill + 1 decode cluster (`deepinfer serve --prefill-workers 1
--decode-workers 1 --speculative-config ...`: a router and two worker processes): the decode worker drafts
and verifies, and greedy output is token-identical to a unified server without speculation (fp32): a tiny
Llama with the n-gram proposer, and a tiny DeepSeek-V4 with compressed layers (CSA + HCA + sliding window)
with its MTP layer, whose decode worker starts from shipped KV (no target streams for the prompt). The router's /metrics carries the decode worker's speculative-decoding
metrics, labelled by proposer, with the acceptance rate recomputed from the summed counters."""

from __future__ import annotations

import json
import time

import pytest

from tests.server_utils import (
    cluster_workers,
    greedy_completion_tokens,
    metric,
    running_cluster,
    running_server,
)

FLAGS = ("--dtype", "float32", "--kv-cache-memory", "32MiB", "--no-profile-cost-model", "--max-model-len", "512",
         "--block-size", "4", "--health-interval", "0.5")
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "adaptive": False, "prompt_lookup_min": 1})
MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 3, "adaptive": False})
# repetitive prompts: the n-gram proposer finds matches in them (and in a random model's output)
PROMPTS = [[5 + (i % 7) for i in range(40)], [100 + (i % 5) * 3 for i in range(23)], [7, 8, 9, 10, 11, 12] * 6]


def _complete(base: str) -> list[list[str]]:
    return greedy_completion_tokens(base, PROMPTS, 32)


def _samples(base: str, name: str) -> dict[str, float]:
    """A metric's samples by their label text, from a real /metrics page."""
    import httpx

    out = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name):].rsplit(" ", 1)
            out[labels] = float(value)
    return out


def _v4(tmp_path, default_model_dir) -> str:
    from tests.engine.test_spec_v4_compressed import SPEC as V4_SPEC
    from tests.models.v4_mtp_tiny import build_v4_with_mtp

    path = tmp_path / "tiny-v4"
    build_v4_with_mtp(path, seed=5, tokenizer_dir=default_model_dir, **V4_SPEC)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("arch,spec", [("llama", SPEC), ("deepseek_v4", MTP)])
def test_speculative_decode_worker_is_token_identical_and_the_router_shows_its_metrics(
        arch, spec, tiny_models, default_model_dir, tmp_path):
    model = str(tiny_models[arch]) if arch in tiny_models else _v4(tmp_path, default_model_dir)
    with running_server("--model", model, *FLAGS, log=tmp_path / "unified.log") as base:
        want = _complete(base)
    with running_cluster("--model", model, *FLAGS, "--prefill-workers", "1", "--decode-workers", "1",
                         "--speculative-config", spec, log=tmp_path / "cluster.log") as base:
        assert _complete(base) == want
        workers = {w["role"]: w["url"] for w in cluster_workers(base)}
        # only the decode worker speculates
        drafts = metric(workers["decode"], "deepinfer:spec_decode_num_draft_tokens_total")
        accepted = metric(workers["decode"], "deepinfer:spec_decode_num_accepted_tokens_total")
        assert drafts > accepted and (accepted > 0 or arch == "deepseek_v4")  # a random MTP layer may miss all
        with pytest.raises(KeyError):
            metric(workers["prefill"], "deepinfer:spec_decode_num_draft_tokens_total")
        # the router's /metrics: the worker's counters (its load snapshot refreshes every health interval)
        # (the draft-length histogram too: it counts steps that chose no drafts, which move no token counter, so
        # a snapshot taken after the last drafting step but before a last k = 0 step matched the totals alone)
        deadline = time.monotonic() + 10
        worker_hist = _samples(workers["decode"], "deepinfer:spec_decode_draft_length_bucket")
        while (metric(base, "deepinfer:spec_decode_num_draft_tokens_total") != drafts
               or _samples(base, "deepinfer:spec_decode_draft_length_bucket") != worker_hist):
            assert time.monotonic() < deadline, "the router's spec metrics never caught up with the worker's"
            time.sleep(0.25)
        rate = _samples(base, "deepinfer:spec_decode_acceptance_rate")
        assert len(rate) == 1 and next(iter(rate)).endswith(f'proposer="{json.loads(spec)["method"]}"}}')
        assert next(iter(rate.values())) == pytest.approx(accepted / drafts)
        assert metric(base, "deepinfer:spec_decode_num_accepted_tokens_total") == accepted
        mean = metric(base, "deepinfer:spec_decode_mean_accepted_length")
        assert mean == pytest.approx(metric(workers["decode"], "deepinfer:spec_decode_mean_accepted_length"))
        assert mean >= 1
        hist = _samples(base, "deepinfer:spec_decode_draft_length_bucket")
        assert hist == _samples(workers["decode"], "deepinfer:spec_decode_draft_length_bucket")
        assert len(hist) == json.loads(spec)["num_speculative_tokens"] + 2  # k = 0 .. K_MAX and +Inf
