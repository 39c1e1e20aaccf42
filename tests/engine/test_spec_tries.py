"""Speculative decoding's try rules (engine/spec/tries.py) through the real Speculator and n-gram proposer:
which requests are looked up, explored and backed off. Decisions only, on deterministic inputs and a
fixed step-price table (no timings)."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer.config import SpeculativeMethod
from deepinfer.engine.cost_model import CostModel
from deepinfer.engine.request import Request
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.spec.ngram import NgramProposer, find_match
from deepinfer.engine.spec.speculator import Speculator
from deepinfer.engine.spec.tries import TryRules

# a copy-friendly prompt: the tail "5 6 7 8" occurred before, followed by 9 10 11 12 13 14 ...
COPY = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 20, 21, 5, 6, 7, 8]
# no earlier occurrence of the last token at all: the n-gram proposer finds nothing
FRESH = list(range(100, 140))


class CountingNgram(NgramProposer):
    """The n-gram proposer, counting the requests it is asked to look up."""

    def __init__(self) -> None:
        super().__init__(2, 5)
        self.lookups = 0

    def propose(self, req, max_tokens):
        self.lookups += 1
        return super().propose(req, max_tokens)


ON = TryRules(misses=3, tries=2)  # the back-off switched on too (off by default: tries.py)
OFF = TryRules(tries=0)  # no exploration


def _speculator(jump: bool = False, rules: TryRules = ON, elapsed: float = 100.0,
                dear: bool = False, hindsight: bool = False, counting: bool = True
                ) -> tuple[Speculator, NgramProposer]:
    """k_max 8, the C decode path's 8 rows; `jump`: steps of up to 8 rows cost the same, the 9th row a jump (CPU
    at batch 8); `dear`: every row costs 0.8 of a one-row step (a pessimistic start-up table: at the prior's
    0.6 no draft pays at any batch); else every row costs 1/40 of a step (batch 1 on the C path: drafts at the
    prior's 0.6 pay). `elapsed`: seconds of decode steps already run (exploration's budget is a share).
    `hindsight` off by default: most tests here count the lookups the choice of drafts makes, and a held
    proposal's lookup (`Speculator._keep_for_hindsight`) would count too. `counting` False: the plain n-gram
    proposer (the speculating C call's plans take no other)."""
    proposer = CountingNgram() if counting else NgramProposer(2, 5)
    spec = Speculator(SpeculativeMethod("ngram", 8, hindsight=hindsight), CostModel(), proposer, rules)
    spec.ledger.observe(elapsed)
    price = spec.policy.price
    price.c_path_rows = 8
    if jump:
        price.seed([(r, 0.020 if r <= 8 else 0.045 + 0.001 * (r - 8)) for r in range(1, 301)])
    elif dear:
        price.seed([(r, 0.010 * (1 + 0.8 * (r - 1))) for r in range(1, 301)])
    else:
        price.seed([(r, 0.040 + 0.001 * r) for r in range(1, 301)])
    return spec, proposer


def _req(rid: str, tokens: list[int]) -> Request:
    req = Request(rid, list(tokens), SamplingParams(temperature=0.0, max_tokens=64))
    req.num_computed_tokens = len(tokens) - 1
    return req


def test_ngram_reports_its_match_length():
    assert find_match(COPY, 2, 5, 3) == ([9, 10, 11], 4)
    assert find_match([1, 2, 9, 1, 2], 2, 5, 2) == ([9, 1], 2)
    assert find_match(FRESH, 2, 5, 3) == ([], 0)
    assert NgramProposer(2, 5).propose(_req("r", COPY), 2).match == 4


def _first_drafts(spec: Speculator, reqs: list[Request]) -> dict[str, list[int]]:
    for _ in range(spec.tries.lookup_every):
        out = spec.propose(reqs, 4096)
        if out:
            return out
    return {}


def test_untried_request_with_a_long_match_is_explored_on_the_c_path():
    spec, proposer = _speculator(dear=True)
    plain, _ = _speculator(dear=True, rules=OFF)
    reqs = [_req(f"r{i}", COPY if i == 0 else FRESH) for i in range(3)]
    # by the price alone no draft pays (every row 0.8 of a step) at the prior's estimate
    assert plain.propose(reqs, 4096) == {}
    # exploration: `tokens` drafts for the untried request with a long match, none for the others (within
    # `lookup_every` steps: where the price's bound skips the proposer, it is looked up that often)
    assert _first_drafts(spec, reqs) == {"r0": [9, 10, 11, 12]}
    spec.verified(reqs[0], 4, 4)
    assert reqs[0].spec.tried[0] == 1 and spec.tries.explorable(reqs[0].spec)
    out = _first_drafts(spec, reqs)  # a second try (or more drafts: the kept ones raised its estimates)
    assert len(out.get("r0", ())) >= 4
    spec.verified(reqs[0], len(out["r0"]), 0)
    assert not spec.tries.explorable(reqs[0].spec)  # two tries: from here its estimates decide


def test_exploration_stays_on_the_c_path():
    """Past the C decode path's rows exploration cost more than its ledger priced (tries.py): at batch 8 (the
    9th row's jump) nothing is explored or looked up; at batch 6 an exploring request gets the 2 rows left."""
    spec, proposer = _speculator(jump=True)
    reqs = [_req(f"r{i}", COPY if i == 0 else FRESH) for i in range(8)]
    for _ in range(2 * spec.tries.lookup_every):
        assert not spec.wants_fresh_step(reqs, 4096)
        assert spec.propose(reqs, 4096) == {}
    assert proposer.lookups == 0
    spec, _ = _speculator(dear=True)
    assert _first_drafts(spec, reqs[:6]) == {"r0": [9, 10]}


def test_requests_the_price_skips_are_looked_up_only_for_exploration_every_few_steps():
    spec, proposer = _speculator(dear=True)
    reqs = [_req(f"r{i}", COPY if i == 0 else FRESH) for i in range(4)]
    for r in reqs[1:]:  # unlikely drafts everywhere else: the bound says no draft can pay
        spec._state(r).rates = [0.05] * 8
    spec._state(reqs[0]).rates = [0.05] * 8
    seen = [spec.propose(reqs, 4096) for _ in range(spec.tries.lookup_every)]
    assert seen[:-1] == [{}] * (spec.tries.lookup_every - 1)
    # all on the last step, and only r0's: the others are owed their tries too, but their tokens repeat
    # nothing (`likely_to_propose`), so a lookup would find nothing
    assert proposer.lookups == 1
    assert seen[-1] == {"r0": [9, 10, 11, 12]}
    for r in reqs:  # tried twice (and missed): nobody is owed a try, nobody is looked up any more
        r.spec.tried[0] = spec.tries.tries
    lookups = proposer.lookups
    for _ in range(3 * spec.tries.lookup_every):
        assert spec.propose(reqs, 4096) == {}
    assert proposer.lookups == lookups


def test_short_matches_and_plain_policy_are_not_explored():
    spec, _ = _speculator(dear=True)
    short = _req("s", [1, 2, 9, 7, 1, 2])  # the tail "1 2" matched: 2 tokens, below min_match
    reqs = [short] + [_req(f"f{i}", FRESH) for i in range(3)]
    for _ in range(2 * spec.tries.lookup_every):
        assert spec.propose(reqs, 4096) == {}
    off, _ = _speculator(dear=True, rules=OFF)  # exploration off: as before, nothing at all
    for _ in range(2 * off.tries.lookup_every):
        assert off.propose([_req("c", COPY)] + reqs[1:], 4096) == {}


def test_repeated_misses_back_off_and_retry_after_n_steps():
    rules = TryRules(misses=3, first_backoff=8, max_backoff=16, tries=2)
    spec, proposer = _speculator(jump=False, rules=rules)
    req = _req("r", COPY)
    for _ in range(rules.misses):  # batch 1, rows nearly free: the prior gets drafts every step
        out = spec.propose([req], 4096)
        assert out.get("r")
        spec.verified(req, len(out["r"]), 0)
    assert req.spec.backoff_until == spec.num_steps + rules.first_backoff
    # backed off: no lookup, no drafts, for `first_backoff` steps
    lookups = proposer.lookups
    for _ in range(rules.first_backoff - 1):
        assert spec.propose([req], 4096) == {}
    assert proposer.lookups == lookups
    # then it proposes again, and the price decides (the estimate has drifted back towards the prior)
    for _ in range(64):
        out = spec.propose([req], 4096)
        if out:
            break
    assert out.get("r") and proposer.lookups > lookups
    # more misses: the next pause is twice as long (capped), a kept draft resets it
    for _ in range(rules.misses):
        spec.verified(req, 2, 0)
    assert req.spec.backoff_steps == 16
    spec.verified(req, 2, 1)
    assert req.spec.backoff_steps == 0 and req.spec.misses == 0


def test_back_off_is_off_and_exploration_on_by_default():
    spec, proposer = _speculator(jump=False, rules=TryRules())
    req = _req("r", COPY)
    for _ in range(10):  # misses never back off: a lookup every step, the price decides
        spec.propose([req], 4096)
        spec.verified(req, 2, 0)
    assert req.spec.backoff_until == 0 and proposer.lookups == 10
    spec, _ = _speculator(dear=True, rules=TryRules())
    assert _first_drafts(spec, [_req("c", COPY)] + [_req(f"f{i}", FRESH) for i in range(3)]) == {"c": [9, 10, 11, 12]}


def test_fixed_draft_length_never_backs_off():
    proposer = CountingNgram()
    spec = Speculator(SpeculativeMethod("ngram", 5, adaptive=False), CostModel(), proposer, ON)
    req = _req("r", COPY)
    for _ in range(10):
        out = spec.propose([req], 4096)
        assert out == {"r": [9, 10, 11, 12, 13]}
        spec.verified(req, 5, 0)


def test_idle_drift_is_applied_lazily_as_the_per_step_rule():
    from deepinfer.engine.spec.policy import AcceptanceStats

    lazy = AcceptanceStats.new(0.6, 4, 0.075)
    eager = [0.2, 0.9, 0.6, 0.0]
    lazy.rates = list(eager)
    for _ in range(5):
        lazy.relax()
        eager = [r + 0.075 * (0.6 - r) if r < 0.6 else r for r in eager]
    assert abs(lazy.first_rate() - eager[0]) < 1e-12
    lazy.settle()
    assert max(abs(a - b) for a, b in zip(lazy.rates, eager, strict=True)) < 1e-12
    assert lazy.rates[1] == 0.9 and lazy.rates[0] > 0.2  # above the prior: stays; below: drifts up
    # steps whose lookup found nothing move estimates above the prior down too, and those below up
    eager = [0.2, 0.9, 0.6, 0.0]
    lazy.rates = list(eager)
    for i in range(7):
        unmatched = i % 2 == 0
        lazy.relax(unmatched)
        eager = [r + 0.075 * (0.6 - r) if r < 0.6 or unmatched else r for r in eager]
    assert abs(lazy.first_rate() - eager[0]) < 1e-12
    lazy.settle()
    assert max(abs(a - b) for a, b in zip(lazy.rates, eager, strict=True)) < 1e-12
    assert 0.6 < lazy.rates[1] < 0.9


def test_steps_overlap_where_no_drafts_can_pay():
    """`wants_fresh_step` says whether the engine must wait for the step in flight (so its requests can draft
    in the next) or may schedule the next step ahead of it, as without speculation."""
    # batch 8 at the 9th row's jump with the prior's estimates: no draft pays, no exploration (rules off)
    plain, _ = _speculator(jump=True, rules=OFF)
    reqs = [_req(f"r{i}", COPY if i == 0 else FRESH) for i in range(8)]
    assert not plain.wants_fresh_step(reqs, 4096)
    assert plain.propose(reqs, 4096) == {}  # the step it lets run without a fresh schedule drafts nothing anyway
    # rows on the C path cheap: drafts at the prior pay, so the requests must get a fresh step to draft in
    cheap, _ = _speculator(jump=False, rules=OFF)
    assert cheap.wants_fresh_step(reqs, 4096)
    # ... where some request's tokens as they are now have an n-gram match (COPY's): requests that find
    # none (chat, most steps) keep overlapping, though the price would pay for their drafts
    assert not cheap.wants_fresh_step(reqs[1:], 4096)
    assert cheap.propose(reqs[1:], 4096) == {}
    # ... but not a request whose own estimates say its drafts are not kept
    for r in reqs:
        cheap._state(r).rates = [0.01] * 8
        cheap._state(r).prior = [0.01] * 8
    assert not cheap.wants_fresh_step(reqs, 4096)
    # exploration on: a fresh step exactly when the next step is an exploration lookup
    spec, _ = _speculator(dear=True)
    reqs = reqs[:4]
    wants = []
    for _ in range(2 * spec.tries.lookup_every):
        wants.append(spec.wants_fresh_step(reqs, 4096))
        spec.propose(reqs, 4096)
    assert wants == [(s + 1) % spec.tries.lookup_every == 0 for s in range(2 * spec.tries.lookup_every)]
    # ... while its budget lasts
    spent, _ = _speculator(dear=True, elapsed=0.0)
    spent.ledger.charge(1.0)
    assert not any(spent.wants_fresh_step(reqs, 4096) or spent.propose(reqs, 4096)
                   for _ in range(2 * spec.tries.lookup_every))
    # a fixed draft length always drafts: always a fresh step
    fixed = Speculator(SpeculativeMethod("ngram", 4, adaptive=False), CostModel(), NgramProposer(2, 5))
    assert fixed.wants_fresh_step(reqs, 4096)


def _advance(req: Request, tokens: list[int]) -> None:
    req.token_ids += tokens
    req.num_computed_tokens = len(req.token_ids) - 1


def test_exploration_costs_at_most_its_budget_where_its_drafts_are_not_kept():
    """Batch 2 at a price where no draft pays, every request's proposal a long match that is never kept
    (chat's long n-gram matches): exploration runs (its first steps), then stops at its budget's share of
    the steps' time, fresh requests owed tries or not."""
    spec, proposer = _speculator(dear=True, rules=TryRules(), elapsed=0.0)
    price = spec.policy.price
    total = extra = 0.0
    explored_steps = 0
    for step in range(2000):
        reqs = [_req(f"r{step}-{i}", COPY) for i in range(2)]  # new every step: each is owed its tries
        out = spec.propose(reqs, 4096)
        rows = 2 + sum(len(d) for d in out.values())
        for r in reqs:
            if r.request_id in out:
                spec.verified(r, len(out[r.request_id]), 0)
        explored_steps += bool(out)
        seconds = price.seconds(rows)
        spec.observe_step(rows, seconds)
        total += seconds
        extra += seconds - price.seconds(2)
    assert explored_steps > 0
    # within the budget, give or take the start-up allowance (one step) and the last exploring step's charge
    # (both requests exploring at once: 2 + 6 rows, the C path's limit)
    assert spec.tries.budget == 0.02
    assert extra <= 0.02 * total + price.seconds(8)
    assert spec.ledger.spent <= 0.02 * spec.ledger.elapsed + price.seconds(8)


def test_a_pessimistic_start_up_price_is_corrected_by_exploration():
    """Batch 1, a start-up table that priced every draft row at 0.8 of a decode (a noisy moment: no draft pays
    at the prior's 0.6 keep rate) where a row really costs 0.2, and a request that copies its prompt (every
    draft kept). Without exploration nothing is ever verified, so the estimates and the table stay as they
    started; with it, the explored verifications teach both and the price soon drafts by itself. Hindsight
    alone (the proposals priced out, checked against the tokens decoded after them) raises the estimates
    until drafts pay at the table's price."""
    seq = list(range(1, 400))

    def run(rules: TryRules, hindsight: bool = False) -> tuple[int, int]:
        spec = Speculator(SpeculativeMethod("ngram", 8, hindsight=hindsight), CostModel(), NgramProposer(2, 5), rules)
        price = spec.policy.price
        price.c_path_rows = 8
        price.seed([(r, 0.010 * (1 + 0.8 * (r - 1))) for r in range(1, 65)])
        req = Request("copy", seq[:200] + seq[:8], SamplingParams(temperature=0.0, max_tokens=150))
        req.num_computed_tokens = len(req.token_ids) - 1
        priced = drafted = 0
        for _ in range(60):
            out = spec.propose([req], 4096).get("copy", [])
            explored = req.spec.explore_refund > 0
            pos = len(req.token_ids) - 200  # the copy's next token is seq[pos]
            assert out == seq[pos:pos + len(out)]  # the n-gram proposal continues the copy
            if out:
                spec.verified(req, len(out), len(out))
                drafted += len(out)
                priced += not explored
            _advance(req, seq[pos:pos + len(out) + 1])
            spec.observe_step(1 + len(out), 0.010 * (1 + 0.2 * len(out)))
        return priced, drafted

    assert run(OFF) == (0, 0)
    priced, drafted = run(TryRules())
    assert priced >= 10 and drafted >= 60
    # hindsight alone corrects the estimates but not the table (only verified rows teach it): the price
    # drafts by itself, one token a step at the table's dear rows
    priced, drafted = run(OFF, hindsight=True)
    assert priced >= 10 and drafted >= priced


def test_a_batch_whose_proposals_were_priced_out_skips_the_lookup_for_a_few_steps():
    """Batch 8 at the 9th row's jump with estimates that make the loose bound say drafts may pay: one step
    looks the proposals up and prices them out; the next QUIET_STEPS steps at that batch size skip the
    lookup (and overlap), a smaller batch looks up again at once."""
    spec, proposer = _speculator(jump=True, rules=OFF)
    reqs = [_req(f"r{i}", COPY) for i in range(8)]
    for r in reqs:  # high enough for the bound (boosted ceilings), not for the choice at the jump
        spec._state(r).rates = [0.8] * 8
        spec._state(r).prior = [0.8] * 8
    spec.pool.boost = lambda: np.full(8, 1.25)  # a match length kept more often than average (the bound's boost)
    assert spec.propose(reqs, 4096) == {} and proposer.lookups == 8
    for _ in range(spec.QUIET_STEPS - 1):
        assert not spec.wants_fresh_step(reqs, 4096)
        assert spec.propose(reqs, 4096) == {}
    assert proposer.lookups == 8
    spec.propose(reqs[:7], 4096)  # fewer decodes: cheaper rows, looked up again
    assert proposer.lookups == 15


def test_a_request_decoding_ahead_of_its_batch_prices_its_drafts_as_that_batch():
    """Through the scheduler: a request that decodes while the rest of its batch still waits or computes its
    prompt drafts as one of that batch. At the 9th row's jump, a lone decode drafts (its extra rows are free
    on the C path); with 7 more requests about to decode, the same proposal would cost the batch the jump,
    and it verifies none (it would only run ahead of the others and finish first)."""
    from deepinfer.config import SchedulerConfig
    from deepinfer.engine.scheduler import Scheduler
    from deepinfer.kvcache.manager import KVCacheManager

    def drafts_while_others_prefill(others: int) -> tuple[int, int]:
        spec, _ = _speculator(jump=True, rules=OFF)
        s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32), KVCacheManager(128, 4, "m", "l"),
                      256, speculator=spec)
        lead = Request("lead", list(COPY), SamplingParams(temperature=0.0, max_tokens=64))
        s.add(lead)
        s.update(s.schedule(), {"lead": 9})  # the prompt in one step; "... 7 8 9" continues as COPY did
        for i in range(others):
            s.add(Request(f"p{i}", list(range(200 + i, 260 + i)), SamplingParams(temperature=0.0, max_tokens=8)))
        out = s.schedule()
        return s.decode_batch_ahead(), sum(len(x.draft_token_ids) for x in out.scheduled)

    assert drafts_while_others_prefill(0)[1] > 0
    batch, drafted = drafts_while_others_prefill(7)
    assert drafted == 0 and batch == 8


