"""Speculative decoding on a DeepSeek-V4 with compressed layers (CSA ratio 4 with its indexer, HCA ratio 8)
and a 6-token sliding window: greedy output token-identical with and without speculation for the
corrupted-oracle, n-gram and MTP proposers, with 8-token prefill chunks, 4-token blocks, a prefix hit
on blocks computed under speculation, and preemption. The oracle's drafts are often wrong, so verification steps complete
compression groups with rejected tokens (counted, so the test cannot pass vacuously); those entries,
indexer keys and compressor rows must never reach a kept token."""

from __future__ import annotations

import pytest

from deepinfer import LLM
from tests.engine.spec_utils import CorruptedOracle, assert_all_free, greedy, spec_config, token_ids
from tests.models.v4_mtp_tiny import build_v4_with_mtp
from tests.models.v4_tiny import CSA, HCA, SWA

# layer 1 is a sliding top-k MoE layer: the MTP block copies its tensors (tests/models/v4_mtp_tiny.py)
SPEC = dict(layer_types=[SWA, SWA, CSA, HCA], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
            num_hidden_layers=4, compress_rates={CSA: 4, HCA: 8})
RATIOS = (4, 8)
# repetitive prompts (n-gram matches), one past the window and several compression groups, one short
PROMPTS = [[5 + (i % 7) for i in range(30)], [3, 4, 5] * 5, list(range(10, 37)), [7, 9]]


@pytest.fixture(scope="module")
def v4c(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4c_spec") / "m"
    build_v4_with_mtp(path, seed=5, **SPEC)
    return path


def _llm(path, spec: dict | None = None, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "16MiB")
    kw.setdefault("profile_cost_model", False)
    kw.setdefault("max_num_batched_tokens", 8)
    kw.setdefault("block_size", 4)
    return LLM(str(path), dtype="float32", speculative_config=spec, **kw)


def _count_rejected_group_ends(llm: LLM) -> list[int]:
    """Wrap the speculator so each verification logs how many compression groups were completed by a
    rejected draft's position (the drafts of a step sit at positions num_computed - drafted .. - 1)."""
    spec = llm.engine.core.speculator
    log: list[int] = []
    inner = spec.verified

    def verified(req, drafted, accepted):
        first = req.num_computed_tokens - drafted
        log.append(sum(1 for p in range(first + accepted, first + drafted) for m in RATIOS if (p + 1) % m == 0))
        return inner(req, drafted, accepted)

    spec.verified = verified
    return log


def _run(path, method: str, prompts, max_tokens: int, reference, noise: float = 0.5, **kw):
    llm = _llm(path, spec_config("ngram" if method == "oracle" else method, k=5, prompt_lookup_min=1), **kw)
    if method == "oracle":
        llm.engine.core.speculator.proposer = CorruptedOracle(
            {tuple(p): r for p, r in zip(prompts, reference, strict=True)}, llm.engine.vocab_size, noise=noise)
    log = _count_rejected_group_ends(llm)
    assert token_ids(llm, prompts, greedy(max_tokens)) == reference
    assert llm.engine.core.speculator.metrics.num_verifications > 0
    assert_all_free(llm)
    return llm, log


def test_oracle_rejections_across_compression_groups_fast(v4c):
    """The default suite's check: drafts that complete compression groups and are rejected."""
    reference = token_ids(_llm(v4c), PROMPTS[:1], greedy(16))
    _, log = _run(v4c, "oracle", PROMPTS[:1], 16, reference)
    assert sum(log) > 0, "no rejected draft completed a compression group"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["oracle", "ngram", "mtp"])
def test_greedy_identical_compressed_v4(v4c, method):
    reference = token_ids(_llm(v4c), PROMPTS, greedy(32))
    llm, log = _run(v4c, method, PROMPTS, 32, reference)
    m = llm.engine.core.speculator.metrics
    assert m.num_draft_tokens > m.num_accepted_tokens, "no draft was rejected"
    if method == "oracle":
        assert sum(log) >= 5
    else:  # a random model's own proposers: rejections at group ends happen too
        assert sum(log) > 0


@pytest.mark.slow
def test_prefix_hit_on_blocks_computed_under_speculation(v4c):
    """Prompt + output as new prompts hit the compressed blocks the speculative run registered; the
    continuation equals the plain engine's."""
    reference = token_ids(_llm(v4c), PROMPTS, greedy(32))
    llm, log = _run(v4c, "oracle", PROMPTS, 32, reference)
    assert sum(log) > 0
    longer = [p + r[:24] for p, r in zip(PROMPTS, reference, strict=True)]
    plain = token_ids(_llm(v4c, enable_prefix_caching=False), longer, greedy(12))
    outs = llm.generate(longer, greedy(12))
    assert [list(o.outputs[0].token_ids) for o in outs] == plain
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert_all_free(llm)


@pytest.mark.slow
def test_preemption(v4c):
    """A KV budget of a few blocks: requests are preempted (and recomputed) while drafting. Prefix caching
    off: a re-admitted request would otherwise hit its own compressed blocks and replay a bounded window
    (`--swa-replay-tokens`), an approximation by design (docs/deepseek_v4.md), in either engine."""
    reference = token_ids(_llm(v4c), PROMPTS, greedy(40))
    llm, log = _run(v4c, "oracle", PROMPTS, 40, reference, kv_cache_memory="32KiB", max_model_len=128,
                    enable_prefix_caching=False)
    assert llm.engine.core.scheduler.num_preemptions > 0 and sum(log) > 0
