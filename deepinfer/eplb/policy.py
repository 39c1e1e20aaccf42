"""How EPLB uses replicas: the rank-side replica choice and the balancer's re-placement rule, as pure functions
shared by the engine (`layers/ep_moe.py`, `eplb/balancer.py`) and the at-scale simulation (`bench/eplb.py`),
so the simulation models the rule the engine runs, not an idealised one.

Replica choice (per rank, per forward, no communication; see `layers/ep_moe.py` for why): a rank with n
pairs of logical expert e, which has c replicas, uses u = `replicas_used(n, c)` = min(c, max(1, n //
`SPLIT_ROWS`)) of them, in its order of preference (`replica_preference`: the replica on this rank first,
otherwise a rotation over the ranks without one); its n pairs, in order, are cut into u contiguous chunks of
equal size to within one (`chunk_rows`), chunk i to the i-th preferred replica.

Re-placement (`plan_placement`, every balancer interval, every rank computing the same from all-reduced
counts): `balanced_placement` of the window's load, where an expert gets its c-th replica only if a rank's
rows of it in the window's median step (all ranks' rows / ranks) reach c x `SPLIT_ROWS`; kept only if it
lowers the busiest rank's expected load by at least `MIN_GAIN`.
"""

from __future__ import annotations

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


def plan_placement(load: Sequence[float], median_step_rows: Sequence[float], num_ranks: int, num_redundant: int,
                   current: Placement, *, split_rows: int = SPLIT_ROWS,
                   num_nodes: int | None = None) -> Placement | None:
    """The balancer's decision for one layer: the new placement for the window's per-expert `load` (all
    ranks), or None to keep `current`. `median_step_rows`: all ranks' rows of each expert in the window's
    median step; a rank's share of them (/ `num_ranks`) must reach c x `split_rows` for a c-th replica."""
    load = [float(x) for x in load]
    new = balanced_placement(load, num_ranks, num_redundant, num_nodes=num_nodes, previous=current,
                             step_rows=[float(x) / num_ranks for x in median_step_rows], min_replica_rows=split_rows)
    if new == current or max(rank_loads(new, load)) >= (1 - MIN_GAIN) * max(rank_loads(current, load)):
        return None
    return new
