"""Expert placement: the invariants over many random loads and sizes, and what balancing achieves."""

from __future__ import annotations

import random

import pytest

from deepinfer.eplb import (
    Placement,
    balanced_placement,
    initial_placement,
    keep_slots,
    moved_slots,
    rank_loads,
)
from deepinfer.eplb.stats import imbalance


def _random_load(rng: random.Random, e: int) -> list[float]:
    kind = rng.choice(["zipf", "uniform", "spiky", "zeros", "ties"])
    if kind == "zipf":
        load = [1.0 / (i + 1) ** rng.uniform(0.3, 2.0) for i in range(e)]
        rng.shuffle(load)
    elif kind == "uniform":
        load = [rng.uniform(0, 100) for _ in range(e)]
    elif kind == "spiky":
        load = [0.0] * e
        for _ in range(rng.randint(1, 3)):
            load[rng.randrange(e)] = rng.uniform(100, 10000)
    elif kind == "zeros":
        load = [0.0] * e
    else:
        load = [float(rng.randint(0, 3)) for _ in range(e)]
    return load


def _cases(n: int = 300):
    rng = random.Random(20)
    for _ in range(n):
        ranks = rng.choice([1, 2, 3, 4, 8, 16])
        e = rng.choice([4, 8, 16, 64]) if ranks > 1 else rng.choice([1, 4, 8])
        per_rank = -(-e // ranks)  # at least enough slots for every expert
        slots = rng.randint(per_rank, min(per_rank + 4, e))
        redundant = slots * ranks - e
        if redundant > e * (ranks - 1):
            continue
        yield rng, _random_load(rng, e), ranks, redundant


def test_balanced_placement_invariants_over_random_loads():
    checked = 0
    for _, load, ranks, redundant in _cases():
        p = balanced_placement(load, ranks, redundant)
        e = len(load)
        assert len(p.physical_to_logical) == e + redundant and p.slots_per_rank * ranks == e + redundant
        # every expert placed, no rank holds one twice (also checked by Placement itself)
        assert set(p.physical_to_logical) == set(range(e))
        for r in range(ranks):
            held = p.rank_experts(r)
            assert len(held) == p.slots_per_rank and len(set(held)) == len(held)
        # replicas go to the hottest experts: a hotter expert never has fewer replicas
        counts = [len(p.replicas(x)) for x in range(e)]
        assert sum(counts) == e + redundant and max(counts) <= ranks
        for a in range(e):
            for b in range(e):
                if load[a] > load[b]:
                    assert counts[a] >= counts[b], (load, counts)
        # the expected rank loads account for all the load
        loads = rank_loads(p, load)
        assert sum(loads) == pytest.approx(sum(load), rel=1e-9, abs=1e-9)
        # the list-scheduling bound of greedy packing: the busiest rank exceeds the mean by at most one replica
        heaviest = max(x / c for x, c in zip(load, counts, strict=True))
        assert max(loads) <= sum(load) / ranks + heaviest + 1e-9
        # replicas of one expert: ascending slots, on distinct ranks
        for x in range(e):
            slots = p.replicas(x)
            assert list(slots) == sorted(slots)
            assert len({s // p.slots_per_rank for s in slots}) == len(slots)
        checked += 1
    assert checked > 200


def test_balancing_a_zipf_load():
    # Zipf load over 64 experts on 8 ranks: the contiguous split puts the hottest experts together
    load = [1.0 / (i + 1) for i in range(64)]
    before = imbalance(rank_loads(initial_placement(64, 8, 0), load))
    assert before >= 4.5  # 4.58: ranks 0's experts 0..7 carry a third of the load
    # repacking alone cannot split expert 0 (load 1, while the mean rank load is 0.593), and its rank has 7
    # more slots to fill: the best possible is expert 0 with the 7 coolest, which is what the packing finds
    repacked = imbalance(rank_loads(balanced_placement(load, 8, 0), load))
    assert repacked == pytest.approx((1.0 + sum(load[-7:])) / (sum(load) / 8))  # 1.88
    # with 8 redundant slots the hot experts are split and the ranks come out within 1% of each other
    initial8 = imbalance(rank_loads(initial_placement(64, 8, 8), load))
    balanced8 = imbalance(rank_loads(balanced_placement(load, 8, 8), load))
    assert initial8 >= 2.4 and balanced8 <= 1.01
    p = balanced_placement(load, 8, 8)
    # by load per replica: 1 -> 1/2, then (ties to the lower id) 1/3, 1/2 -> 1/4, 1/3 -> 1/4, 1/3 -> 1/6, 1/4 -> 1/5,
    # 1/4 -> 1/6, 1/4 -> 1/8: the hottest experts get them, in order
    assert [len(p.replicas(x)) for x in range(4)] == [5, 3, 2, 2]
    assert all(len(p.replicas(x)) == 1 for x in range(4, 64))


def test_replication_order_is_highest_load_per_replica():
    # loads 9, 4, 1 on 3 ranks with 3 extra slots: 9 -> 4.5 (second replica), then 4.5 vs 4: 9 again (3),
    # then 4 > 3: expert 1 gets its second replica; packing: 3 | 3 | 3, then 2 | 2 on two ranks, 1 on the third
    p = balanced_placement([9.0, 4.0, 1.0], 3, 3)
    assert [len(p.replicas(x)) for x in range(3)] == [3, 2, 1]
    assert sorted(rank_loads(p, [9.0, 4.0, 1.0])) == pytest.approx([4.0, 5.0, 5.0])


def test_replicas_only_where_they_repay_their_weight_reads():
    # the EPLB benchmark's shape: 16 experts on 2 ranks, 4 hot ones; 8 hot rows per step: a second replica
    # would keep 4 rows per step (< 16), so the 4 redundant slots copy the 4 coldest experts instead
    load = [10.0] * 16
    load[4:8] = [400.0, 390.0, 380.0, 370.0]
    load[9], load[12] = 1.0, 2.0
    step = [x / 50 for x in load]  # the typical step: 8.0 / 7.8 / 7.6 / 7.4 hot rows
    few = balanced_placement(load, 2, 4, step_rows=step, min_replica_rows=16)
    assert sorted(x for x in range(16) if len(few.replicas(x)) > 1) == [0, 1, 9, 12]  # load 1, 2, then 10 (ids)
    assert max(rank_loads(few, load)) / (sum(load) / 2) < 1.05  # still balanced: hot experts split 2 / 2
    # 40 hot rows per step: each of two replicas keeps 20 (>= 16), so the hot experts are replicated
    many = balanced_placement(load, 2, 4, step_rows=[x * 5 for x in step], min_replica_rows=16)
    assert [len(many.replicas(x)) for x in range(16)] == [2 if 4 <= x < 8 else 1 for x in range(16)]
    assert many == balanced_placement(load, 2, 4)  # the same as without the rule
    # in between: only the experts whose two replicas keep 16 rows each (33 and 32 rows, not 31.5 and 31)
    mid_rows = [0.2] * 16
    mid_rows[4:8] = [33.0, 32.0, 31.5, 31.0]
    mid = balanced_placement(load, 2, 4, step_rows=mid_rows, min_replica_rows=16)
    assert sorted(x for x in range(16) if len(mid.replicas(x)) > 1) == [4, 5, 9, 12]
    # hierarchical: the rule applies inside each node
    hier = balanced_placement(load, 4, 4, num_nodes=2, step_rows=step, min_replica_rows=16)
    assert all(len(hier.replicas(x)) == 1 for x in range(4, 8))
    with pytest.raises(ValueError, match="min_replica_rows must be >= 0"):
        balanced_placement(load, 2, 4, min_replica_rows=-1)
    with pytest.raises(ValueError, match="step rows for 16 experts"):
        balanced_placement(load, 2, 4, step_rows=[1.0], min_replica_rows=1)


def test_initial_placement_layout_and_validation():
    p = initial_placement(8, 4, 4)
    assert p.physical_to_logical == (0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3)
    assert p.slots_per_rank == 3 and p.rank_experts(0) == (0, 1, 2) and p.rank_experts(3) == (1, 2, 3)
    assert p.replicas(0) == (0, 8) and p.replicas(7) == (7,)
    with pytest.raises(ValueError, match="multiple of num_ranks"):
        initial_placement(8, 3, 0)
    with pytest.raises(ValueError, match="multiple of num_ranks"):
        balanced_placement([1.0] * 8, 3, 2)
    with pytest.raises(ValueError, match="one replica per rank"):
        initial_placement(4, 1, 4)  # one rank cannot hold a second copy
    with pytest.raises(ValueError, match=">= 0"):
        balanced_placement([1.0, -1.0], 2, 0)
    with pytest.raises(ValueError, match=">= 0"):
        balanced_placement([1.0, float("nan")], 2, 0)


def test_placement_validation():
    with pytest.raises(ValueError, match="no physical slot"):
        Placement(4, 2, (0, 1, 2, 2))
    with pytest.raises(ValueError, match="rank 1 holds expert 3 more than once"):
        Placement(4, 2, (0, 1, 2, 3, 3, 1))
    with pytest.raises(ValueError, match="split evenly"):
        Placement(4, 2, (0, 1, 2, 3, 0))
    with pytest.raises(ValueError, match="out of range"):
        Placement(4, 2, (0, 1, 2, 4))
    p = Placement(4, 2, (0, 1, 2, 3, 0, 2))  # rank 0: 0 1 2, rank 1: 3 0 2
    assert p.replicas(0) == (0, 4) and p.replicas(2) == (2, 5) and p.num_redundant == 2
    with pytest.raises(ValueError):
        p.replicas(4)
    with pytest.raises(ValueError):
        p.rank_experts(2)
    with pytest.raises(ValueError, match="4 experts"):
        rank_loads(p, [1.0, 2.0])


def test_hierarchical_keeps_replicas_in_their_node():
    rng = random.Random(3)
    load = [1.0 / (i + 1) for i in range(32)]
    rng.shuffle(load)
    p = balanced_placement(load, 8, 8, num_nodes=2)
    node_of = lambda slot: slot // p.slots_per_rank // 4  # noqa: E731
    for x in range(32):
        assert len({node_of(s) for s in p.replicas(x)}) == 1
    flat = balanced_placement(load, 8, 8)
    assert imbalance(rank_loads(p, load)) < imbalance(rank_loads(initial_placement(32, 8, 8), load))
    assert sum(rank_loads(p, load)) == pytest.approx(sum(load))
    assert imbalance(rank_loads(flat, load)) <= imbalance(rank_loads(p, load)) + 1e-9  # locality costs balance
    with pytest.raises(ValueError, match="num_nodes"):
        balanced_placement(load, 8, 8, num_nodes=3)


def test_moved_slots_and_keep_slots():
    old = Placement(4, 2, (0, 1, 2, 3))
    new = Placement(4, 2, (0, 2, 1, 3))  # 1 and 2 swap ranks
    assert moved_slots(old, new) == 2 and moved_slots(old, old) == 0
    kept = keep_slots(Placement(4, 2, (1, 3, 0, 2)), Placement(4, 2, (3, 0, 1, 2)))
    # rank 0 keeps 3 in slot 0 (old: 3, 0), 1 comes into slot 1; rank 1 keeps 2 in slot 3, 0 comes into slot 2
    assert kept.physical_to_logical == (3, 1, 0, 2)
    rng = random.Random(5)
    for _ in range(50):
        a = balanced_placement(_random_load(rng, 16), 4, 4)
        b = balanced_placement(_random_load(rng, 16), 4, 4)
        k = keep_slots(b, a)
        assert [sorted(k.rank_experts(r)) for r in range(4)] == [sorted(b.rank_experts(r)) for r in range(4)]
        stay = sum(1 for s, x in enumerate(k.physical_to_logical) if a.physical_to_logical[s] == x)
        assert stay == 16 + 4 - moved_slots(a, b)  # every expert that stays on its rank stays in its slot
    with pytest.raises(ValueError, match="differ"):
        moved_slots(old, initial_placement(4, 2, 2))


def test_previous_placement_keeps_experts_on_their_ranks():
    rng = random.Random(9)
    fewer = 0
    for _ in range(40):
        a_load, b_load = _random_load(rng, 64), _random_load(rng, 64)
        old = balanced_placement(a_load, 8, 8)
        fresh = balanced_placement(b_load, 8, 8)
        kept = balanced_placement(b_load, 8, 8, previous=old)
        # the same rank sets (so the same loads), only on other ranks, and never more to move
        assert sorted(map(sorted, (kept.rank_experts(r) for r in range(8)))) == \
            sorted(map(sorted, (fresh.rank_experts(r) for r in range(8))))
        assert sorted(rank_loads(kept, b_load)) == pytest.approx(sorted(rank_loads(fresh, b_load)))
        assert moved_slots(old, kept) <= moved_slots(old, fresh)
        fewer += moved_slots(old, kept) < moved_slots(old, fresh)
        assert moved_slots(old, balanced_placement(a_load, 8, 8, previous=old)) == 0  # same load: nothing moves
    assert fewer >= 20
    # hierarchical: the sets stay in their node
    load = _random_load(rng, 32)
    old = balanced_placement(load[::-1], 8, 8, num_nodes=2)
    p = balanced_placement(load, 8, 8, num_nodes=2, previous=old)
    for x in range(32):
        assert len({s // p.slots_per_rank // 4 for s in p.replicas(x)}) == 1
    with pytest.raises(ValueError, match="previous placement"):
        balanced_placement(load, 8, 8, previous=initial_placement(32, 4, 0))
