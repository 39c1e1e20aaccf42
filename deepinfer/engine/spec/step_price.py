"""The price of verification: how long a decode-phase step takes as a function of its row count.

In a step where every request decodes or verifies drafts, every row (a request's last token or one of its
drafts) is a decode row of its own (runner.py), so the step's time is a function of its total row count R
far more than of how the rows split between requests. That function is not linear: on CPU, steps of up to
`max_rows` rows (8 here) take the whole-layer C path and cost about one decode, the next row falls back to
the torch path and costs a jump; on an accelerator it is flat until the step becomes compute-bound. A
linear fit over mixed batch sizes (the previous `DecodePrice`) averaged those regimes and priced drafts
wrongly at both ends, so `StepPrice` keeps a table instead:

    T(R) = median of the recent measured steps of R rows (a few per row count), smoothed by a piecewise-
           linear least-squares fit within the C path's regime, made non-decreasing (isotonic: more
           rows never cost less), linear between the row counts measured, extended past the largest
           measured R with the last measured seconds per row.

Past the C path the step time is a staircase, not a line: the batched path's matmuls take rows in blocks
of 16 (at one thread on the AMD machine, 9-16 rows cost about the same, 17 a block more, then flat to 32),
so the table is not smoothed there and the profile samples both sides of the first block edges.

Seeded at engine start by `profile_rows` (synthetic verification steps: every row count through the first
two row blocks, both sides of the next block edges, then about 25% apart up to what the batch can verify;
the counts through the C path three times, the others twice, the fastest kept: `profile_schedule`; the
larger counts divided by the machine's drift, timed by steps of the C path's largest count between them:
`drift_corrected`) and refreshed by every decode-phase step the engine runs (`observe`). A load factor (EWMA of measured over
predicted seconds) scales the whole table and entries are stored divided by it: a busy machine makes the
row counts in use slower, and the counts not in use (whose entries are older) must follow, or the policy
would wander to whichever counts were measured at a quieter moment, or never return to one measured at a
busy moment. Without a profile
the cost model's prediction for R decode rows seeds it. The policy (`policy.py`) reads `seconds(R)` for R
from the step's decodes to decodes + all drafts; `host_seconds` is the step's measured time outside the
model runner (scheduling, proposing, output), which drafts amortise too, and `draft_host_seconds` the same
for steps that verified drafts (longer: their lookup, choice and verdicts).
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import time
from collections import deque

import numpy as np
import torch

from deepinfer.engine.cost_model import CostModel, chunk_features, empty_step

logger = logging.getLogger(__name__)


class StepPrice:
    """Seconds of a decode-phase step of R rows (see the module docstring)."""

    SAMPLES = 5  # recent measurements kept per row count (median: one noisy step moves nothing)
    LOAD_EWMA = 0.05
    # observed steps between rebuilds of the table (the build is ~0.3-1.5 ms of Python: every 8th step cost a
    # batch-1 decode ~1%; a row count not seen before rebuilds it at once)
    REBUILD_EVERY = 32
    MOVED = 0.1  # a count's median this far (relative) off the table's value rebuilds it (`observe`)
    # host times kept (median): a sample that spans an idle spell (the first step after the engine waited for
    # work) is an outlier among them. An EWMA took it in: started from such a sample (the first observation
    # weighs 1) it priced the host time of code_edit's batch-32 steps at 11 ms where it was 1-2.5, and drafts
    # that amortise it looked worth a third more than they were for the first ~40 steps of every run
    HOST_SAMPLES = 15

    def __init__(self, cost_model: CostModel | None = None, context: int = 256, c_path_rows: int = 0) -> None:
        self.cost_model = cost_model
        # steps of at most this many rows take the whole-layer C decode path (0: no such path): a regime of
        # their own, fitted apart from larger steps (the step time jumps between them)
        self.c_path_rows = c_path_rows
        # whether the batched path's matmuls pad rows to blocks (oneDNN's packed weights, `padded_rows`): its
        # time is then a staircase, kept as measured; False (weights in panels, `panel_gemm.c`: each row costs
        # its own arithmetic) smooths that regime as the C path's (`_build`)
        self.row_blocks = True
        self.context = context  # the decode context the cost-model fallback assumes
        self._samples: dict[int, deque[float]] = {}  # served steps' seconds (over the load factor) per count
        self._profile: dict[int, list[float]] = {}  # the start-up profile's seconds per count (`seed`)
        self._table: np.ndarray | None = None  # T(R) for R = 0..len-1, rebuilt lazily after new samples
        self._built: dict[int, float] = {}  # per count, the median the table was built from
        self.host_seconds = 0.0
        self.draft_host_seconds = 0.0
        self._host: deque[float] = deque(maxlen=self.HOST_SAMPLES)
        self._draft_host: deque[float] = deque(maxlen=self.HOST_SAMPLES)
        self.num_observed = 0
        # measured / predicted step time (EWMA): the machine's load now against the load the table's entries
        # were measured under; row counts the policy stopped choosing keep their shape but follow the load
        self.load = 1.0
        self._stale = 0

    def observe(self, rows: int, seconds: float) -> None:
        """A measured decode-phase step: updates the load factor, then its row count's entry (stored
        divided by the load factor, so entries measured under different loads stay comparable)."""
        if rows <= 0 or seconds <= 0:
            return
        if self._samples or self._profile:
            predicted = self._base(rows)
            if predicted > 0:
                self.load += self.LOAD_EWMA * (seconds / predicted - self.load)
        samples = self._samples.setdefault(rows, deque(maxlen=self.SAMPLES))
        samples.append(seconds / self.load)
        self.num_observed += 1
        self._stale += 1
        # the load factor follows every step already; a count whose own median moved off the value the table
        # was built from is rebuilt at once: a profile step that ran at a quiet moment priced 65 rows at 1.39x
        # 32 rows where the served steps took 1.85x, and with that count already in the table (no new count)
        # the served steps only moved the load factor, which lifted the price of plain 32-row steps too, for
        # the REBUILD_EVERY steps until the next rebuild (code_edit b=32 drafted at a loss throughout)
        built = self._built.get(rows)
        if built is None or self._stale >= self.REBUILD_EVERY or \
                abs(statistics.median(samples) - built) > self.MOVED * built:
            self._table = None

    def observe_host(self, seconds: float, drafted: bool = False) -> None:
        """Wall time of a step outside the model runner: `host_seconds` is the median of the recent ones of
        steps that verified no drafts, `draft_host_seconds` of those that did (the plain steps' until one
        has been seen). A drafting step's host time is longer (its lookup, the candidates' choice, the
        verdicts applied and the rejected KV rolled back: ~1.3 ms more at code_edit b=32 on the AVX-512
        machine, ~7% of a 17 ms step); priced at the plain steps' host time, drafts near their break-even
        there looked like a gain and cost 5-9% of throughput."""
        if seconds < 0:
            return
        if drafted:
            self._draft_host.append(seconds)
        else:
            self._host.append(seconds)
            self.host_seconds = statistics.median(self._host)
        self.draft_host_seconds = statistics.median(self._draft_host) if self._draft_host else self.host_seconds

    def seed(self, samples: list[tuple[int, float]]) -> None:
        """Profiled steps (the load they ran under is load factor 1)."""
        for rows, seconds in samples:
            if rows > 0 and seconds > 0:
                self._profile.setdefault(rows, []).append(seconds)
        self._table = None

    def unserved_past_c_path(self) -> bool:
        """Whether the counts past the C decode path are priced by the start-up profile alone: no served
        step there has corrected them (`_entries`' bias of 1), and none will while the policy chooses no
        step that big (`Speculator._probe_past_c_path`). False without a C path."""
        return self.c_path_rows > 0 and not any(r > self.c_path_rows for r in self._samples)

    @property
    def measured_rows(self) -> list[int]:
        return sorted(set(self._samples) | set(self._profile))

    def seconds(self, rows: int) -> float:
        """Predicted model-runner seconds of a decode-phase step of `rows` rows."""
        if rows <= 0:
            return 0.0
        if not (self._samples or self._profile):
            return self._from_cost_model(rows)
        return self.load * self._base(rows)

    def _base(self, rows: int) -> float:
        table = self._table
        if table is None or rows >= len(table):
            table = self._table = self._build(max(rows + 1, 2 * self.measured_rows[-1] + 1))
            self._stale = 0
        return float(table[rows])

    def table(self, max_rows: int) -> np.ndarray:
        """T(R) for R = 0..max_rows (index R)."""
        if not (self._samples or self._profile):
            return np.array([self._from_cost_model(r) for r in range(max_rows + 1)])
        self._base(max_rows)
        return self.load * self._table[:max_rows + 1]  # type: ignore[index]

    def _build(self, size: int) -> np.ndarray:
        counts = self.measured_rows
        rows = np.array(counts, dtype=float)
        c_path = rows <= self.c_path_rows
        secs = np.array(self._entries(counts, c_path.tolist()))
        self._built = dict(zip(counts, secs.tolist(), strict=True))
        weights = np.array([len(self._samples.get(r) or self._profile[r]) for r in counts], dtype=float)
        # the C path's regime is smooth: one slow count among its neighbours is shared with them. The
        # batched path's is a staircase (oneDNN multiplies rows in blocks: 9-16 rows cost about the same, the
        # 17th a block more, measured on the AMD machine at one thread), which a smoothing fit would turn
        # into a ramp, pricing the rows that fill a block too high and the one that starts the next too low
        if c_path.sum() >= 4:
            secs[c_path] = spline_fit(rows[c_path], secs[c_path], weights[c_path])
        # without row blocks the batched path is smooth too: unsmoothed, a fast sample at 33 rows next to a slow
        # one at 32 made rows 33-34 free at batch 32 (bf16 panels on the AVX-512 BF16 machine), and every
        # draft a request found was chosen there, at any acceptance
        if not self.row_blocks and (~c_path).sum() >= 4:
            secs[~c_path] = spline_fit(rows[~c_path], secs[~c_path], weights[~c_path])
        secs = isotonic(list(secs), list(weights))  # more rows never cost less
        grid = np.arange(size, dtype=float)
        table = np.interp(grid, rows, secs)
        # past the largest measured count: the slope over at least one row block before it (at least half
        # its seconds per row: a step that big is compute-bound). Not the last two counts' slope: the profile
        # measures both sides of each block edge (`profile_order`), and the jump from 32 to 33 rows taken
        # as a per-row slope priced every row past 33 like a whole new block (~160 ms a row at one thread)
        last, top = rows[-1], secs[-1]
        slope = top / last * 0.5
        back = np.nonzero(rows <= last - ROW_BLOCK)[0]
        if len(back):
            slope = max(slope, (top - secs[back[-1]]) / (last - rows[back[-1]]))
        table[grid > last] = top + slope * (grid[grid > last] - last)
        table[0] = 0.0
        return table

    def _entries(self, counts: list[int], c_path: list[bool]) -> list[float]:
        """Each count's seconds before smoothing: the median of its served steps, else its profiled
        seconds times its regime's profile bias. The profile's synthetic steps are cheaper than served ones
        (each the fastest of 2-3; few requests of many rows at a 128-token context, where served
        verification steps are many requests of 1-3 drafts at longer contexts: 17 rows 10-15% dearer as 8
        requests than as one), and a served count next to profiled ones was smoothed back towards them:
        code_edit at batch 8 priced 17 rows at 9.6 ms through a run where they took 12.2, and drafted at
        a loss. The bias, per regime (C decode path, batched path), is the median ratio of served to
        profiled seconds over the counts that have both (1 before any)."""
        served = {r: statistics.median(self._samples[r]) for r in counts if r in self._samples}
        profiled = {r: statistics.median(self._profile[r]) for r in counts if r in self._profile}
        bias = {}
        for regime in (True, False):
            ratios = [served[r] / profiled[r] for r, c in zip(counts, c_path, strict=True)
                      if c is regime and r in served and r in profiled]
            bias[regime] = statistics.median(ratios) if ratios else 1.0
        return [served[r] if r in served else profiled[r] * bias[c] for r, c in zip(counts, c_path, strict=True)]

    def _from_cost_model(self, rows: int) -> float:
        if self.cost_model is None:
            return 1e-3 * rows
        f = empty_step() + rows * chunk_features(1, self.context)
        return max(float(self.cost_model.coef @ f), 1e-6)


class CallStepPrice:
    """Seconds of a step inside a speculating C call (`FusedDecoder.spec_steps`) by row count (1..max_rows),
    from the steps such calls timed: the median of a count's last SAMPLES once it has MIN_SAMPLES; a count
    with fewer takes the start-up table's value (`StepPrice.seconds`) scaled by the median ratio of measured
    to table over the counts that have them. The start-up profile times runner steps (Python around the C
    call) once per count in a few rounds: over four engine starts on the AVX-512 machine it priced one row at
    2.8-3.6 ms and a second at +0.1 to +0.4 ms, and batch-1 code edits read 1.85-1.99x of no speculation by
    which start they got; the calls' own timings settle it within a few requests."""

    SAMPLES = 15
    MIN_SAMPLES = 3

    def __init__(self, price: StepPrice, max_rows: int) -> None:
        self.price, self.max_rows = price, max_rows
        self._samples: dict[int, deque[float]] = {}

    def observe(self, rows: int, seconds: float) -> None:
        if 1 <= rows <= self.max_rows and seconds > 0:
            self._samples.setdefault(rows, deque(maxlen=self.SAMPLES)).append(seconds)

    def table(self) -> list[float]:
        """T(R) for R = 0..max_rows (T(0) = 0)."""
        measured = {r: statistics.median(d) for r, d in self._samples.items() if len(d) >= self.MIN_SAMPLES}
        scale = statistics.median(t / max(self.price.seconds(r), 1e-9) for r, t in measured.items()) \
            if measured else 1.0
        return [0.0] + [measured.get(r, scale * self.price.seconds(r)) for r in range(1, self.max_rows + 1)]


def spline_fit(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least-squares fit of y by a continuous piecewise-linear function of x with knots a factor 2
    apart (x[0], 2 x[0], 4 x[0], ..., x[-1]), evaluated at x: one slow step among neighbouring row counts
    is shared with them instead of making its count look dearer than the next (a measured step-time curve
    is smooth within a regime; single steps on a shared machine are not). Fewer than 4 points: as given."""
    if len(x) < 4:
        return y.copy()
    knots = [float(x[0])]
    while knots[-1] * 2 < x[-1]:
        knots.append(knots[-1] * 2)
    knots.append(float(x[-1]))
    basis = np.stack([np.interp(x, knots, np.eye(len(knots))[i]) for i in range(len(knots))], axis=1)
    sw = np.sqrt(w)[:, None]
    coef = np.linalg.lstsq(basis * sw, y * sw[:, 0], rcond=None)[0]
    return np.maximum(basis @ coef, 0.0)


def isotonic(values: list[float], weights: list[int]) -> np.ndarray:
    """The non-decreasing sequence closest to `values` in weighted least squares (pool adjacent violators):
    one noisy high measurement is averaged with its neighbours instead of lifting every count after it."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights, strict=True):
        blocks.append([float(v), float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return np.array([m for m, _, n in blocks for _ in range(int(n))])


def prices_in_cpu_time() -> bool:
    """Whether verification steps are priced in their thread CPU time (the profile here, and the served steps
    `Speculator.observe_step` feeds the table): at one torch thread, where the model runs on the calling
    thread and other processes on the machine barely move its CPU time, while wall time doubled some counts
    at random on a shared machine (and the isotonic pass then lifted their neighbours too). With more
    threads: wall time (a thread's CPU time would count its spinning while a partner is descheduled)."""
    return torch.get_num_threads() == 1


# rows per block of the batched path's matmuls, the period of its staircase (`StepPrice._build`)
ROW_BLOCK = 16


def profile_row_counts(max_total: int, c_path_rows: int, limit: int = 512, block: int = ROW_BLOCK,
                       dense_blocks: int = 8) -> list[int]:
    """Row counts worth profiling: every count up to a few past the C decode path's limit and through the
    batched path's first two row blocks (a staircase has to be sampled at its steps: every count there,
    where batch 1 and small batches choose), then both sides of each block edge (b * block, b * block + 1)
    up to `dense_blocks` blocks, then ~25% apart (steps of hundreds of rows, where a block is a small
    fraction of the step)."""
    top = max(1, min(max_total, limit))
    counts = list(range(1, min(top, max(c_path_rows + 4, 2 * block + 1)) + 1))
    edge = (counts[-1] // block + 1) * block
    while edge <= min(top, dense_blocks * block):
        counts += [edge] + ([edge + 1] if edge < top else [])
        edge += block
    r = counts[-1]
    while r < top:
        r = min(top, max(r + 1, int(r * 1.25)))
        counts.append(r)
    return counts


def profile_order(counts: list[int], c_path_rows: int, block: int = ROW_BLOCK, dense_blocks: int = 8) -> list[int]:
    """`counts` in the order the profile measures them: the counts that shape the table first (every count
    through the C decode path and the first row past it, then both sides of each row block's edge and the
    sparse large counts, ascending), then the counts inside row blocks. The profile stops at its time
    limit; on a slow machine (AVX2, float32: a step of 32 rows ~0.2 s at one thread) measuring every count
    in order stopped near 20 rows, and the table past them was a ramp extrapolated from the last two
    counts where the batched path's time is a staircase (flat 17..32 rows, a 33% jump at the 33rd): the
    price at batch 8 / 32 was wrong exactly where the policy chooses. With the edges measured first, the
    interpolation between two edges of one block is flat, as the staircase is."""
    def shapes(r: int) -> bool:
        return r <= c_path_rows + 1 or r % block in (0, 1) or r == counts[-1]
    first = [r for r in counts if shapes(r) or r > dense_blocks * block]
    taken = set(first)
    return first + [r for r in counts if r not in taken]


def profile_schedule(order: list[int], c_path_rows: int, small_rounds: int = 3, block: int = ROW_BLOCK) -> list[int]:
    """The profile's steps: the counts through the C decode path and the first row past it `small_rounds`
    times each, round by round, then the counts through the batched path's first two row blocks twice,
    then the rest of `order` (`profile_order`) twice. Each count keeps its fastest step; the small counts are
    where batch 1 and small batches choose, and where one slow step among two (a noisy moment on a shared
    machine) priced a draft row at 0.8 of a decode instead of 0.3 (session 21: no draft was ever verified at
    batch 1, and the table was never corrected). They are cheap: ~0.2 s for a third round on the AVX2
    machine, where the 4 s limit cut the whole profile after its first round. The counts of the next two
    blocks are where batch 8 chooses, and no served step corrects them while it drafts nothing: measured
    once each at the end of a first round over all counts (the second cut by the time limit), one slow step
    at 10 rows priced 9-17 rows at 1.57 T(8) where alternating steps measured 1.48 (the 2-core Zen 4)."""
    small = [r for r in order if r <= c_path_rows + 1]
    near = [r for r in order if c_path_rows + 1 < r <= 2 * block + 1]
    rest = [r for r in order if r > max(c_path_rows + 1, 2 * block + 1)]
    return small * small_rounds + near * 2 + rest * 2


def profile_rows(runner, kv, row_counts: list[int], k_max: int, context: int = 128,
                 time_limit_s: float = 4.0, reference: int = 0,
                 reference_every_s: float = 0.1) -> list[tuple[int, float]]:
    """Run the synthetic verification steps `row_counts` lists (`profile_schedule`: a count may repeat),
    after a warm-up step, through the real runner and return (rows, each count's fastest seconds). A step of R rows is ceil(R / (1 + k_max)) requests, each verifying up to
    `k_max` drafts, all decode rows as in real verification. The KV it writes is garbage in blocks that go
    straight back to the pool (as `cost_profile`); the drafts are all rejected or accepted, which does
    not matter for timing. Stops once its steps have taken `time_limit_s` (CPU seconds at one thread, else wall).

    `reference` (a row count the schedule measures before any larger one, the C decode path's limit): every
    `reference_every_s` of profiling among the larger counts a step of that count is timed again, and each
    larger count's steps are divided by the machine's drift at their moment (`drift_corrected`). The small
    counts are measured in the profile's first half second, the larger ones over the next three, and a
    slow spell of a few seconds on a shared machine then priced every larger count up to 1.4x against the
    small ones: on the 2-core Zen 4, T(16) / T(8) read 1.38, 1.53, 1.69 and 1.94 over four engine starts
    where steps alternating 8 and 16 rows measured 1.37 throughout, and code edits at batch 8 drafted or
    did not by which start they got (a price past the C path that no served step corrects, as nothing drafts)."""
    from deepinfer.engine.request import Request
    from deepinfer.engine.sampling_params import SamplingParams
    from deepinfer.engine.scheduler import ScheduledRequest, SchedulerOutput

    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    ids = itertools.count()
    cpu_clock = prices_in_cpu_time()
    started = time.perf_counter()

    def step(rows: int) -> float | None:
        """Seconds of one synthetic step of `rows` rows (None: the KV pool cannot hold it)."""
        plan = SchedulerOutput()
        left = rows
        while left > 0:
            n = min(left, 1 + k_max)
            req = Request(f"spec-profile-{next(ids)}", [1] * (context + 1), greedy)
            req.num_computed_tokens = context
            plan.scheduled.append(ScheduledRequest(req, n, context, [1] * (n - 1)))
            left -= n
        plan.scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # one-token decodes first, as the scheduler
        reqs = [s.request for s in plan.scheduled]
        try:
            if not all(kv.allocate(s.request, context + s.num_new_tokens) for s in plan.scheduled):
                return None
            cpu = time.thread_time()
            result = runner.execute(plan, kv.group_tables)
            cpu = time.thread_time() - cpu
        finally:
            for r in reqs:
                kv.free(r)
        return cpu if cpu_clock else result.seconds

    # the limit counts the steps' own time (CPU time at one thread): wall time on a machine shared with
    # others (load 3-5 on 2 cores) cut the profile at 33 rows where an idle machine reaches 80
    spent = 0.0
    last_reference = -math.inf
    timed: list[tuple[int, float]] = []  # every step after the warm-up, in order
    references: list[tuple[int, float]] = []  # (its place in `timed`, seconds) of the reference steps
    # a warm-up step, then the counts in the given order (what shapes the table first, so a time limit cuts
    # the counts that matter least): the fastest of each count's steps is kept (on a shared machine one
    # step can be slowed by others; a fast one cannot be sped up by them)
    for i, rows in enumerate([row_counts[0]] + list(row_counts)):
        if i > 0 and 0 < reference < rows and spent - last_reference >= reference_every_s:
            seconds = step(reference)
            if seconds is None:
                break
            spent += seconds
            last_reference = spent
            references.append((len(timed), seconds))
        seconds = step(rows)
        if seconds is None:
            break
        spent += seconds
        if i > 0:
            timed.append((rows, seconds))
        if spent > time_limit_s:
            break
    best: dict[int, float] = {}
    level = min((s for r, s in timed if r == reference), default=0.0)
    for rows, seconds in drift_corrected(timed, references, reference, level):
        best[rows] = min(best.get(rows, math.inf), seconds)
    logger.info("speculative decoding: verification profile of %d row counts in %.2fs", len(best),
                time.perf_counter() - started)
    return sorted(best.items())


def drift_corrected(timed: list[tuple[int, float]], references: list[tuple[int, float]], reference: int,
                    level: float) -> list[tuple[int, float]]:
    """`timed` (rows, seconds, in the order measured) with each step of more than `reference` rows divided
    by the machine's drift at its moment: the median of the three reference steps nearest to it in order
    (`references`: (its place in `timed`, seconds); one slow reference among them moves nothing) over
    `level`, the reference count's seconds among the profile's small counts. Without references or a
    level: as given."""
    if not references or level <= 0:
        return list(timed)
    out = []
    for place, (rows, seconds) in enumerate(timed):
        if rows > reference:
            near = sorted(references, key=lambda ref: abs(ref[0] - place))[:3]
            seconds *= level / statistics.median(s for _, s in near)
        out.append((rows, seconds))
    return out
