"""Speculation inside one C call: plain greedy decodes on the whole-layer C path with rows to spare (up to
four) run several steps of n-gram drafting and verification in C (`Scheduler._speculative_call`,
`FusedDecoder.spec_steps`). Its n-gram search is the Python proposer's; its output is the same tokens as
decoding without speculation, alone or in a batch, stop tokens and max_tokens included, before and after
another request joins; its blocks all come back."""

from __future__ import annotations

import contextlib
import ctypes
import random

import pytest
import torch

from benchmarks.spec import code_edit_prompt
from deepinfer import LLM, SamplingParams
from deepinfer.engine.runner import cpu_has_fast_bf16
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.spec.ngram import find_match
from deepinfer.layers import cpu_kernels
from deepinfer.layers.fused_decode import FusedDecoder, SpecSeq
from tests.engine.spec_utils import assert_all_free, spec_config, token_ids

needs_kernels = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="the C kernels cannot be built here")
# bfloat16 is checked in the default suite where it is the default dtype (AVX-512 BF16 / AMX); where the CPU
# emulates it (AVX2: ~2 minutes for the two tests below) it runs in the slow suite
DTYPES = [pytest.param("bfloat16", marks=() if cpu_has_fast_bf16() else pytest.mark.slow), "float32"]


@needs_kernels
def test_the_c_ngram_lookup_finds_what_find_match_finds():
    lib = cpu_kernels.load_library()
    rng = random.Random(0)
    hits = 0
    for _ in range(3000):
        alphabet = rng.choice([2, 3, 5, 40])
        tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 70))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 6)
        lookback = rng.choice([3, 12, 8192])
        want, want_match = find_match(tokens[-lookback:], min_n, max_n, 64)
        arr = torch.tensor(tokens, dtype=torch.int64)
        start = ctypes.c_int64(-1)
        match = lib.ngram_lookup(arr.data_ptr(), len(tokens), min_n, max_n, lookback, ctypes.byref(start))
        got = tokens[start.value:start.value + 64] if match else []
        assert (match, got) == (want_match, want), (tokens, min_n, max_n, lookback)
        hits += match > 0
    assert hits > 1000  # most cases found a match: the comparison covered the search, not just misses


# the adaptive n-gram speculation of most engines here (a dict the config only reads; the others: fixed k = 3)
ADAPTIVE_NGRAM = spec_config("ngram", k=16, adaptive=True)


def _engines(dtype: str, **kw) -> tuple[LLM, LLM]:
    kw = {"kv_cache_memory": "256MiB", "dtype": dtype, **kw}
    return LLM(**kw), LLM(speculative_config=ADAPTIVE_NGRAM, **kw)


@pytest.fixture(scope="module")
def float32_engines() -> tuple[LLM, LLM]:
    return _engines("float32")


