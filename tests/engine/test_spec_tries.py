"""Speculative decoding's try rules (engine/spec/tries.py) through the real Speculator and n-gram proposer:
which requests are looked up, explored and backed off. Decisions only, on deterministic inputs and a
fixed step-price table (no timings)."""

from __future__ import annotations

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


ON = TryRules(misses=3, tries=2)  # the rules switched on (off by default: tries.py)


def _speculator(jump: bool, rules: TryRules = ON) -> tuple[Speculator, CountingNgram]:
    """k_max 8; `jump`: steps of up to 8 rows cost the same, the 9th row a jump (CPU at batch 8), else every row
    costs 1/40 of a step (batch 1 on the C path: drafts at the prior's 0.6 pay)."""
    proposer = CountingNgram()
    spec = Speculator(SpeculativeMethod("ngram", 8), CostModel(), proposer, rules)
    price = spec.policy.price
    price.c_path_rows = 8
    if jump:
        price.seed([(r, 0.020 if r <= 8 else 0.045 + 0.001 * (r - 8)) for r in range(1, 301)])
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


def test_untried_request_with_a_long_match_is_explored_at_batch_8():
    spec, proposer = _speculator(jump=True)
    plain, _ = _speculator(jump=True, rules=TryRules(tries=0))
    reqs = [_req(f"r{i}", COPY if i == 0 else FRESH) for i in range(8)]
    # by the price alone no draft pays at batch 8 (the 9th row's jump) at the prior's estimate
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


def test_requests_the_price_skips_are_looked_up_only_for_exploration_every_few_steps():
    spec, proposer = _speculator(jump=True)
    reqs = [_req(f"r{i}", COPY if i == 0 else FRESH) for i in range(8)]
    for r in reqs[1:]:  # unlikely drafts everywhere else: the bound says no draft can pay
        spec._state(r).rates = [0.05] * 8
    spec._state(reqs[0]).rates = [0.05] * 8
    seen = [spec.propose(reqs, 4096) for _ in range(spec.tries.lookup_every)]
    assert seen[:-1] == [{}] * (spec.tries.lookup_every - 1)
    assert proposer.lookups == 8  # all on the last step: every request is still owed its tries
    assert seen[-1] == {"r0": [9, 10, 11, 12]}
    for r in reqs:  # tried twice (and missed): nobody is owed a try, nobody is looked up any more
        r.spec.tried[0] = spec.tries.tries
    lookups = proposer.lookups
    for _ in range(3 * spec.tries.lookup_every):
        assert spec.propose(reqs, 4096) == {}
    assert proposer.lookups == lookups


def test_short_matches_and_plain_policy_are_not_explored():
    spec, _ = _speculator(jump=True)
    short = _req("s", [1, 2, 9, 7, 1, 2])  # the tail "1 2" matched: 2 tokens, below min_match
    reqs = [short] + [_req(f"f{i}", FRESH) for i in range(7)]
    for _ in range(2 * spec.tries.lookup_every):
        assert spec.propose(reqs, 4096) == {}
    off, _ = _speculator(jump=True, rules=TryRules(tries=0))  # exploration off: as before, nothing at all
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


def test_rules_are_off_by_default():
    spec, proposer = _speculator(jump=False, rules=TryRules())
    req = _req("r", COPY)
    for _ in range(10):  # misses never back off: a lookup every step, the price decides
        spec.propose([req], 4096)
        spec.verified(req, 2, 0)
    assert req.spec.backoff_until == 0 and proposer.lookups == 10
    spec, _ = _speculator(jump=True, rules=TryRules())
    assert spec.propose([_req("c", COPY)] + [_req(f"f{i}", FRESH) for i in range(7)], 4096) == {}


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
        eager = [r + 0.075 * (0.6 - r) for r in eager]
    assert abs(lazy.first_rate() - eager[0]) < 1e-12
    lazy.settle()
    assert max(abs(a - b) for a, b in zip(lazy.rates, eager, strict=True)) < 1e-12


def test_steps_overlap_where_no_drafts_can_pay():
    """`wants_fresh_step` says whether the engine must wait for the step in flight (so its requests can draft
    in the next) or may schedule the next step ahead of it, as without speculation."""
    # batch 8 at the 9th row's jump with the prior's estimates: no draft pays, no exploration (rules off)
    plain, _ = _speculator(jump=True, rules=TryRules())
    reqs = [_req(f"r{i}", COPY if i == 0 else FRESH) for i in range(8)]
    assert not plain.wants_fresh_step(reqs, 4096)
    assert plain.propose(reqs, 4096) == {}  # the step it lets run without a fresh schedule drafts nothing anyway
    # rows on the C path cheap: drafts at the prior pay, so the requests must get a fresh step to draft in
    cheap, _ = _speculator(jump=False, rules=TryRules())
    assert cheap.wants_fresh_step(reqs, 4096)
    # ... where some request's tokens as they are now have an n-gram match (COPY's): requests that find
    # none (chat, most steps) keep overlapping, though the price would pay for their drafts
    assert not cheap.wants_fresh_step(reqs[1:], 4096)
    assert cheap.propose(reqs[1:], 4096) == {}
    # ... but not a request whose own estimates say its drafts are not kept
    for r in reqs:
        cheap._state(r).rates = [0.01] * 8
        cheap._state(r).prior = 0.01
        cheap._state(r)._ceilings.clear()  # set by hand here, not by `observe` (which clears it)
    assert not cheap.wants_fresh_step(reqs, 4096)
    # exploration on: a fresh step exactly when the next step is an exploration lookup
    spec, _ = _speculator(jump=True)
    wants = []
    for _ in range(2 * spec.tries.lookup_every):
        wants.append(spec.wants_fresh_step(reqs, 4096))
        spec.propose(reqs, 4096)
    assert wants == [(s + 1) % spec.tries.lookup_every == 0 for s in range(2 * spec.tries.lookup_every)]
    # a fixed draft length always drafts: always a fresh step
    fixed = Speculator(SpeculativeMethod("ngram", 4, adaptive=False), CostModel(), NgramProposer(2, 5))
    assert fixed.wants_fresh_step(reqs, 4096)
