"""Hindsight (engine/spec/speculator.py): a request that drafts nothing holds its proposal and checks it
against the tokens it decodes next, learning its keep rates while priced out of drafting; and what a
speculator that has verified nothing for a while does (`_rearm_if_stale`: hindsight again, a price probe
past the C path). The real Speculator and n-gram proposer, deterministic token streams and fixed step-price
tables (no timings)."""

from __future__ import annotations

from deepinfer.config import SpeculativeMethod
from deepinfer.engine.cost_model import CostModel
from deepinfer.engine.request import Request
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.spec.ngram import NgramProposer
from deepinfer.engine.spec.speculator import Speculator
from deepinfer.engine.spec.tries import TryRules

# a copy: the prompt holds 1..PROMPT, the request repeats 1, 2, 3, ... after it
PROMPT = 1000
SEQ = list(range(1, 2 * PROMPT))
NO_EXPLORATION = TryRules(tries=0)


def _speculator(hindsight: bool = True, k_max: int = 8) -> Speculator:
    """Batch 8 at the 9th row's jump (the C path's 8 rows cost the same, the 9th a jump), no exploration:
    at the prior's estimates no draft pays, so only what the requests learn can make them draft."""
    spec = Speculator(SpeculativeMethod("ngram", k_max, hindsight=hindsight), CostModel(), NgramProposer(2, 5),
                      NO_EXPLORATION)
    price = spec.policy.price
    price.c_path_rows = 8
    price.seed([(r, 0.020 if r <= 8 else 0.045 + 0.001 * (r - 8)) for r in range(1, 301)])
    return spec


def _copying(rid: str, offset: int = 0) -> Request:
    req = Request(rid, SEQ[:PROMPT] + SEQ[offset:offset + 8], SamplingParams(temperature=0.0, max_tokens=300))
    req.num_computed_tokens = len(req.token_ids) - 1
    req.copy_offset = offset
    return req


def _decode(req: Request, tokens: list[int]) -> None:
    req.token_ids += tokens
    req.num_computed_tokens = len(req.token_ids) - 1


def _next(req: Request, n: int) -> list[int]:
    """The copy's next n tokens (a request made by `_copying(offset)` holds SEQ[offset:...] after the prompt)."""
    pos = req.copy_offset + len(req.token_ids) - PROMPT
    return SEQ[pos:pos + n]


def _step_rows(spec: Speculator, reqs: list[Request], steps: int, seconds=lambda rows: 0.020) -> list[int]:
    """`steps` steps of the batch, each request decoding its copy's next token (and its kept drafts), each
    step observed at `seconds(its rows)`; the rows (decodes and drafts) of each step."""
    rows = []
    for _ in range(steps):
        out = spec.propose(reqs, 4096)
        for r in reqs:
            d = out.get(r.request_id, [])
            truth = _next(r, len(d) + 1)
            assert d == truth[:len(d)]  # the n-gram proposal continues the copy
            if d:
                spec.verified(r, len(d), len(d))
            _decode(r, truth)
        rows.append(len(reqs) + sum(len(d) for d in out.values()))
        spec.observe_step(rows[-1], seconds(rows[-1]))
    return rows


def _run(spec: Speculator, reqs: list[Request], steps: int) -> int:
    """`_step_rows` at 20 ms a step; the drafts verified in total."""
    return sum(_step_rows(spec, reqs, steps)) - steps * len(reqs)


def test_priced_out_requests_learn_in_hindsight_and_start_drafting():
    """Eight copying requests at the jump: without hindsight the prior's estimates never pay and nothing is
    ever drafted or learnt; with it the held proposals, checked against the decoded tokens, raise the
    estimates until the price drafts."""
    off = _speculator(hindsight=False)
    reqs = [_copying(f"r{i}", i) for i in range(8)]
    assert _run(off, reqs, 40) == 0
    assert all(r.spec.rates[0] == off.method.initial_acceptance for r in reqs)
    on = _speculator()
    reqs = [_copying(f"r{i}", i) for i in range(8)]
    assert _run(on, reqs, 40) > 0
    assert on.metrics.num_hindsight_checks > 0
    assert on.metrics.num_hindsight_kept == on.metrics.num_hindsight_tried  # a copy: every token kept
    # hindsight is no verification: the verified totals count only the drafts the price chose
    assert on.metrics.num_draft_tokens == sum(r.spec.num_draft_tokens for r in reqs)


