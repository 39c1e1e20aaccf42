"""A router's speculative-decoding metrics from several workers' stats (`merge_spec_stats`): counters and
k histograms summed per proposer, ratios recomputed from the sums, workers without speculation skipped;
rendered on one Prometheus page with one sample per proposer (the real cluster: tests/cluster/test_cluster_spec.py)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.engine.spec.metrics import SpecMetrics, merge_spec_stats
from deepinfer.server.metrics import _spec_metrics


def _worker(proposer: str, max_k: int, steps: list[tuple[int, int]], hindsight: tuple[int, int] = (0, 0)) -> dict:
    m = SpecMetrics(proposer, max_k)
    for drafted, accepted in steps:
        m.chose(drafted)
        m.verified(drafted, accepted)
    if hindsight[0]:
        m.hindsight(*hindsight)
    return {"num_running": 1.0, **m.stats()}


def test_merge_per_proposer_and_render():
    busy = _worker("ngram", 4, [(4, 4)] * 9)  # acceptance 1.0 over 36 drafts
    idle = _worker("ngram", 2, [(2, 0)], hindsight=(3, 2))  # acceptance 0.0 over 2 drafts
    other = _worker("suffix", 3, [(3, 1), (1, 1)])
    merged = merge_spec_stats([busy, {"num_running": 2.0}, idle, other])
    assert set(merged) == {"ngram", "suffix"}
    ngram = merged["ngram"]
    assert (ngram["spec_draft_tokens"], ngram["spec_accepted_tokens"], ngram["spec_verifications"]) == (38, 36, 10)
    assert ngram["spec_acceptance_rate"] == pytest.approx(36 / 38)  # not the mean of 1.0 and 0.0
    assert ngram["spec_mean_accepted_length"] == pytest.approx((9 * 5 + 1) / 10)
    assert [ngram[f"spec_k_chosen_{k}"] for k in range(5)] == [0, 0, 1, 0, 9]
    assert merged["suffix"]["spec_acceptance_rate"] == pytest.approx(2 / 4)
    # proposals checked in hindsight count apart from the verifications
    assert (ngram["spec_hindsight_checks"], ngram["spec_hindsight_tried_tokens"], ngram["spec_hindsight_kept_tokens"]) == (1, 3, 2)

    class Collector:
        def collect(self):
            yield from _spec_metrics(merged, "m")

    reg = CollectorRegistry()
    reg.register(Collector())
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    rate = {s.labels["proposer"]: s.value for s in fams["deepinfer:spec_decode_acceptance_rate"].samples}
    assert rate == pytest.approx({"ngram": 36 / 38, "suffix": 0.5})
    kept = {s.labels["proposer"]: s.value for s in fams["deepinfer:spec_decode_hindsight_kept_tokens"].samples
            if s.name.endswith("_total")}
    assert kept == {"ngram": 2, "suffix": 0}
    buckets = {(s.labels["proposer"], s.labels["le"]): s.value
               for s in fams["deepinfer:spec_decode_draft_length"].samples if s.name.endswith("_bucket")}
    assert buckets[("ngram", "2.0")] == 1 and buckets[("ngram", "+Inf")] == 10 and buckets[("suffix", "3.0")] == 2