def test_an_exploring_step_is_charged_a_drafting_steps_extra_host_time():
    """Where the price chose no drafts, an exploring step turns a plain step into a drafting one: the ledger
    charges its extra rows and the drafting steps' extra host time (`StepPrice.draft_host_seconds`)."""
    charges = []
    for extra_host in (0.0, 0.004):
        spec, _ = _speculator(dear=True)
        price = spec.policy.price
        for _ in range(3):
            price.observe_host(0.001)
            price.observe_host(0.001 + extra_host, drafted=True)
        assert _first_drafts(spec, [_req("r0", COPY)]) == {"r0": [9, 10, 11, 12]}
        charges.append(spec.ledger.spent)
    assert charges[0] > 0 and charges[1] - charges[0] == pytest.approx(0.004)


def test_estimates_above_the_prior_drift_down_only_where_lookups_find_nothing():
    """A step priced out (batch 8 at the 9th row's jump) says nothing against a request's estimates: they stay
    (drifting down there made code edits at batch 8 spiral into never drafting); a request whose lookups find
    nothing drifts to the prior."""
    spec, _ = _speculator(jump=True, rules=OFF)
    reqs = [_req(f"r{i}", COPY) for i in range(8)]
    for r in reqs:
        spec._state(r).rates = [0.85] * 8
    for _ in range(40):
        assert spec.propose(reqs, 4096) == {}
    assert all(spec._state(r).estimates() == [0.85] * 8 for r in reqs)
    cheap, _ = _speculator(jump=False, rules=OFF)
    fresh = _req("f", FRESH)
    cheap._state(fresh).rates = [0.85] * 8
    for _ in range(40):
        assert cheap.propose([fresh], 4096) == {}
    assert 0.6 < cheap._state(fresh).estimates()[0] < 0.65