def test_a_held_proposal_is_learnt_a_token_at_a_time_and_dropped_at_its_first_mismatch():
    spec = _speculator()
    req = _copying("r")
    reqs = [req] + [_copying(f"x{i}", i) for i in range(7)]
    assert spec.propose(reqs, 4096) == {}  # priced out: every request holds its proposal instead
    held = req.spec.hindsight
    assert list(held.tokens) == SEQ[8:16] and held.start == PROMPT + 8 and held.match == 5 and held.learnt == 0
    _decode(req, [SEQ[8]])  # one token decoded, as proposed: position 1 is learnt as kept
    tried_before = list(req.spec.tried)
    spec._check_hindsight(req, req.spec)
    assert req.spec.hindsight is not None and req.spec.hindsight.learnt == 1
    assert req.spec.tried[0] == tried_before[0] + 1 and req.spec.tried[1] == tried_before[1]
    _decode(req, [SEQ[9], 999])  # position 2 kept, position 3 not: settled, dropped
    spec._check_hindsight(req, req.spec)
    assert req.spec.hindsight is None
    assert req.spec.tried[:4] == [tried_before[0] + 1, tried_before[1] + 1, tried_before[2] + 1, tried_before[3]]
    assert (spec.metrics.num_hindsight_checks, spec.metrics.num_hindsight_tried, spec.metrics.num_hindsight_kept) == (1, 3, 2)
    assert req.spec.num_draft_tokens == 0 and spec.metrics.num_draft_tokens == 0
    stats = spec.stats()
    assert stats["spec_hindsight_checks"] == 1 and stats["spec_hindsight_kept_tokens"] == 2


def test_hindsight_stops_once_the_pool_has_learnt():
    spec = _speculator()
    spec.pool.observe(5, 3, 3)
    while spec.pool.verifications < spec.HINDSIGHT_UNTIL:
        spec.pool.observe(5, 3, 3)
    reqs = [_copying(f"r{i}", i) for i in range(8)]
    for r in reqs:  # low estimates: priced out
        spec._state(r).rates = [0.05] * 8
    assert spec.propose(reqs, 4096) == {}
    assert all(r.spec.hindsight is None for r in reqs)


def test_no_hindsight_for_a_fixed_draft_length_or_when_switched_off():
    fixed = Speculator(SpeculativeMethod("ngram", 8, adaptive=False), CostModel(), NgramProposer(2, 5))
    req = _copying("r")
    assert fixed.propose([req], 4096)["r"] == SEQ[8:16]
    assert req.spec is None or req.spec.hindsight is None
    off = _speculator(hindsight=False)
    reqs = [_copying(f"r{i}", i) for i in range(8)]
    assert off.propose(reqs, 4096) == {}
    assert all(r.spec.hindsight is None for r in reqs)


def _pessimist(stale_steps: int) -> Speculator:
    """A speculator that has learnt, from many verifications, that drafts rarely keep (pooled rates ~0.3,
    calibration 0.25): at the jump nothing pays, and hindsight is off (the pool is past HINDSIGHT_UNTIL)."""
    spec = _speculator()
    spec.STALE_STEPS = stale_steps
    for i in range(3 * spec.HINDSIGHT_UNTIL):
        spec.pool.observe(2 + i % 4, 4, 1 if i % 3 == 0 else 0)
    spec.calibration.kept, spec.calibration.expected = 6.0, 36.0
    spec.policy.price.observe(16, 0.053)  # a served count past the C path, as profiled: no price probe
    assert spec.pool.rates[0] < 0.4 and spec.calibration.factor < 0.3 and not spec._hindsight_on()
    return spec


def test_an_engine_that_stopped_drafting_rearms_hindsight_and_drafts_again():
    """Pessimism the engine learnt earlier keeps it from drafting, so nothing it verifies can correct it:
    without the re-arm, copying requests are never drafted; with it, after STALE_STEPS steps without a
    verification hindsight runs again (its calibration reset), learns the copies and the price drafts."""
    stuck = _pessimist(stale_steps=10**9)
    reqs = [_copying(f"r{i}", i) for i in range(8)]
    assert _run(stuck, reqs, 120) == 0
    assert stuck.metrics.num_hindsight_checks == 0
    spec = _pessimist(stale_steps=20)
    reqs = [_copying(f"r{i}", i) for i in range(8)]
    assert _run(spec, reqs, 19) == 0 and spec.metrics.num_hindsight_checks == 0  # not stale yet
    pooled = spec.pool.verifications
    assert _run(spec, reqs, 100) > 0
    assert spec.metrics.num_hindsight_checks > 0 and spec.pool.verifications > pooled
    assert spec.calibration.factor == 1.0  # reset at the re-arm, and the copies kept what was expected


