"""Speculative decoding's pooled acceptance (engine/spec/policy.py `PooledAcceptance`): what an engine's
earlier verifications tell a new request, and what a proposal's match length tells its draft. Decisions
only, on deterministic inputs and a fixed step-price table (no timings)."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer.config import SpeculativeMethod
from deepinfer.engine.cost_model import CostModel
from deepinfer.engine.request import Request
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.spec.ngram import find_match
from deepinfer.engine.spec.policy import (
    MAX_KEEP_PROB,
    AcceptanceStats,
    Candidate,
    DraftLengthPolicy,
    KeepCalibration,
    PooledAcceptance,
)
from deepinfer.engine.spec.speculator import Speculator
from deepinfer.engine.spec.step_price import StepPrice
from tests.engine.spec_utils import random_acceptance_stats

# the tail "5 6 7 8" occurred before (a 4-token match), followed by 9 10 11 ...
LONG_MATCH = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 20, 21, 5, 6, 7, 8]
# only the tail "7 8" occurred before (a 2-token match: 52 7 8 vs 6 7 8)
SHORT_MATCH = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 50, 51, 52, 7, 8]


def _req(rid: str, tokens: list[int]) -> Request:
    req = Request(rid, list(tokens), SamplingParams(temperature=0.0, max_tokens=64))
    req.num_computed_tokens = len(tokens) - 1
    return req


def _speculator(**method) -> Speculator:
    """k_max 8, every row 1/40 of a step (batch 1 on the C path: with a flat prior of 0.6 its drafts pay up to
    about 5)."""
    spec = Speculator(SpeculativeMethod("ngram", 8, **method), CostModel())
    spec.policy.price.seed([(r, 0.040 + 0.001 * r) for r in range(1, 301)])
    return spec


def _serve(spec: Speculator, tokens: list[int], kept: int | None, n: int, name: str,
           calibrated: bool = True) -> None:
    """`n` requests of `tokens`, each proposed once and verified keeping `kept` drafts (None: all).
    `calibrated=False`: the pool's lessons alone (the calibration forgets each verification; with it, drafts
    that keep none of what was expected soon stop being chosen, and the pool would stop learning)."""
    for i in range(n):
        req = _req(f"{name}{i}", tokens)
        k = len(spec.propose([req], 4096).get(req.request_id, []))
        assert k > 0
        spec.verified(req, k, k if kept is None else min(kept, k))
        spec.finished(req)
        if not calibrated:
            spec.calibration = KeepCalibration()


def test_the_match_lengths_are_what_the_tests_assume():
    assert find_match(LONG_MATCH, 2, 5, 8)[1] == 4
    assert find_match(SHORT_MATCH, 2, 5, 8)[1] == 2


def test_a_new_request_starts_from_what_the_engine_has_verified():
    """A fresh engine drafts what the prior pays for; after many requests kept every draft, a new request
    starts from the pooled estimates and drafts the whole proposal; after many kept none, it starts low."""
    fresh = _speculator(initial_continuation=0.6)  # a flat prior: the default's 0.75 pays all 8 here
    k_fresh = len(fresh.propose([_req("a", LONG_MATCH)], 4096)["a"])
    assert 1 <= k_fresh < 8
    good = _speculator()
    _serve(good, LONG_MATCH, None, 30, "g")
    assert good.pool.rates[0] > 0.9
    assert len(good.propose([_req("b", LONG_MATCH)], 4096)["b"]) == 8
    bad = _speculator()
    _serve(bad, LONG_MATCH, 0, 30, "x", calibrated=False)
    new = _req("c", LONG_MATCH)
    assert len(bad.propose([new], 4096).get("c", [])) < k_fresh
    assert new.spec is not None and new.spec.rates[0] < 0.2


def test_a_proposals_match_length_weighs_its_requests_estimates():
    """Long matches kept, short ones rejected at the first draft: the same request drafts more behind a
    long match than behind a short one, and its estimates themselves are not moved by the factor."""
    spec = _speculator()
    _serve(spec, LONG_MATCH, None, 20, "l")
    _serve(spec, SHORT_MATCH, 0, 20, "s", calibrated=False)
    pool = spec.pool
    long_f, short_f = pool.factors(4), pool.factors(2)
    assert long_f is not None and short_f is not None
    assert long_f[0] > 1.0 > short_f[0]
    # position 2 onwards was never reached behind a short match: its factor is the first position's
    assert np.all(short_f[1:] == short_f[0])
    assert pool.factors(3) is None  # a match length never verified: the estimates stand
    est = [0.7] * 8
    assert pool.match_probs(est, 3) == est and pool.match_probs(est, 0) == est
    assert all(p <= MAX_KEEP_PROB for p in pool.match_probs([0.95] * 8, 4))
    assert pool.match_probs([1.0] * 8, 2)[0] < 1.0 and pool.match_probs([1.0] * 8, 4)[0] == 1.0
    # the same (new) request state behind each proposal
    for tokens, want_more in ((LONG_MATCH, True), (SHORT_MATCH, False)):
        probe = _req("p", tokens)
        k = len(spec.propose([probe], 4096).get("p", []))
        assert (k >= 6) if want_more else (k <= 2), (tokens, k)


def test_the_skip_bound_covers_the_match_factors():
    """`drafts_can_pay` with the pool's boost stays an upper bound of `choose` on match-weighted
    probabilities, for random estimates, pools and match lengths."""
    # a dear row (a draft pays only if kept with probability > 0.8, 0.88 with the policy's margin) and a
    # request whose own estimate (0.7) does not pay, behind a match length kept far more often than the
    # average: only the boost lets the bound see that its draft pays
    dear = DraftLengthPolicy(CostModel())
    dear.price.seed([(r, 0.02 + 0.016 * (r - 1)) for r in range(1, 301)])
    pool = PooledAcceptance(0.6, 16)
    for _ in range(40):
        pool.observe(5, 4, 4)
        pool.observe(2, 4, 0)
    state = AcceptanceStats.new(0.6, 16, 0.075, [0.7] * 16)
    probs = pool.match_probs(state.estimates(), 5)
    assert probs[0] > 0.95 and dear.choose([Candidate(100, probs[:4])], 1)[0] > 0
    assert not dear.drafts_can_pay(1, [state.gain_ceiling()])
    assert dear.drafts_can_pay(1, [state.gain_ceiling(False, pool.boost())])

    pol = DraftLengthPolicy(CostModel())
    pol.price.c_path_rows = 8
    pol.price.seed([(r, 0.008 + 0.0017 * r if r <= 8 else 0.025 + 0.014 * ((r - 1) // 16)) for r in range(1, 301)])
    rng = np.random.default_rng(1)
    drafted_somewhere = 0
    for _ in range(300):
        pool = PooledAcceptance(0.6, 16)
        for _ in range(int(rng.integers(0, 40))):
            d = int(rng.integers(1, 17))
            match = int(rng.integers(0, 6))
            keep = rng.random() < (0.2 + 0.15 * match)
            pool.observe(match, d, d if keep else int(rng.integers(0, d)))
        b = int(rng.integers(1, 40))
        stats = random_acceptance_stats(rng, b, pool.rates, relax_weight=0.075)
        cands = [Candidate(100, pool.match_probs(s.estimates(), int(rng.integers(0, 6)))[:int(rng.integers(0, 17))])
                 for s in stats]
        if any(pol.choose(cands, b)):
            drafted_somewhere += 1
            assert pol.drafts_can_pay(b, [s.gain_ceiling(False, pool.boost()) for s in stats])
    assert drafted_somewhere > 20  # the property was exercised


@pytest.mark.parametrize("confident", [False, True])
def test_the_boosted_ceiling_never_falls_below_the_plain_one(confident):
    s = AcceptanceStats.new(0.6, 8)
    s.observe(8, 8, 0.3)
    plain = s.gain_ceiling(confident)
    boosted = s.gain_ceiling(confident, np.full(8, 1.5))
    assert np.all(boosted >= plain - 1e-12) and np.all(boosted <= 1.0)
    assert np.array_equal(s.gain_ceiling(confident), plain)  # the cached bound is not changed by a boost


def test_the_pool_starts_at_the_first_draft_prior_then_the_continuation_prior():
    """A new engine's estimates (pooled, a new request's, a match length's bucket) start at
    `initial_acceptance` for the first draft and `initial_continuation` after it; a verification moves only
    the positions it reached."""
    spec = _speculator(initial_acceptance=0.5, initial_continuation=0.8)
    assert spec.pool.rates == [0.5] + [0.8] * 7
    assert spec._state(_req("a", LONG_MATCH)).estimates() == [0.5] + [0.8] * 7
    spec.pool.observe(4, 3, 1)  # first draft kept, second rejected, third never reached
    rates, tried = spec.pool._by_match[4]
    assert rates == pytest.approx([0.5 + 0.5 / 3, 0.8 - 0.8 / 3] + [0.8] * 6)
    assert tried == [1, 1] + [0] * 6
    with pytest.raises(ValueError, match="initial_continuation"):
        SpeculativeMethod("ngram", 4, initial_continuation=1.5)


def test_drafts_are_weighed_by_how_much_of_what_was_expected_verification_kept():
    """The calibration (`KeepCalibration`): after verifications that kept all they were expected to (and
    more), its factor stays 1; after ones that kept none, it falls, and with the same estimates and the same
    proposal the speculator then drafts less than one that trusts its estimates."""
    good = _speculator()
    _serve(good, LONG_MATCH, None, 30, "g")
    assert good.calibration.factor == 1.0 and good.calibration.kept >= good.calibration.expected > 0
    bad = _speculator()
    ks = []
    for i in range(30):
        req = _req(f"x{i}", LONG_MATCH)
        ks.append(len(bad.propose([req], 4096).get(req.request_id, [])))
        if ks[-1]:
            bad.verified(req, ks[-1], 0)
        bad.finished(req)
    assert ks[0] > 0 and ks[-1] == 0
    assert bad.calibration.factor < 0.6
    assert bad.calibration.expected > 10 * bad.calibration.kept  # expected from the estimates, kept none
    # the same estimates (good's pool) with bad's calibration: fewer drafts on the same proposal
    trusting = _speculator()
    _serve(trusting, LONG_MATCH, None, 30, "t")
    # a dear row (half a decode): drafts pay only where they are likely kept
    trusting.policy.price = StepPrice(CostModel())
    trusting.policy.price.seed([(r, 0.040 + 0.020 * (r - 1)) for r in range(1, 301)])
    k_trusting = len(trusting.propose([_req("a", LONG_MATCH)], 4096).get("a", []))
    trusting.calibration = bad.calibration
    k_calibrated = len(trusting.propose([_req("b", LONG_MATCH)], 4096).get("b", []))
    assert k_trusting > 0 and k_calibrated < k_trusting
    # what each chosen draft was expected to keep is recorded until its verification consumes it
    req = _req("c", LONG_MATCH)
    spec = _speculator()
    k = len(spec.propose([req], 4096)["c"])
    assert 0 < req.spec.predicted_kept <= k
    spec.verified(req, k, k)
    assert req.spec.predicted_kept == 0.0