def test_a_quiet_spell_counts_decode_steps():
    """After a step whose drafts were priced out, the batch skips pricing them for QUIET_STEPS decode steps; a
    call of several decode steps counts each of them (so the next call prices again)."""
    spec, _ = _speculator(jump=True, rules=OFF)
    reqs = [_req(f"r{i}", COPY) for i in range(8)]
    priced = []
    bound = spec._drafts_can_pay
    spec._drafts_can_pay = lambda *a, **k: priced.append(1) or bound(*a, **k)
    assert spec.propose(reqs, 4096) == {}
    assert len(priced) == 1
    spec.propose(reqs, 4096)  # a single step within the spell: quiet
    assert len(priced) == 1
    spec.observe_step(8, 0.080, steps=Speculator.QUIET_STEPS)
    spec.propose(reqs, 4096)
    assert len(priced) == 2


def test_requests_without_a_match_are_neither_looked_up_nor_priced():
    """Cheap rows (drafts at the prior pay): a batch whose tokens repeat nothing is not looked up at all, and
    each step counts as one whose lookup found nothing (estimates above their prior drift down); once one
    request's tokens repeat, it alone is looked up and drafts."""
    spec, proposer = _speculator()
    reqs = [_req(f"f{i}", FRESH) for i in range(4)]
    for r in reqs:
        spec._state(r).rates = [0.9] * 8  # above the prior: only an unmatched lookup lowers them
    for _ in range(5):
        assert spec.propose(reqs, 4096) == {}
    assert proposer.lookups == 0
    assert all(r.spec.estimates()[0] < 0.9 for r in reqs)
    reqs[2] = _req("c", COPY)
    out = spec.propose(reqs, 4096)
    assert proposer.lookups == 1 and list(out) == ["c"] and out["c"][:4] == [9, 10, 11, 12]


