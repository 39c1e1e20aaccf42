"""The balancer's re-placement rule (`eplb.policy.plan_placement`): which replica rule it takes at 2 ranks and
at 64 ranks, judged by `step_cost` (rows plus weight reads of the busiest rank)."""

from __future__ import annotations

import math

import pytest

from deepinfer.eplb import balanced_placement, initial_placement, rank_loads
from deepinfer.eplb.policy import (
    SPLIT_ROWS,
    chunk_rows,
    plan_placement,
    replica_preference,
    slot_rows,
    step_cost,
)


def _hot_load(experts: int, hot: dict[int, float], cold: float) -> list[float]:
    load = [cold] * experts
    for e, x in hot.items():
        load[e] = x
    return load


def test_step_cost_counts_rows_and_the_reads_of_slots_that_get_rows():
    p = initial_placement(4, 2, 0)  # rank 0: experts 0, 1; rank 1: experts 2, 3
    # rank 0: 40 + 0 rows; a slot with 40 rows is read for sure, one with none never
    assert step_cost(p, [40.0, 0.0, 10.0, 10.0], 16) == pytest.approx(40 + 16)
    replicated = initial_placement(4, 2, 2)  # rank 0: experts 0, 1, 2; rank 1: experts 3, 0, 1
    assert replicated.replica_counts() == [2, 2, 1, 1]
    # each rank: 20 rows of expert 0 and 10 of expert 2 or 3, two reads (one nearly sure with 10 rows)
    both = 20 + 10 + 16 * -math.expm1(-20) + 16 * -math.expm1(-10)
    assert step_cost(replicated, [40.0, 0.0, 10.0, 10.0], 16) == pytest.approx(both)
    with pytest.raises(ValueError, match="step rows for 4 experts"):
        step_cost(p, [1.0], 16)


def test_at_two_ranks_no_replica_that_costs_a_read_its_rows_do_not_repay():
    # 16 experts, 4 hot ones with 40 rows per step in all (20 per rank): the all-ranks rule would give each
    # a second replica (40 >= 2 x 16) but LPT balances the hot experts 2 / 2 without one, and a replica on
    # the other rank adds a read of 16 row-equivalents for 20 rows of balance that were not needed
    load = _hot_load(16, {4: 400.0, 5: 390.0, 6: 380.0, 7: 370.0}, 10.0)
    rows = [x / 10 for x in load]
    new = plan_placement(load, rows, 2, 4, initial_placement(16, 2, 4))
    assert new is not None
    assert all(len(new.replicas(e)) == 1 for e in range(4, 8))
    assert max(rank_loads(new, load)) / (sum(load) / 2) < 1.05


def test_at_64_ranks_hot_experts_get_replicas_from_all_ranks_rows():
    # 256 experts on 64 ranks (4 per rank + R / 64), top-8 over 64 x 8 tokens: 8 hot experts with 256 rows
    # per step in all, 4 per rank: the per-rank rule (4 < 2 x 16) never replicates them; the all-ranks rule
    # gives each up to 16 replicas (256 / 16), and the busiest rank's step cost falls
    experts, ranks, redundant = 256, 64, 64
    hot = {e: 256.0 for e in range(0, 256, 32)}
    rows = _hot_load(experts, hot, 2.0)
    load = [x * 100 for x in rows]
    current = initial_placement(experts, ranks, redundant)
    new = plan_placement(load, rows, ranks, redundant, current)
    assert new is not None
    counts = new.replica_counts()
    assert all(counts[e] > 4 for e in hot), [counts[e] for e in hot]
    assert step_cost(new, rows) < 0.5 * step_cost(current, rows)
    per_rank_only = plan_placement(load, rows, ranks, 0, initial_placement(experts, ranks, 0))
    assert per_rank_only is None or step_cost(new, rows) < step_cost(per_rank_only, rows)
    assert SPLIT_ROWS == 16  # the numbers above assume it


@pytest.mark.parametrize(("ranks", "redundant", "rows_per_rank"), [(2, 2, 20), (8, 8, 3), (8, 24, 40), (16, 16, 70)])
def test_slot_rows_is_the_replica_choice_when_every_rank_has_the_same_rows(ranks, redundant, rows_per_rank):
    # slot_rows' closed form against the replica choice itself (replica_preference + chunk_rows, rank by rank)
    experts = 16
    load = [float(1 + (7 * e) % 5) ** 3 for e in range(experts)]
    placement = balanced_placement(load, ranks, redundant)
    expected = [0.0] * len(placement.physical_to_logical)
    for e in range(experts):
        for r in range(ranks):
            for slot, n in zip(replica_preference(placement, r, e), chunk_rows(rows_per_rank, len(placement.replicas(e))),
                               strict=True):
                expected[slot] += n
    got = slot_rows(placement, [float(rows_per_rank * ranks)] * experts)
    assert got == pytest.approx(expected, abs=1e-9 + 1.0 * ranks)  # chunks are equal to within one row
    assert sum(got) == pytest.approx(sum(expected))
    if rows_per_rank % 4 == 0:  # chunks divide evenly (u <= 4 here): exact
        assert got == pytest.approx(expected)