def _count_calls(monkeypatch) -> list[tuple[int, int]]:
    """(steps, requests) of every speculating call."""
    calls: list[tuple[int, int]] = []
    original = FusedDecoder.spec_steps

    def counted(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls.append((len(out.steps), len(out.tokens)))
        return out

    monkeypatch.setattr(FusedDecoder, "spec_steps", counted)
    return calls


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_single_stream_code_edits_are_token_identical_and_drafted_in_c(dtype, request, monkeypatch):
    """One request at a time (batch 1, where the call applies), on the default model in its default mode, in
    both dtypes: the call verifies drafts with the kernels plain decode steps use (row-invariant up to 8
    rows), so the tokens are the argmaxes of the same bits."""
    plain, spec = request.getfixturevalue("float32_engines") if dtype == "float32" else _engines(dtype)
    calls = _count_calls(monkeypatch)
    params = SamplingParams(max_tokens=64, temperature=0.0)
    total = 0
    for i in range(4):
        prompt = [code_edit_prompt(i)]
        reference = token_ids(plain, prompt, params)
        assert token_ids(spec, prompt, params) == reference
        total += len(reference[0])
    m = spec.engine.core.speculator.metrics
    assert calls and sum(n for n, _ in calls) > len(calls), "the engine never ran several speculating steps in one call"
    assert m.num_accepted_tokens > 0.3 * total, "drafts did little of the work: the test would prove little"
    assert_all_free(spec)


@needs_kernels
def test_stop_tokens_and_max_tokens_end_a_call_where_plain_decoding_ends(float32_engines, monkeypatch):
    plain, spec = float32_engines
    calls = _count_calls(monkeypatch)
    prompt = [code_edit_prompt(1)]  # its output copies most of the prompt: drafts of many tokens are kept
    reference = token_ids(plain, prompt, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))[0]
    for stop_at in (3, 17, 40):  # a stop token that arrives inside a kept draft or as its bonus token
        stop = reference[stop_at]
        params = SamplingParams(max_tokens=60, temperature=0.0, stop_token_ids=[stop])
        want = plain.generate(prompt, params)[0].outputs[0]
        got = spec.generate(prompt, params)[0].outputs[0]
        assert list(got.token_ids) == list(want.token_ids)
        assert got.finish_reason == want.finish_reason == "stop"
        assert got.token_ids[-1] == stop and len(got.token_ids) <= stop_at + 1
    for max_tokens in (1, 2, 3, 9, 31):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        got = token_ids(spec, prompt, params)[0]
        assert got == reference[:max_tokens]
    assert calls
    assert_all_free(spec)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_batch_of_code_edits_is_token_identical_and_shares_the_calls_rows(dtype, request, monkeypatch):
    """Four requests at once: their steps speculate in calls of all four (one row each, four to share among
    the drafts), and every output is the tokens of the same batch decoded without speculation, in both
    dtypes in the default mode (the C path's kernels are row-invariant up to 8 rows). A fixed draft length (3:
    what the spare rows hold for one request), so that how many drafts are verified does not hang on the
    measured prices, as the adaptive policy's choice does."""
    plain = request.getfixturevalue("float32_engines")[0] if dtype == "float32" else _engines(dtype)[0]
    spec = LLM(kv_cache_memory="256MiB", dtype=dtype, speculative_config=spec_config("ngram", k=3, adaptive=False))
    calls = _count_calls(monkeypatch)
    params = SamplingParams(max_tokens=64, temperature=0.0)
    prompts = [code_edit_prompt(i) for i in range(4)]
    # both engines see the prompts once first, so both find their full blocks cached and compute the four
    # tails in one step: cold, the prompts wait for the example they share (`_blocks_in_prefill`) and the
    # first request decodes beside the others' prefill, a step past the C path's rows whose bits depend on
    # what else it holds (its drafts, in one engine); and the float32 `plain` may have cached them already
    for llm in (plain, spec):
        token_ids(llm, prompts, params)
    reference = token_ids(plain, prompts, params)
    assert token_ids(spec, prompts, params) == reference
    m = spec.engine.core.speculator.metrics
    assert any(seqs == 4 and steps > 1 for steps, seqs in calls), calls
    assert m.num_accepted_tokens > 0.2 * sum(len(r) for r in reference), "drafts did little of the work"
    assert m.num_draft_tokens > m.num_accepted_tokens + 10, "few drafts were rejected: the test would prove little"
    assert_all_free(spec)


@needs_kernels
def test_a_request_explores_where_rates_pooled_over_other_traffic_price_out_every_draft(float32_engines,
                                                                                        monkeypatch):
    """An engine whose pooled rates say drafts are rarely kept (as after JSON requests, whose two-token matches
    missed): by the price alone a code edit at batch 1 drafts nothing in its calls and so never learns (it
    did not, 0.6x of a fixed k = 5 on the AMX Xeon); its first call explores behind long matches in a few
    steps (`Speculator.EXPLORE_CALL_STEPS`), the kept drafts teach its estimates, and the later calls draft
    by the price. The tokens stay those of decoding without speculation."""
    plain = float32_engines[0]
    spec = LLM(kv_cache_memory="256MiB", dtype="float32", speculative_config=ADAPTIVE_NGRAM)
    speculator = spec.engine.core.speculator
    for _ in range(20):
        speculator.pool.observe(2, 4, 0)
    calls = _count_calls(monkeypatch)
    prompt, params = [code_edit_prompt(2)], SamplingParams(max_tokens=64, temperature=0.0)
    assert token_ids(spec, prompt, params) == token_ids(plain, prompt, params)
    assert calls and calls[0][0] <= speculator.EXPLORE_CALL_STEPS < max(n for n, _ in calls)
    assert speculator.metrics.num_accepted_tokens > 10
    assert_all_free(spec)


