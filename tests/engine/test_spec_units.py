"""Speculative decoding, pure-CPU parts: proposers, the draft-length policy, verification rules (greedy
and rejection sampling against an exact target distribution), config parsing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from deepinfer.config import EngineConfig, parse_speculative
from deepinfer.engine.cost_model import CostModel
from deepinfer.engine.request import Request
from deepinfer.engine.sampler import Sampler
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.spec.ngram import NgramProposer, find_continuation
from deepinfer.engine.spec.policy import Candidate, DraftLengthPolicy, expected_tokens
from deepinfer.engine.spec.suffix import SuffixProposer
from deepinfer.engine.spec.verify import verify
from tests.engine.spec_utils import assert_all_free, random_acceptance_stats


def _req(tokens: list[int], rid: str = "r", **params) -> Request:
    return Request(rid, tokens, SamplingParams(**params))


def test_ngram_finds_latest_longest_match():
    toks = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 1, 2, 3]
    # "2 3" last seen before the tail at 6..7 (followed by 4 7 8), "1 2 3" at 0..2 (followed by 4 5)
    assert find_continuation(toks, 2, 3, 3) == [4, 5, 9]
    assert find_continuation(toks, 2, 2, 3) == [4, 7, 8]
    assert find_continuation([5, 6, 7], 2, 4, 3) == []
    assert NgramProposer(2, 4).propose(_req(toks), 2).token_ids == (4, 5)


def test_suffix_proposer_grows_with_output_and_reports_confidence():
    p = SuffixProposer(max_depth=4, min_match=2, min_confidence=0.0)
    req = _req([10, 11, 12, 13, 10, 11, 12, 14, 10, 11])
    d = p.propose(req, 3)
    # context "10 11" -> 12 twice; then "10 11 12" -> 13 once, 14 once (the latest, 14, wins the tie)
    assert d.token_ids[0] == 12 and d.confidence[0] == 1.0
    assert d.token_ids[1] == 14 and d.confidence[1] == 0.5
    req.token_ids += [12, 14]  # output appended: indexed at the next proposal
    assert p.propose(req, 1).token_ids == (10,)
    p.on_finished(req)
    assert not p.indexes


def test_suffix_recent_requests_are_indexed_and_bounded():
    p = SuffixProposer(max_depth=4, min_match=2, min_confidence=0.0, recent_requests=1)
    a = _req([1, 2, 3, 4, 5], "a")
    p.on_finished(a)
    assert p.propose(_req([9, 2, 3], "b"), 2).token_ids == (4, 5)
    p.on_finished(_req([7, 7, 7], "c"))  # evicts a
    assert p.propose(_req([9, 2, 3], "d"), 2).token_ids == ()


def _priced(seconds_of_rows) -> DraftLengthPolicy:
    """A policy whose verification price is a measured table: T(R) = seconds_of_rows(R) for R = 1..300."""
    pol = DraftLengthPolicy(CostModel())
    pol.price.c_path_rows = 8  # the regimes are fitted apart: the jump at 9 rows stays a jump
    pol.price.seed([(r, seconds_of_rows(r)) for r in range(1, 301)])
    return pol


def test_policy_long_drafts_when_cheap_none_when_compute_bound():
    # an idle machine at batch 1: a row costs 1/30 of the step's fixed 30 ms
    cheap = _priced(lambda r: 0.03 + 0.001 * r)
    assert cheap.choose([Candidate(100, [0.8] * 5)], 1) == [5]
    # near compute-bound (a row costs 2 ms next to a 20 ms step overhead, the step already 64 rows): a 0.3
    # acceptance is not worth verifying
    heavy = _priced(lambda r: 0.02 + 0.002 * r)
    assert heavy.choose([Candidate(100, [0.3] * 5)] * 64, 64) == [0] * 64
    # but a confident request still gets a draft in the same batch
    ks = heavy.choose([Candidate(100, [0.99] * 5)] + [Candidate(100, [0.3] * 5)] * 63, 64)
    assert ks[0] > 0 and ks[1:] == [0] * 63
    assert DraftLengthPolicy(CostModel(), adaptive=False).choose([Candidate(5, [0.0] * 3)], 1) == [3]
    assert expected_tokens([0.5] * 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_policy_prices_by_row_count_across_a_jump():
    """Steps of up to 8 rows cost one decode (the C path), a 9th row 10 ms more, each after it 1 ms: at batch 1 a likely
    draft fills the cheap rows and stops at the jump; a very likely long draft is worth crossing it; at
    batch 8 (already at the jump) a 0.6 draft is not worth it."""
    pol = _priced(lambda r: 0.02 if r <= 8 else 0.03 + 0.001 * (r - 8))
    assert pol.choose([Candidate(100, [0.6] * 12)], 1) == [7]
    assert pol.choose([Candidate(100, [0.99] * 30)], 1) == [30]
    assert pol.choose([Candidate(100, [0.6] * 5)] * 8, 8) == [0] * 8
    # drafts go to the requests most likely to keep them, in prefix order
    ks = pol.choose([Candidate(100, [0.9, 0.9, 0.9]), Candidate(100, [0.5, 0.5]), Candidate(100, [])], 3)
    assert ks == [3, 2, 0]


def test_proposing_is_skipped_only_when_no_drafts_could_pay():
    pol = _priced(lambda r: 0.02 if r <= 8 else 0.03 + 0.001 * (r - 8))
    assert pol.any_draft_can_pay([0.6], 8)  # batch 1: the cheap rows of the C path
    assert not pol.any_draft_can_pay([0.1] * 8, 8)  # batch 8, unlikely drafts: the jump is not worth it
    # several likely requests together cross the jump that one alone would not
    assert not pol.any_draft_can_pay([0.9] + [0.0] * 7, 2)
    assert pol.any_draft_can_pay([0.9] * 8, 5)
    assert DraftLengthPolicy(CostModel(), adaptive=False).any_draft_can_pay([0.0], 3)


def test_step_price_table_is_monotone_robust_and_follows_measurements():
    from deepinfer.engine.spec.step_price import StepPrice, profile_row_counts

    price = StepPrice(CostModel())
    assert price.seconds(4) > price.seconds(1) > 0  # no measurement yet: the cost model's decode rows
    price.seed([(1, 0.010), (2, 0.030), (4, 0.012), (8, 0.016)])  # one noisy count (2)
    t = price.table(16)
    assert np.all(np.diff(t) >= 0)  # isotonic: the noisy count is pooled, not carried to every later count
    assert t[8] == pytest.approx(0.016, rel=0.3) and t[3] < 0.030
    assert t[16] > t[8]  # past the largest measured count: extended at its cost per row
    for _ in range(price.REBUILD_EVERY):  # the median of the recent steps of a count replaces its seed
        price.observe(8, 0.040)
    assert price.seconds(8) == pytest.approx(0.040, rel=0.1)
    # and the counts only profiled follow: served steps cost 2.5x what the profile measured (its bias)
    assert price.seconds(4) > t[4] * 1.5
    # within a regime, one slow count among its neighbours is smoothed, not kept as a step up
    smooth = StepPrice(CostModel(), c_path_rows=8)
    smooth.seed([(r, 0.020 + 0.001 * r + (0.010 if r == 4 else 0.0)) for r in range(1, 9)])
    assert smooth.seconds(5) - smooth.seconds(3) < 0.006 and smooth.seconds(8) < 0.032
    counts = profile_row_counts(288, 8)
    assert counts[:33] == list(range(1, 34)) and counts[-1] == 288 and len(counts) < 60
    # both sides of the batched path's block edges, where its staircase steps
    assert {48, 49, 64, 65, 128, 129} <= set(counts) and 50 not in counts
    assert profile_row_counts(17, 8) == list(range(1, 18))


def _staircase(r: int) -> float:
    """The AMD machine's shape at one thread (benchmarks/BENCHMARKS.md, issue #21 session 15): the C path's
    rows cheap up to 8, then the batched path in blocks of 16 rows (9-16 one price, 17-32 the next)."""
    return 0.008 + 0.0017 * r if r <= 8 else 0.025 + 0.014 * ((r - 1) // 16)


def test_step_price_keeps_the_batched_paths_staircase():
    from deepinfer.engine.spec.step_price import StepPrice, profile_row_counts

    price = StepPrice(CostModel(), c_path_rows=8)
    price.seed([(r, _staircase(r)) for r in profile_row_counts(17 * 32, 8)])
    t = price.table(80)
    assert t[16] == pytest.approx(t[9]) and t[32] == pytest.approx(t[17])  # a block's rows cost the same
    assert t[17] > t[16] * 1.4 and t[33] > t[32] * 1.2  # the next block's first row costs the jump
    assert t[49] > t[48] and t[48] == pytest.approx(_staircase(48))


def test_step_price_smooths_the_batched_path_without_row_blocks():
    """Panels (`panel_gemm.c`) cost each row its own arithmetic: one fast step measured at 33 rows must not make
    rows 33-34 free at batch 32, as the unsmoothed staircase table does with the same samples."""
    from deepinfer.engine.spec.step_price import StepPrice, profile_row_counts

    def linear(r: int) -> float:
        return 0.002 + 0.0005 * r if r <= 8 else 0.003 + 0.00045 * r

    samples = [(r, linear(r) * (0.93 if r == 33 else 1.0)) for r in profile_row_counts(256, 8)]
    blocks = StepPrice(CostModel(), c_path_rows=8)
    blocks.seed(samples)
    assert blocks.seconds(33) == pytest.approx(blocks.seconds(32))  # the dip pooled flat: the 33rd row is free
    smooth = StepPrice(CostModel(), c_path_rows=8)
    smooth.row_blocks = False
    smooth.seed(samples)
    t = smooth.table(40)
    assert np.all(np.diff(t) >= 0)
    assert t[34] - t[32] > 0.5 * (linear(34) - linear(32))  # each extra row priced near its cost
    assert t[32] == pytest.approx(linear(32), rel=0.05)
    # a draft at 0.7 does not repay its row at batch 32 on the smooth table; on the flat one it seemed to
    cands = [Candidate(100, [0.7])] + [Candidate(100, [])] * 31
    for price, expected in ((blocks, [1] + [0] * 31), (smooth, [0] * 32)):
        pol = DraftLengthPolicy(CostModel())
        pol.price = price
        assert pol.choose(cands, 32) == expected


def test_policy_fills_the_row_block_it_pays_for():
    pol = DraftLengthPolicy(CostModel())
    pol.price.c_path_rows = 8
    pol.price.seed([(r, _staircase(r)) for r in range(1, 301)])
    # batch 1, a long likely copy: 15 drafts fill the first block; the 16th would start the next block
    assert pol.choose([Candidate(100, [0.9] * 16)], 1) == [15]
    # batch 8 (the C path's last row): one likely draft each is worth the block they fill, a 2nd row each is not
    assert pol.choose([Candidate(100, [0.7] * 5)] * 8, 8) == [1] * 8
    # unlikely drafts are not worth the jump from the C path at all
    assert pol.choose([Candidate(100, [0.1] * 5)] * 8, 8) == [0] * 8
    # batch 32 (two full blocks): the 33rd row costs a block; drafts at 0.6 do not repay it, at 0.95 they do,
    # and then only in whole blocks
    assert pol.choose([Candidate(100, [0.6] * 4)] * 32, 32) == [0] * 32
    drafts = sum(pol.choose([Candidate(100, [0.95] * 4)] * 32, 32))
    assert drafts > 0 and (32 + drafts) % 16 == 0


def test_the_skip_bound_reads_each_requests_estimates():
    """The bound that lets a step skip the proposer is the choice itself on each request's best possible
    drafts (per position max(estimate, prior)), so it never skips a step `choose` would draft in, and it
    does skip a batch of requests whose drafts keep missing even where the first-rate bound would not."""
    from deepinfer.engine.spec.policy import AcceptanceStats

    pol = DraftLengthPolicy(CostModel())
    pol.price.c_path_rows = 8
    pol.price.seed([(r, _staircase(r)) for r in range(1, 301)])
    prior = AcceptanceStats.new(0.6, 16)
    missed = AcceptanceStats.new(0.1, 16)
    for _ in range(4):
        missed.observe(4, 0, 0.3)  # first drafts rejected: the estimate falls below the prior (0.1)
    assert missed.estimates()[0] < 0.05 and missed.gain_ceiling()[0] == pytest.approx(0.1)
    assert not pol.drafts_can_pay(8, [missed.gain_ceiling()] * 8)  # at batch 8: not worth the jump
    assert pol.drafts_can_pay(8, [prior.gain_ceiling()] * 8)
    # an upper bound of what `choose` does on the same estimates, for any proposal
    rng = np.random.default_rng(0)
    for _ in range(300):
        b = int(rng.integers(1, 40))
        stats = random_acceptance_stats(rng, b)
        cands = [Candidate(100, s.estimates()[:int(rng.integers(0, 17))]) for s in stats]
        if any(pol.choose(cands, b)):
            assert pol.drafts_can_pay(b, [s.gain_ceiling() for s in stats])


def test_greedy_verification_keeps_the_matching_prefix():
    logits = torch.full((4, 10), -5.0)
    for row, t in enumerate([3, 4, 9, 1]):
        logits[row, t] = 5.0
    req = _req([0, 1], temperature=0.0)
    v = verify(Sampler(), logits, [(req, 0, [3, 4, 5])])[0]
    assert v.accepted == [3, 4] and v.token == 9
    v = verify(Sampler(), logits, [(req, 0, [3, 4, 9])])[0]
    assert v.accepted == [3, 4, 9] and v.token == 1  # bonus token
    v = verify(Sampler(), logits, [(req, 0, [7])])[0]
    assert v.accepted == [] and v.token == 3


def test_plain_greedy_verification_reads_the_argmax_as_the_general_path_does():
    """A step whose requests are all plain greedy takes each row's argmax from the logits as they are (bf16
    here, no float32 copy); its verdicts must be the general path's, which a sampled request in the same
    step forces (ties included: every logit rounded to a few bfloat16 values)."""
    gen = torch.Generator().manual_seed(3)
    kept = 0
    for trial in range(50):
        rows = 24
        logits = (torch.randint(0, 4, (rows + 4, 50), generator=gen).float()).to(torch.bfloat16)
        top = logits.float().argmax(-1).tolist()
        items, first = [], 0
        for i in range(4):
            n = int(torch.randint(1, 6, (1,), generator=gen))
            drafts = [top[first + j] if torch.rand(1, generator=gen) < 0.8 else 49 - top[first + j] for j in range(n)]
            items.append((_req([0, 1], f"g{i}", temperature=0.0), first, drafts))
            first += n + 1
        fast = verify(Sampler(), logits, items)
        sampled = (_req([0, 1], "s", temperature=1.0, seed=trial), first, [])
        general = verify(Sampler(), logits, [*items, sampled])[:len(items)]
        assert [(v.accepted, v.token) for v in fast] == [(v.accepted, v.token) for v in general], trial
        kept += sum(len(v.accepted) for v in fast)
    assert kept > 50


def test_greedy_verification_applies_penalties_over_kept_drafts():
    # row 1 prefers token 3 slightly over 4; a frequency penalty on 3 (kept as draft 0) flips it
    logits = torch.zeros(2, 8)
    logits[0, 3] = 5.0
    logits[1, 3], logits[1, 4] = 2.0, 1.9
    req = _req([0], temperature=0.0, frequency_penalty=1.0)
    v = verify(Sampler(), logits, [(req, 0, [3, 3])])[0]
    assert v.accepted == [3] and v.token == 4


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=3),
                                    dict(temperature=1.0, top_p=0.8)], ids=["plain", "top_k", "top_p"])
def test_rejection_sampling_keeps_the_target_distribution(params):
    """Chi-square goodness of fit (alpha = 0.001) of the first emitted token and of the pair (first, second)
    to the exact target distribution, with point drafts of high, low and zero target probability."""
    torch.manual_seed(0)
    vocab = 6
    logits = torch.randn(3, vocab) * 1.5
    sampler = Sampler(seed=1)
    probe = _req([0], **params)
    p = [sampler.target_probs(logits[i:i + 1], [probe])[0].double().numpy() for i in range(3)]
    n = 4000
    for draft in ([int(np.argmax(p[0])), int(np.argmax(p[1]))], [int(np.argmin(p[0])), 2]):
        items = [(_req([0], **params), 0, draft) for _ in range(n)]
        verdicts = verify(sampler, logits.repeat(1, 1), [(r, 0, d) for r, _, d in items])
        first = [(v.accepted + [v.token])[0] for v in verdicts]
        counts = np.bincount(first, minlength=vocab)
        keep = p[0] > 0
        assert counts[~keep].sum() == 0
        assert chisquare(counts[keep], n * p[0][keep] / p[0][keep].sum()).pvalue > 1e-3
        # second token, given the first was the first draft (row 1's distribution applies then)
        second = [(v.accepted + [v.token])[1] for v in verdicts if v.accepted[:1] == draft[:1]]
        counts = np.bincount(second, minlength=vocab)
        keep = p[1] > 0
        if len(second) > 200:
            assert counts[~keep].sum() == 0
            assert chisquare(counts[keep], len(second) * p[1][keep] / p[1][keep].sum()).pvalue > 1e-3


def test_config_parsing():
    m = parse_speculative('{"method": "suffix", "num_speculative_tokens": 4}')
    assert m.method == "suffix" and m.num_speculative_tokens == 4 and m.adaptive
    assert parse_speculative("none") is None and parse_speculative(None) is None
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        parse_speculative({"method": "ngram", "num_speculative_tokens": 3, "bogus": 1})
    with pytest.raises(ValueError, match="method must be one of"):
        parse_speculative({"method": "eagle", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        parse_speculative({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_speculative("{method: ngram}")
    cfg = EngineConfig.from_kwargs(speculative_config={"method": "draft_model", "num_speculative_tokens": 3})
    assert cfg.speculative.speculative_config.method == "draft_model"
    from deepinfer.engine.spec import build_proposer

    with pytest.raises(ValueError, match="runs a model"):  # built by the engine core (model_proposers.py)
        build_proposer(cfg.speculative.speculative_config)


def test_profile_measures_the_counts_that_shape_the_table_first():
    """A profile cut short by its time limit (a slow machine) has the C path's counts and the block edges, so
    the table past the cut is the staircase interpolated between edges, not a ramp from the last counts."""
    from deepinfer.engine.spec.step_price import StepPrice, profile_order, profile_row_counts

    counts = profile_row_counts(17 * 32, 8)
    order = profile_order(counts, 8)
    assert sorted(order) == sorted(counts)
    assert order[:13] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 32, 33]
    assert order.index(64) < order.index(10)  # edges of larger blocks before the counts inside a block
    cut = order[:order.index(33) + 1]  # the time limit hit after 33 rows
    price = StepPrice(CostModel(), c_path_rows=8)
    price.seed([(r, _staircase(r)) for r in cut])
    t = price.table(64)
    assert t[32] == pytest.approx(t[17]) and t[12] == pytest.approx(t[9])
    # past the last measured count (33, the first row of a block): not the 32 -> 33 jump per row
    assert t[48] < t[33] + 16 * (t[33] - t[32]) / 4


def test_profile_measures_the_small_counts_three_times_first():
    """The counts where batch 1 and small batches choose are measured three times (the fastest kept) before
    anything else, so a time limit cannot leave them with one noisy step each."""
    from deepinfer.engine.spec.step_price import profile_order, profile_row_counts, profile_schedule

    order = profile_order(profile_row_counts(17 * 32, 8), 8)
    steps = profile_schedule(order, 8)
    small = list(range(1, 10))
    assert steps[:27] == small * 3
    assert sorted(set(steps)) == sorted(order)
    assert all(steps.count(r) == 2 for r in order if r > 9)
    # then the next two row blocks' counts (batch 8's choices) twice, before any larger count
    near = [r for r in order if 9 < r <= 33]
    assert steps[27:27 + 2 * len(near)] == near * 2


def test_drafts_must_clear_their_break_even_by_the_margin():
    """A draft row that costs 0.75 of what a kept token saves (batch 8 past the C path on the AVX2 machine):
    drafts kept with probability 0.8 are past the break-even but within the estimates' error, and are not
    chosen; 0.9 clears it by more than the margin."""
    from deepinfer.engine.spec.policy import Candidate, DraftLengthPolicy

    pol = DraftLengthPolicy(CostModel())
    # T(8) = 0.08 s: a kept token saves 0.01 s; each draft row costs 0.0075 s
    pol.price.seed([(r, 0.08 + 0.0075 * (r - 8) if r >= 8 else 0.01 * r) for r in range(1, 301)])
    assert DraftLengthPolicy.MARGIN == 0.1
    for p, want in ((0.8, False), (0.9, True)):
        ks = pol.choose([Candidate(100, [p])] * 8, 8)
        assert (sum(ks) > 0) == want, (p, ks)
        assert pol.drafts_can_pay(8, [np.full(1, p)] * 8) == want


def test_the_draft_count_is_the_same_in_plain_python_and_in_numpy():
    """`DraftLengthPolicy._best_count` runs small inputs in plain Python and large ones in numpy: both must
    choose the same count (the first maximum, or the first count that beats none) on the same table, here
    the CPU shape (C path to 8 rows, then a jump and 16-row blocks) under a few host times and batches."""
    rng = np.random.default_rng(0)
    policy = DraftLengthPolicy(CostModel())
    policy.price.c_path_rows = 8
    policy.price.seed([(r, 0.008 + 0.004 * min(r, 8) + (0.015 + 0.02 * ((r - 9) // 16) if r > 8 else 0.0))
                       for r in range(1, 600)])
    chosen = set()
    for trial in range(300):
        b = int(rng.integers(1, 40))
        gains = sorted(np.cumprod(rng.uniform(0.3, 1.0, int(rng.integers(1, 120)))).tolist(), reverse=True)
        policy.price.host_seconds = float(rng.choice([0.0, 0.0005, 0.005]))
        policy.price.draft_host_seconds = policy.price.host_seconds + float(rng.choice([0.0, 0.001]))
        for first in (False, True):
            policy.SMALL = 1 << 20
            python = policy._best_count(b, gains, first)
            policy.SMALL = 0
            assert policy._best_count(b, gains, first) == python, (trial, b, first)
            chosen.add(python)
    assert len(chosen) > 5  # the inputs reach many different counts, none among them included
    assert 0 in chosen


def _match_by_hand(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[list[int], int]:
    """The n-gram rule spelled out: for n from max_n down to min_n, the most recent earlier place (with a
    token after it) where the last n tokens occur; the up to k tokens after it, and n."""
    end = len(tokens) - 1
    for n in range(min(max_n, end), min_n - 1, -1):
        tail = tokens[-n:]
        for s in range(end - n, -1, -1):
            if tokens[s:s + n] == tail:
                return tokens[s + n:s + n + k], n
    return [], 0


def test_the_ngram_search_matches_the_rule_spelled_out():
    """`find_match` searches the tokens' bytes (4 per token) with `bytes.rfind`: against a plain scan, on
    random sequences over small vocabularies (many repeats) and large token ids (bytes that repeat inside
    tokens, so hits that straddle two tokens must be skipped)."""
    from deepinfer.engine.spec.ngram import find_match

    rng = np.random.default_rng(1)
    found = 0
    for trial in range(3000):
        size = int(rng.integers(1, 80))
        if trial % 5 == 4:  # ids made of the same few bytes: the last tokens' bytes occur across token edges
            tokens = rng.choice([0x01010101, 0x00010101, 0x01010100, 0x01000101], size).tolist()
        else:
            tokens = rng.integers(0, [3, 8, 50, 49152][trial % 4], size).tolist()
        min_n, max_n, k = int(rng.integers(1, 4)), int(rng.integers(3, 7)), int(rng.integers(0, 10))
        min_n = min(min_n, max_n)
        want = _match_by_hand(tokens, min_n, max_n, k) if k > 0 and len(tokens) > min_n else ([], 0)
        if not want[0]:
            want = ([], 0)
        assert find_match(tokens, min_n, max_n, k) == want, (tokens, min_n, max_n, k)
        found += bool(want[0])
    assert found > 500


def _heap_merge_choice(pol: DraftLengthPolicy, probs: list[list[float]], b: int) -> list[int]:
    """The choice spelled out: merge the candidates' gain sequences (prefix products) highest first through
    a heap, ties by candidate then position, each ending at its first zero; keep the first `_best_count`."""
    import heapq

    heap = [(-p[0], i, 0) for i, p in enumerate(probs) if p and p[0] > 0]
    heapq.heapify(heap)
    order, gains = [], []
    while heap:
        g, i, j = heapq.heappop(heap)
        order.append(i)
        gains.append(-g)
        if j + 1 < len(probs[i]) and probs[i][j + 1] > 0:
            heapq.heappush(heap, (g * probs[i][j + 1], i, j + 1))
    ks = [0] * len(probs)
    for i in order[:pol._best_count(b, gains)]:
        ks[i] += 1
    return ks


def test_the_batch_choice_is_the_heap_merge_of_the_candidates_gains():
    """`choose_rows` sorts every candidate's gains at once, `choose` merges them through a heap; both must
    choose what merging the candidates' gain sequences one token at a time chooses, ties (probabilities of 1, equal candidates) and zeros
    included, at small and large batches (either side of `_best_count`'s numpy switch)."""
    rng = np.random.default_rng(1)
    pol = DraftLengthPolicy(CostModel())
    pol.price.c_path_rows = 8
    pol.price.seed([(r, _staircase(r)) for r in range(1, 700)])
    drafted = 0
    for trial in range(400):
        b = int(rng.integers(1, 40))
        n = int(rng.integers(1, b + 1))
        probs = []
        for _ in range(n):
            row = rng.choice([0.0, 0.3, 0.6, 0.9, 0.97, 1.0], size=int(rng.integers(0, 17)),
                             p=[0.05, 0.1, 0.15, 0.3, 0.2, 0.2]).tolist()
            probs.append(row if rng.random() < 0.5 or not probs else list(probs[-1]))  # equal candidates too
        want = _heap_merge_choice(pol, probs, b)
        assert pol.choose([Candidate(100, p) for p in probs], b) == want, trial
        lengths = [len(p) for p in probs]
        rows = np.zeros((n, max(lengths + [1])))
        for row, p in zip(rows, probs, strict=True):
            row[:len(p)] = p
        assert pol.choose_rows(rows, lengths, b) == want, trial
        drafted += sum(want) > 0
    assert 50 < drafted < 400  # both outcomes happen


def test_batch_estimates_bounds_and_keep_probs_match_the_per_request_ones():
    """The batch forms the speculator computes every step (`estimate_rows`, `ceiling_gains`,
    `PooledAcceptance.match_prob_rows`) against the per-request definitions they replace."""
    import copy
    import math

    from deepinfer.engine.spec.policy import MAX_KEEP_PROB, PooledAcceptance, ceiling_gains, estimate_rows

    rng = np.random.default_rng(2)
    pool = PooledAcceptance(0.6, 16)
    for _ in range(200):
        d = int(rng.integers(1, 17))
        pool.observe(int(rng.integers(0, 6)), d, int(rng.integers(0, d + 1)))
    boost = pool.boost()
    assert boost is not None and (boost > 1).any()
    idle = untried = 0
    for _ in range(50):
        stats = random_acceptance_stats(rng, int(rng.integers(1, 33)), pool.rates, relax_weight=0.05)
        idle += sum(bool(s.idle_steps) for s in stats)
        untried += sum(not s.tried[0] for s in stats)
        by_hand = copy.deepcopy(stats)
        rows = estimate_rows(stats)
        want = [s.estimates() for s in by_hand]
        assert rows.tolist() == want  # the same values, bit for bit
        assert [s.rates for s in stats] == [s.rates for s in by_hand] and not any(s.idle_steps for s in stats)
        limits = rng.integers(0, 17, len(stats)).tolist()
        for confident in (False, True):
            for b in (None, boost):
                flat = ceiling_gains(rows, [s.prior for s in stats], limits, confident, b)
                each = []
                for e, s, lim in zip(want, stats, limits, strict=True):
                    r = np.maximum(np.asarray(e), np.maximum.accumulate(s.prior))
                    r = np.sqrt(r) if confident else r
                    if b is not None:
                        r = np.minimum(r * b, np.maximum(r, math.sqrt(MAX_KEEP_PROB) if confident else MAX_KEEP_PROB))
                    each.append(np.cumprod(r)[:lim])
                assert np.array_equal(flat, np.concatenate(each))
        matches = rng.integers(0, 7, len(stats)).tolist()
        assert pool.match_prob_rows(rows, matches).tolist() == [pool.match_probs(e, m) for e, m in
                                                                zip(want, matches, strict=True)]
    assert idle > 100 and untried > 20  # the inputs have idle drift to settle and positions to carry forward


def test_step_price_host_time_ignores_an_idle_spell_and_a_moved_count_is_repriced_at_once():
    from deepinfer.engine.spec.step_price import StepPrice

    price = StepPrice(CostModel())
    price.observe_host(0.011)  # the first step after the engine waited for work: idle time, not host work
    for _ in range(6):
        price.observe_host(0.001)
    assert price.host_seconds == pytest.approx(0.001)
    price.observe_host(0.050)  # and again later
    assert price.host_seconds == pytest.approx(0.001)
    # a profiled count the served steps contradict: 65 rows measured at 1.4x 32 rows, served at 1.9x
    price.seed([(32, 0.017), (48, 0.020), (64, 0.023), (65, 0.0235)])
    assert price.seconds(65) == pytest.approx(0.0235)
    for _ in range(3):
        price.observe(32, 0.017)
        price.observe(65, 0.032)
    assert price.seconds(65) / price.seconds(32) > 1.8  # repriced after 3 steps, not REBUILD_EVERY


def test_drafting_steps_host_time_is_priced_apart():
    """A step that verifies drafts costs more host time than a plain one; drafts that pay under one host
    time for all steps are not chosen once the drafting steps' own (longer) host time is known."""
    pol = DraftLengthPolicy(CostModel())
    pol.price.seed([(r, 0.006 + 0.0003 * r) for r in range(1, 200)])
    for _ in range(5):
        pol.price.observe_host(0.001)
    assert pol.price.draft_host_seconds == pytest.approx(0.001)  # none seen yet: the plain steps'
    one_each = [Candidate(100, [0.75])] * 32
    assert pol.choose(one_each, 32) == [1] * 32
    for _ in range(5):
        pol.price.observe_host(0.005, drafted=True)
    assert pol.price.host_seconds == pytest.approx(0.001) and pol.price.draft_host_seconds == pytest.approx(0.005)
    assert pol.choose(one_each, 32) == [0] * 32
    assert not pol.drafts_can_pay(32, [np.full(1, 0.75)] * 32)
    assert sum(pol.choose([Candidate(100, [0.99] * 8)] * 32, 32)) > 0  # long, likely drafts still pay


def test_step_price_scales_the_profiled_counts_by_what_served_steps_cost():
    """The start-up profile's synthetic steps run cheaper than served verification steps; once some counts
    are served, the counts only profiled are priced at the profile times the served / profiled ratio of
    their regime (C decode path, batched path), each regime its own."""
    from deepinfer.engine.spec.step_price import StepPrice

    price = StepPrice(CostModel(), c_path_rows=8)
    price.seed([(r, 0.004 + 0.0002 * r) for r in range(1, 9)] + [(r, 0.006 + 0.0004 * r) for r in range(9, 66)])
    t = price.table(65)
    for _ in range(3):
        for r in (16, 17, 18):  # served batched steps 25% dearer than profiled
            price.observe(r, 1.25 * (0.006 + 0.0004 * r))
    for r in (20, 40, 65):
        assert price.seconds(r) / t[r] == pytest.approx(1.25, rel=0.05)
    assert price.seconds(4) == pytest.approx(t[4], rel=0.05)  # the C path's counts: no served evidence
    for _ in range(3):
        price.observe(1, 0.9 * 0.0042)
    assert price.seconds(4) == pytest.approx(0.9 * t[4], rel=0.05)


def test_profile_divides_larger_counts_by_the_drift_its_reference_steps_measured():
    """A slow spell that starts after the small counts were measured (every step 1.4x slower) must not
    price the larger counts 1.4x dearer against them: each is divided by the reference steps beside it.
    One slow reference among its three nearest moves nothing (their median)."""
    from deepinfer.engine.spec.step_price import drift_corrected

    level = 0.010  # the 8-row reference among the small counts
    timed = [(8, level), (9, 0.0105)]  # measured in a quiet moment
    references = []
    for i, rows in enumerate([16, 24, 32]):  # measured in a spell 1.4x slower
        references.append((len(timed), 1.4 * level * (1.5 if i == 1 else 1.0)))  # one reference slower still
        timed.append((rows, 1.4 * level * rows / 11))
    out = dict(drift_corrected(timed, references, 8, level))
    assert out[8] == level and out[9] == pytest.approx(0.0105 / 1.4)  # the quiet ones only where a reference sat
    for rows in (16, 24, 32):
        assert out[rows] == pytest.approx(level * rows / 11)
    # without references (or a level) the steps stand as measured
    assert drift_corrected(timed, [], 8, level) == timed
    assert drift_corrected(timed, references, 8, 0.0) == timed


def test_profile_times_reference_steps_apart_from_the_counts(tiny_models):
    """The real runner: with a reference due before every larger step, each larger count's step is preceded
    by a step of the reference count, and the returned entries are the scheduled counts only (a reference
    step is not one of the reference count's samples)."""
    from deepinfer import LLM
    from deepinfer.engine.spec.step_price import profile_rows

    llm = LLM(str(tiny_models["llama"]), dtype="float32")
    core = llm.engine.core
    executed: list[int] = []
    execute = core.runner.execute

    def counting(plan, tables):
        executed.append(sum(s.num_new_tokens for s in plan.scheduled))
        return execute(plan, tables)

    core.runner.execute = counting
    try:
        got = profile_rows(core.runner, core.kv, [1, 2, 3, 9, 12, 9, 12], 4, context=16, reference=3,
                           reference_every_s=0.0)
    finally:
        core.runner.execute = execute
    assert executed == [1, 1, 2, 3, 3, 9, 3, 12, 3, 9, 3, 12]  # the warm-up, then a reference before each > 3
    assert [r for r, _ in got] == [1, 2, 3, 9, 12]
    assert all(s > 0 for _, s in got)
    assert_all_free(llm)  # every profile step's blocks went back