def test_a_step_where_few_requests_matched_does_not_go_quiet():
    """Batch 8 at the 9th row's jump, estimates whose ceilings say drafts may pay: where only two of the eight
    requests found a proposal and the step drafted nothing, the next step looks up again (a code edit's copy
    resumes a token or two after an edited name); where all eight did and were priced out, the batch goes
    quiet."""
    def quiet_after(copying: int) -> bool:
        spec, proposer = _speculator(jump=True, rules=OFF)
        reqs = [_req(f"r{i}", COPY if i < copying else FRESH) for i in range(8)]
        for r in reqs:
            spec._state(r).rates = [0.8] * 8
            spec._state(r).prior = [0.8] * 8
        spec.pool.boost = lambda: np.full(8, 1.25)
        assert spec.propose(reqs, 4096) == {}
        return spec._quiet(8, spec.num_steps + 1)

    assert not quiet_after(2)
    assert quiet_after(8)


def test_a_speculating_c_call_explores_untried_requests_behind_long_matches():
    """`in_call_drafts` for a request whose estimates say no draft pays (every row 0.8 of a step, low rates, as
    after JSON requests): exploration's `tokens` drafts behind matches of at least `min_match` tokens while the
    request is untried, nothing below, in one call of its life (marked `explores`: the scheduler keeps it to
    EXPLORE_CALL_STEPS steps); none once it has had its tries, and none with exploration off."""
    def speculator(rules: TryRules) -> Speculator:
        return _speculator(dear=True, rules=rules, counting=False)[0]

    def plan(spec: Speculator, req: Request, verifications: int = 0):
        spec._state(req).rates = [0.1] * 8
        for _ in range(verifications):
            spec.verified(req, 4, 0)
        plans = spec.in_call_drafts([req], 8)
        assert plans is not None
        spec.call_scheduled([req], plans)  # the call got its blocks
        return plans[0].k_by_match, plans[0].explores

    spec, req = speculator(ON), _req("r", COPY)
    assert plan(spec, req) == ((0, 0, 0, 4, 4, 4), True)
    assert plan(spec, req) == ((0,) * 6, False)  # one exploring call per request
    assert plan(speculator(ON), _req("r", COPY), verifications=2) == ((0,) * 6, False)
    assert plan(speculator(OFF), _req("r", COPY)) == ((0,) * 6, False)


def test_plain_passes_stay_short_while_a_batch_drafts():
    """`drafts_may_pay`: an adaptive speculator that has not drafted lately lets a closed batch's plain pass
    run all its steps; within RECENT_DRAFT_STEPS of a step that drafted (and with ceilings that pay) the
    pass keeps to the time budget; a fixed draft length always does."""
    spec, _ = _speculator()
    reqs = [_req(f"r{i}", COPY) for i in range(2)]
    assert not spec.drafts_may_pay(reqs, 4096)
    assert spec.propose(reqs, 4096)  # cheap rows at the prior: drafts
    assert spec.drafts_may_pay(reqs, 4096)
    for _ in range(Speculator.RECENT_DRAFT_STEPS):
        spec.propose([_req("f", FRESH)], 4096)
    assert not spec.drafts_may_pay(reqs, 4096)
    fixed = Speculator(SpeculativeMethod("ngram", 8, adaptive=False), CostModel(), NgramProposer(2, 5), ON)
    assert fixed.drafts_may_pay(reqs, 4096)