@pytest.mark.slow  # ~18 s, as above
@needs_kernels
def test_a_speculating_call_keeps_two_steps_whatever_the_time_budget(float32_engines, monkeypatch):
    """`--multi-step-budget-ms` cuts a pass to the steps its price allows, down to one; a speculating call keeps
    at least two, so its drafts stay on the C path (dropped for a one-step pass, the call's drafts were verified
    in the ordinary path, past its rows, where in float32's default mode the outputs could part from decoding
    without speculation: seen once in a combined test run). The batch is an open one, as a server's: in
    `LLM.generate`'s closed batch the budget does not cut passes (`LLMEngine.closed_batch`)."""
    plain = float32_engines[0]
    spec = LLM(kv_cache_memory="256MiB", dtype="float32", multi_step_budget_ms=0.001,
               speculative_config=spec_config("ngram", k=3, adaptive=False))
    monkeypatch.setattr(spec.engine, "closed_batch", contextlib.nullcontext)
    calls = _count_calls(monkeypatch)
    params = SamplingParams(max_tokens=48, temperature=0.0)
    prompts = [code_edit_prompt(i) for i in range(4)]
    for llm in (plain, spec):  # as in the test above: the compared run computes the prompts' tails in one step
        token_ids(llm, prompts, params)
    assert token_ids(spec, prompts, params) == token_ids(plain, prompts, params)
    assert calls and all(steps <= 2 for steps, _ in calls), calls
    assert any(seqs == 4 and steps == 2 for steps, seqs in calls), calls
    assert spec.engine.core.speculator.metrics.num_accepted_tokens > 0
    assert_all_free(spec)


@pytest.mark.slow  # ~19 s, as above
@needs_kernels
def test_a_request_that_joins_midway_shares_the_calls_and_both_stay_identical(monkeypatch):
    """The first request decodes in speculating calls, the second arrives while it does: once its prompt is
    computed the two share the calls, and both outputs are the tokens of decoding each alone without
    speculation. Deterministic mode (row-invariant kernels), so that the prompt's prefill sharing a step with
    the first request's decode changes no bits."""
    plain, spec = _engines("float32", deterministic=True)
    monkeypatch.setattr(Scheduler, "SPECULATING_CALL_REQUESTS", 2)  # the two share calls, and no more join
    calls = _count_calls(monkeypatch)
    first, second = code_edit_prompt(1), code_edit_prompt(3)
    params = SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True)
    want = [token_ids(plain, [p], params)[0] for p in (first, second)]
    engine = spec.engine
    engine.add_request(first, params, request_id="a")
    outputs: dict[str, list[int]] = {}
    joined = False
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)
        if not joined and engine.core.scheduler.requests["a"].num_output_tokens >= 12:
            before = len(calls)
            engine.add_request(second, params, request_id="b")
            joined = True
    assert joined and before > 0, "the first request never decoded in a call before the second joined"
    assert any(seqs == 2 for _, seqs in calls[before:]), "the two never shared a call"
    assert [outputs["a"], outputs["b"]] == want
    assert_all_free(spec)


@needs_kernels
def test_a_short_lookback_searches_only_the_last_tokens_and_slides_over_what_the_call_appends(float32_engines,
                                                                                              monkeypatch):
    """Only the last `lookback` tokens of a request go to C: every step's match is `find_match`'s over the
    request's tokens so far (the call's appended ones included) cut to that window, as the Python proposer
    cuts them; and the positions stay the request's own, so the tokens are still plain greedy decoding's."""
    plain, spec = float32_engines
    lookback = 16
    speculator = spec.engine.core.speculator
    monkeypatch.setattr(speculator.proposer, "max_lookback", lookback)
    # drafts on every match, whatever the adaptive policy's prices say (a start-up profile measured in a busy
    # moment once priced every draft out and the steps proved nothing): a fixed draft length of 4
    monkeypatch.setattr(speculator.policy, "adaptive", False)
    monkeypatch.setattr(speculator, "k_max", 4)
    seen: list[tuple[int, list[int], int, int, int]] = []  # (lookback, tokens before the step, match, drafts, kept)
    original = FusedDecoder.spec_steps

    def recorded(self, seqs, caches, head, num_steps, min_n, max_n, lb, stop_ids):
        out = original(self, seqs, caches, head, num_steps, min_n, max_n, lb, stop_ids)
        for sq, new, verdicts in zip(seqs, out.tokens, out.verdicts, strict=True):
            history, used = list(sq.tokens), 0
            for match, drafted, kept in verdicts:
                seen.append((lb, list(history), match, drafted, kept))
                history += new[used:used + kept + 1]
                used += kept + 1
        return out

    monkeypatch.setattr(FusedDecoder, "spec_steps", recorded)
    params = SamplingParams(max_tokens=64, temperature=0.0)
    prompt = [code_edit_prompt(0)]
    assert token_ids(spec, prompt, params) == token_ids(plain, prompt, params)
    assert seen and all(lb == lookback for lb, *_ in seen)
    proposer = spec.engine.core.speculator.proposer
    for _, history, match, _, _ in seen:
        assert len(history) > lookback  # the window cut something off
        assert match == find_match(history[-lookback:], proposer.min_n, proposer.max_n, 64)[1]
    assert sum(kept for *_, kept in seen) > 0, "no draft was kept: the steps proved little"
    assert_all_free(spec)