def test_hindsight_is_not_rearmed_while_the_engine_verifies_drafts():
    """A busy engine (drafts chosen every step) never goes stale: no held proposals, however long it runs."""
    spec = _speculator()
    spec.STALE_STEPS = 8
    for _ in range(spec.HINDSIGHT_UNTIL):
        spec.pool.observe(5, 8, 8)
    reqs = [_copying(f"r{i}", i) for i in range(8)]
    assert _run(spec, reqs, 30) > 0  # ~9 tokens a step: within the requests' max_tokens
    assert spec.metrics.num_hindsight_checks == 0 and not spec._hindsight_on()
    assert spec.num_steps - spec._verified_at <= 1


def test_a_rearmed_burst_ends_after_its_pooled_verifications():
    spec = _pessimist(stale_steps=5)
    spec.num_steps = 5  # stale: the next proposal re-arms
    spec._rearm_if_stale(8)
    assert spec._hindsight_on() and spec._verified_at == 5
    for _ in range(spec.HINDSIGHT_UNTIL):
        spec.pool.observe(3, 2, 0)
    assert not spec._hindsight_on()
    spec._rearm_if_stale(8)  # the clock restarted at the re-arm: not stale again yet
    assert not spec._hindsight_on()
    spec.num_steps = 10
    spec._rearm_if_stale(8)
    assert spec._hindsight_on()


def _served(rows: int) -> float:
    """What a step of `rows` rows takes in the probe tests: the C path's 20 ms, past it 21 ms and 0.2 ms a
    row (the seeded profile, `_speculator`, priced those at 45 ms and 1 ms a row: a slow spell)."""
    return 0.020 if rows <= 8 else 0.021 + 0.0002 * (rows - 8)


def _run_served(spec: Speculator, reqs: list[Request], steps: int) -> list[int]:
    """`_step_rows` with each step observed at its `_served` seconds."""
    return _step_rows(spec, reqs, steps, _served)


def test_a_profile_priced_too_high_past_the_c_path_is_probed_once_and_corrected():
    """Batch 8 on the C path, the counts past it profiled at over twice what they take: no draft pays, so
    without the probe no step past the C path is ever served and the price stays; with it the first stale
    spell verifies one step past it, its served time rescales the whole regime, and the price drafts."""
    stuck = _speculator(hindsight=False)
    stuck.STALE_STEPS = 10**9
    reqs = [_copying(f"r{i}", i) for i in range(8)]
    assert max(_run_served(stuck, reqs, 40)) == 8
    assert stuck.policy.price.unserved_past_c_path() and stuck.policy.price.seconds(16) > 0.04
    spec = _speculator(hindsight=False)
    spec.STALE_STEPS = 10
    reqs = [_copying(f"r{i}", i) for i in range(8)]
    rows = _run_served(spec, reqs, 40)
    assert rows[:9] == [8] * 9 and rows[9] > 8  # the probe: the 10th proposal, the first of the stale spell
    assert not spec.policy.price.unserved_past_c_path()
    assert spec.policy.price.seconds(16) < 0.03  # rescaled by the served step
    assert sum(r > 8 for r in rows[10:]) > 10  # the price drafts from then on
    assert spec.ledger.spent > 0  # the probe's predicted cost was charged


def test_no_price_probe_where_plain_steps_are_served_past_the_c_path():
    """A batch wider than the C path serves its counts past it with every plain step: a stale spell there,
    or later at a batch on the C path, has nothing to probe. A fresh speculator's stale spell does."""
    fresh = _speculator(hindsight=False)
    fresh.num_steps = fresh.STALE_STEPS
    fresh._rearm_if_stale(8)
    assert fresh._price_probe
    spec = _speculator(hindsight=False)
    reqs = [_copying(f"r{i}", i) for i in range(12)]
    _run_served(spec, reqs, 4)
    assert not spec.policy.price.unserved_past_c_path()
    spec.num_steps += spec.STALE_STEPS
    spec._rearm_if_stale(12)
    spec._rearm_if_stale(8)
    assert not spec._price_probe
