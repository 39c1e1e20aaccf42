"""Speculation in a closed batch (`LLM.generate`): each request's drafts weighed by its projected finish
(engine/spec/policy.py `FinishBalance`). The weights' arithmetic on set clocks, their effect on the
draft choice and on the skip bound, and a real engine that runs `generate` as a closed batch."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer import LLM
from deepinfer.config import SpeculativeMethod
from deepinfer.engine.cost_model import CostModel
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.spec.policy import AcceptanceStats, Candidate, DraftLengthPolicy, FinishBalance
from deepinfer.engine.spec.speculator import Speculator
from tests.engine.spec_utils import CorruptedOracle, assert_all_free, greedy, spec_config, token_ids


def _req(rid: str, max_tokens: int | None = 96, made: int = 0) -> Request:
    req = Request(rid, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=max_tokens))
    req.token_ids.extend([7] * made)
    return req


def _emit(req: Request, n: int) -> None:
    req.token_ids.extend([7] * n)


def test_weights_are_each_requests_time_to_finish_over_the_batchs_mean():
    bal = FinishBalance()
    a, b, c = _req("a"), _req("b"), _req("c")
    assert bal.weights([a, b, c], 0.0) is None  # not a closed batch
    bal.begin()
    assert bal.weights([a, b, c], 0.0) is None  # the clocks start: no rate known yet
    for req, n in ((a, 40), (b, 10), (c, 10)):  # in one second: 40, 10 and 10 tokens a second
        _emit(req, n)
    w = bal.weights([a, b, c], 1.0)
    times = np.array([56 / 40, 86 / 10, 86 / 10])  # tokens left over rate
    assert w == pytest.approx(times / times.mean())
    assert sum(w) == pytest.approx(3.0)
    assert w[0] < 1 < w[1]  # the request that will finish first is worth less, the laggards more

    # a request seen later starts its own clock; until it has made MIN_TOKENS it is priced at the mean rate
    d = _req("d", made=10)
    w = bal.weights([a, b, c, d], 1.0)
    mean_rate = (40 + 10 + 10) / 3
    times = np.array([56 / 40, 86 / 10, 86 / 10, 86 / mean_rate])
    assert w == pytest.approx(times / times.mean())

    # no max_tokens: nobody knows when it finishes, so nobody is weighed
    assert bal.weights([a, _req("e", max_tokens=None, made=10)], 1.0) is None
    assert bal.weights([a], 1.0) is None  # one request: nothing to balance
    bal.end()
    assert bal.weights([a, b, c], 2.0) is None


def test_requests_that_stop_early_pull_the_weights_back_towards_one():
    bal = FinishBalance()
    bal.begin()
    a, b = _req("a"), _req("b")
    bal.weights([a, b], 0.0)
    _emit(a, 40)
    _emit(b, 10)
    full = np.array(bal.weights([a, b], 1.0))
    bal.on_finished("x", ran_to_length=False)
    bal.on_finished("y", ran_to_length=False)
    assert (bal.finished, bal.by_length) == (2, 0)
    # trust (0 + 1) / (2 + 1): a third of the way from 1 to the projection
    assert bal.weights([a, b], 1.0) == pytest.approx(1 + (full - 1) / 3)
    bal.on_finished("z", ran_to_length=True)
    assert bal.weights([a, b], 1.0) == pytest.approx(1 + (full - 1) * 2 / 4)
    bal.begin()  # a new batch forgets the last one's endings and clocks
    assert (bal.finished, bal.by_length) == (0, 0) and bal.weights([a, b], 5.0) is None


def test_a_weighted_request_drafts_where_an_unweighted_one_does_not():
    """A row costs 2 ms beside a 20 ms step: at batch 8 a first draft kept 40% of the time is under its
    break-even (with the margin); weighted 2 (it is the batch's last to finish), its request's is over."""
    pol = DraftLengthPolicy(CostModel())
    pol.price.seed([(r, 0.02 + 0.002 * r) for r in range(1, 301)])
    cands = [Candidate(100, [0.4] * 4) for _ in range(8)]
    assert pol.choose(cands, 8) == [0] * 8
    assert pol.choose(cands, 8, weights=[1.0] * 8) == [0] * 8
    weights = [2.0] + [6 / 7] * 7
    assert pol.choose(cands, 8, weights=weights) == [1] + [0] * 7
    rows = np.full((8, 4), 0.4)
    assert pol.choose_rows(rows, [4] * 8, 8, weights=weights) == [1] + [0] * 7
    assert pol.choose_rows(rows, [4] * 8, 8) == [0] * 8


def test_the_skip_bound_weighs_each_requests_ceilings():
    """The speculator skips proposing where its bound says no drafts could pay; with the weights it must
    not skip a step whose weighted choice would draft."""
    spec = Speculator(SpeculativeMethod("ngram", 4, initial_acceptance=0.4, initial_continuation=0.4), CostModel())
    spec.policy.price.seed([(r, 0.02 + 0.002 * r) for r in range(1, 301)])
    states = [AcceptanceStats.new(0.4, 4) for _ in range(8)]
    limits = [4] * 8
    assert not spec._drafts_can_pay(states, limits, 8)
    assert spec._drafts_can_pay(states, limits, 8, weights=[2.0] + [6 / 7] * 7)
    limits[0] = 0  # the heavy request may not draft: its weight cannot lift the others
    assert not spec._drafts_can_pay(states, limits, 8, weights=[2.0] + [6 / 7] * 7)


def test_the_speculator_counts_how_a_batchs_requests_ended():
    spec = Speculator(SpeculativeMethod("ngram", 4), CostModel())
    spec.finished(_req("before"), RequestStatus.FINISHED_LENGTH)  # outside a closed batch: not counted
    spec.balance.begin()
    spec.finished(_req("a"), RequestStatus.FINISHED_LENGTH)
    spec.finished(_req("b"), RequestStatus.FINISHED_STOPPED)
    spec.finished(_req("c"), RequestStatus.FINISHED_ABORTED)
    assert (spec.balance.finished, spec.balance.by_length) == (3, 1)


PROMPTS = [[5 + (i % 7) for i in range(40)], [100 + (i % 5) * 3 for i in range(23)],
           [7, 8, 9, 10, 11, 12] * 6 + [7, 8], list(range(300, 333))]


def test_generate_runs_a_closed_batch_and_its_weights_reach_the_choice(tiny_models):
    """`LLM.generate` is a closed batch once nothing waits: the weights are computed (only then) and steer
    real drafts, the greedy output stays the plain engine's, every block comes back, and the batch ends
    with the engine (how each request ended counted, the balance open again)."""
    path = tiny_models["llama"]
    kw = dict(dtype="float32", kv_cache_memory="64MiB", profile_cost_model=False, max_num_seqs=2)
    params = greedy(24)
    reference = token_ids(LLM(str(path), **kw), PROMPTS, params)
    llm = LLM(str(path), speculative_config=spec_config("ngram", k=5, adaptive=True), **kw)
    spec = llm.engine.core.speculator
    spec.proposer = CorruptedOracle({tuple(p): r for p, r in zip(PROMPTS, reference, strict=True)},
                                    llm.engine.vocab_size)
    seen = []
    weights = spec.balance.weights

    def recording(requests, now):
        w = weights(requests, now)
        seen.append((w, len(llm.engine.core.scheduler.waiting)))
        return w

    spec.balance.weights = recording
    assert token_ids(llm, PROMPTS, params) == reference
    assert seen and all(waiting == 0 for _, waiting in seen)  # never while prompts wait for a slot
    assert any(w is not None for w, _ in seen)
    assert spec.metrics.num_verifications > 0
    assert not spec.balance.closed
    assert (spec.balance.finished, spec.balance.by_length) == (4, 4)  # greedy with ignore_eos: all at max_tokens
    assert_all_free(llm)


def test_the_closed_batch_ends_when_generate_fails(tiny_models):
    llm = LLM(str(tiny_models["llama"]), dtype="float32", kv_cache_memory="64MiB", profile_cost_model=False,
              speculative_config=spec_config("ngram", k=3, adaptive=True))
    balance = llm.engine.core.speculator.balance
    with pytest.raises(RuntimeError), llm.engine.closed_batch():
        assert balance.closed
        raise RuntimeError("the caller's loop failed")
    assert not balance.closed