# ~23 s: two deterministic engines of the default model; the default suite keeps the single-stream and batch tests
@pytest.mark.slow
@needs_kernels
def test_calls_whose_blocks_do_not_fit_are_not_made_and_lose_nothing(float32_engines, monkeypatch):
    """Four code edits in a cache of 38 blocks (they need ~43 by their end): a call takes blocks for every
    token it may append to each request, and where they do not all fit it is not made and none of its
    requests takes a block (`KVCacheManager.allocate_all`; the step decodes as
    usual; a call never preempts anyone), the outputs are those of decoding without speculation and no block
    is left behind. In 29 blocks (2 left after the prompts, where each request needs 4 more to finish) the
    scheduler must preempt, as it would without speculation, and the outputs are the same again
    (deterministic numerics: a preempted request's recomputed prompt changes no bits). At 38 blocks whether
    anyone is preempted depends on how unevenly the requests' drafts advance them (one that finishes early
    frees blocks for the rest), and so on the measured step prices behind the draft lengths: it read 0 in
    some runs."""
    per_block = float32_engines[0].engine.core.runner.kv_bytes_per_block  # the same float32 blocks
    # a budget no step's price reaches: every call asks blocks for all `num_scheduler_steps` steps, so whether
    # calls overflow the cache does not follow the machine's measured prices (with the default budget a quick
    # moment's prices gave calls few enough steps that every one fitted, once in CI)
    kw = {"kv_cache_memory": str(38 * per_block), "dtype": "float32", "deterministic": True,
          "multi_step_budget_ms": 1e6}
    plain, spec = LLM(**kw), LLM(speculative_config=ADAPTIVE_NGRAM, **kw)
    made, unfit = [], []
    original = Scheduler._speculative_call

    def watched(self, decodes):
        allocate_all, refused = self.kv.allocate_all, []

        def counted(pairs):
            tables = {r.request_id: list(self.kv.block_tables[r.request_id]) for r, _ in pairs}
            free = self.kv.pool.num_free
            ok = allocate_all(pairs)
            if not ok:  # none of the call's requests took a block
                refused.append(len(pairs))
                assert self.kv.pool.num_free == free
                assert {r.request_id: list(self.kv.block_tables[r.request_id]) for r, _ in pairs} == tables
            return ok

        monkeypatch.setattr(self.kv, "allocate_all", counted)
        try:
            call = original(self, decodes)
        finally:
            monkeypatch.setattr(self.kv, "allocate_all", allocate_all)
        made.extend([len(call)] if call else [])
        unfit.extend([len(decodes)] if refused else [])
        return call

    monkeypatch.setattr(Scheduler, "_speculative_call", watched)
    params = SamplingParams(max_tokens=64, temperature=0.0)
    prompts = [code_edit_prompt(i) for i in range(4)]
    want = token_ids(plain, prompts, params)
    assert token_ids(spec, prompts, params) == want
    assert unfit, "every call fitted: the test proved nothing"
    assert made and max(made) > 1, "no call of several requests was made"
    assert_all_free(spec)

    tight = LLM(speculative_config=ADAPTIVE_NGRAM, **{**kw, "kv_cache_memory": str(29 * per_block)})
    assert token_ids(tight, prompts, params) == want
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert_all_free(tight)


