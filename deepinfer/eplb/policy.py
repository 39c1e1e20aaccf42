"""How EPLB uses replicas: the rank-side replica choice and the balancer's re-placement rule, as pure functions
shared by the engine (`layers/ep_moe.py`, `eplb/balancer.py`) and the at-scale simulation (`bench/eplb.py`),
so the simulation models the rule the engine runs, not an idealised one.

Replica choice (per rank, per forward, no communication; see `layers/ep_moe.py` for why): a rank with n
pairs of logical expert e, which has c replicas, uses u = `replicas_used(n, c)` = min(c, max(1, n //
`SPLIT_ROWS`)) of them, in its order of preference (`replica_preference`: the replica on this rank first,
otherwise a rotation over the ranks without one); its n pairs, in order, are cut into u contiguous chunks of
equal size to within one (`chunk_rows`), chunk i to the i-th preferred replica.

Re-placement (`plan_placement`, every balancer interval, every rank computing the same from all-reduced
counts): two candidates, each a `balanced_placement` of the window's load that differs only in when an expert
earns its c-th replica (T = all ranks' rows of it in the window's median step, N ranks):
  - per rank: T / N >= c x `SPLIT_ROWS` (a rank's own rows fill a chunk for each replica: with few ranks, a
    replica then never costs a weight read its rows do not repay);
  - in all: T >= c x `SPLIT_ROWS` (each of c replicas receives ~T / c rows from the ranks' rotation: with
    64-128 ranks a hot expert has a few rows per rank, so the per-rank rule never replicates it).
The candidate with the lower `step_cost` (the busiest rank's rows plus `SPLIT_ROWS` row-equivalents per
weight read of a slot that gets rows, in the median step) is tried first, and a candidate is kept only if it
lowers the busiest rank's expected load over the window by at least `MIN_GAIN`; neither: keep the current.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from deepinfer.eplb.placement import Placement, balanced_placement, rank_loads

# rows that repay one more read of an expert's weights (`layers/ep_moe.py`, measured on this machine's CPU by
# benchmarks/expert_rows.py): a rank splits an expert's pairs over its replicas only in chunks of this many
SPLIT_ROWS = 16

# a layer's experts move only when the new placement lowers its busiest rank's expected load by this much
MIN_GAIN = 0.05


def replica_preference(placement: Placement, rank: int, expert: int) -> list[int]:
    """`expert`'s replica slots in `rank`'s order of preference: the one on `rank` first (no all-to-all);
    otherwise the j-th of the ranks holding no replica (in rank order) starts at replica (j + expert) % c, so
    those ranks spread over the replicas evenly; then the others in slot order, cyclically."""
    slots = placement.replicas(expert)
    s, c = placement.slots_per_rank, len(slots)
    ranks = [p // s for p in slots]
    if rank in ranks:
        first = ranks.index(rank)
    else:
        j = rank - sum(1 for q in ranks if q < rank)  # ranks below this one holding no replica
        first = (j + expert) % c
    return [slots[(first + i) % c] for i in range(c)]


def replicas_used(rows: int, replicas: int, split_rows: int = SPLIT_ROWS) -> int:
    """How many of an expert's `replicas` take a rank's `rows` pairs of it: one unless the rows fill
    `split_rows`-row chunks for more."""
    return min(replicas, max(1, rows // split_rows))


def chunk_rows(rows: int, replicas: int, split_rows: int = SPLIT_ROWS) -> list[int]:
    """The rows each of the rank's preferred replicas takes, in preference order (zeros past the used ones):
    pair i (of `rows`, in order) goes to chunk i * u // rows, u = `replicas_used`."""
    u = replicas_used(rows, replicas, split_rows)
    # pair index x is in chunk i iff i * rows <= x * u < (i + 1) * rows: ceil((i + 1) rows / u) - ceil(i rows / u)
    return [_ceil_div((i + 1) * rows, u) - _ceil_div(i * rows, u) if i < u else 0 for i in range(replicas)]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def slot_rows(placement: Placement, step_rows: Sequence[float], split_rows: int = SPLIT_ROWS) -> list[float]:
    """Each physical slot's rows in a step where every rank has 1 / N of each expert's `step_rows` (all ranks'
    rows) and routes them by the replica choice above: a holder of expert e keeps n / u rows on its own
    replica and sends n / u to each of the next u - 1 (so every replica gets n from the holders); the j-th
    non-holder sends n / u to each of u replicas from (j + e) % c on, which covers some replicas once more
    than others when c does not divide the non-holders' windows evenly."""
    if len(step_rows) != placement.num_experts:
        raise ValueError(f"{len(step_rows)} step rows for {placement.num_experts} experts")
    n_ranks = placement.num_ranks
    out = [0.0] * len(placement.physical_to_logical)
    for e, total in enumerate(step_rows):
        slots = placement.replicas(e)
        c = len(slots)
        n = float(total) / n_ranks
        u = replicas_used(int(n), c, split_rows)
        others = n_ranks - c
        rounds, rem = divmod(others, c)
        for i, slot in enumerate(slots):
            # non-holders with start (e + t) % c, t < rem, one more than the others: those within u before i
            extra = sum(1 for k in range(u) if (i - e - k) % c < rem)
            out[slot] = n + n / u * (rounds * u + extra)
    return out


def step_cost(placement: Placement, step_rows: Sequence[float], split_rows: int = SPLIT_ROWS) -> float:
    """The busiest rank's cost of one step, in rows: each slot's `slot_rows` plus `split_rows` for the read
    of its weights, weighted by the chance the slot gets any row (1 - exp(-rows), rows arriving independently)."""
    rows = slot_rows(placement, step_rows, split_rows)
    per_slot = [x + split_rows * -math.expm1(-x) for x in rows]
    s = placement.slots_per_rank
    return max(sum(per_slot[r * s:(r + 1) * s]) for r in range(placement.num_ranks))


def plan_placement(load: Sequence[float], median_step_rows: Sequence[float], num_ranks: int, num_redundant: int,
                   current: Placement, *, split_rows: int = SPLIT_ROWS,
                   num_nodes: int | None = None) -> Placement | None:
    """The balancer's decision for one layer: the new placement for the window's per-expert `load` (all
    ranks), or None to keep `current`. `median_step_rows`: all ranks' rows of each expert in the window's
    median step, which decide the replica counts (see the module docstring)."""
    load = [float(x) for x in load]
    rows = [float(x) for x in median_step_rows]
    candidates: list[Placement] = []
    for step_rows in ([x / num_ranks for x in rows], rows):  # the per-rank rule first: it wins ties
        new = balanced_placement(load, num_ranks, num_redundant, num_nodes=num_nodes, previous=current,
                                 step_rows=step_rows, min_replica_rows=split_rows)
        if new not in candidates:
            candidates.append(new)
    busiest = max(rank_loads(current, load))
    for new in sorted(candidates, key=lambda p: step_cost(p, rows, split_rows)):  # stable: ties keep rule order
        if new != current and max(rank_loads(new, load)) < (1 - MIN_GAIN) * busiest:
            return new
    return None