@needs_kernels
def test_a_call_stops_where_a_requests_own_block_table_ends(float32_engines):
    """Each request's rows are checked against its own block table, not the widest of the call's (zero-padded
    rows of a shorter table would send its KV to block 0, another request's): the call raises instead."""
    _, spec = float32_engines
    runner = spec.engine.core.runner
    size = runner.kv_caches[0][0].shape[1]
    tokens = list(range(100, 100 + size))  # the last token's position ends the first block
    longer = SpecSeq(tokens, [1, 2], 8, (0,) * 6)
    shorter = SpecSeq(tokens, [3], 8, (0,) * 6)
    fused, head = runner.model.fused, runner.model.lm_head
    out = fused.spec_steps([longer], runner.kv_caches, head, 4, 2, 5, 1024, [])
    assert [len(t) for t in out.tokens] == [4] and [rows for rows, _ in out.steps] == [1, 1, 1, 1]
    with pytest.raises(IndexError):
        fused.spec_steps([longer, shorter], runner.kv_caches, head, 4, 2, 5, 1024, [])


def test_call_step_price_takes_measured_counts_and_scales_the_rest():
    from deepinfer.engine.spec.step_price import CallStepPrice, StepPrice

    price = StepPrice()
    price.seed([(r, 0.003 + 0.0005 * (r - 1)) for r in range(1, 9)])  # the start-up table: 3 ms + 0.5 a row
    calls = CallStepPrice(price, 8)
    assert calls.table()[1:] == [price.seconds(r) for r in range(1, 9)]  # nothing measured yet
    for _ in range(2):
        calls.observe(1, 0.0024)
    assert calls.table()[1] == price.seconds(1)  # two samples are not enough to move a count
    for seconds in (0.0025, 0.0025, 0.0090):  # one slow outlier: the median holds
        calls.observe(1, seconds)
    for _ in range(3):
        calls.observe(4, 0.0036)
    table = calls.table()
    assert table[1] == 0.0025 and table[4] == 0.0036
    scale = sorted([0.0025 / price.seconds(1), 0.0036 / price.seconds(4)])
    for r in (2, 3, 5, 8):  # not measured: the table's value times the measured counts' median ratio
        assert table[r] == pytest.approx(price.seconds(r) * (scale[0] + scale[1]) / 2)
    calls.observe(9, 0.01)  # past the call's rows: ignored
    assert len(calls.table()) == 9


def test_the_call_draft_length_follows_the_price_of_rows():
    from deepinfer.engine.cost_model import CostModel
    from deepinfer.engine.spec.policy import DraftLengthPolicy

    policy = DraftLengthPolicy(CostModel())
    likely = [0.95] * 7
    cheap = [0.0] + [0.0025 + 0.0003 * (r - 1) for r in range(1, 9)]  # a row costs an eighth of a token
    dear = [0.0] + [0.0025 + 0.0030 * (r - 1) for r in range(1, 9)]  # a row costs more than a token
    assert policy.choose_in_call(likely, cheap) == 7
    assert policy.choose_in_call(likely, dear) == 0
    assert policy.choose_in_call([0.9, 0.1, 0.9, 0.9], cheap) == 1  # a gain falls with the product
    assert policy.choose_in_call([], cheap) == 0


def test_a_requests_own_first_draft_record_behind_a_match_length_shrinks_its_estimate():
    from deepinfer.engine.spec.policy import AcceptanceStats

    state = AcceptanceStats.new(0.6, 8)
    assert state.first_keep_rate(2, 0.5) == 0.5  # no record behind two-token matches: the estimate stands
    state.last_match = 2
    for _ in range(3):
        state.observe(1, 0, 0.3)  # three single drafts behind two-token matches, none kept
    state.last_match = 5
    state.observe(4, 4, 0.3)
    assert state.first_keep_rate(2, 0.5) == pytest.approx((0 + 2 * 0.5) / (3 + 2))
    assert state.first_keep_rate(5, 0.5) == pytest.approx((1 + 2 * 0.5) / (1 + 2))
    assert state.first_keep_rate(3, 0.7) == 0.7
    state.last_match = 0  # a proposer that reports no match keeps no record
    state.observe(2, 1, 0.3)
    assert set(state.first_by_match) == {2, 5}
