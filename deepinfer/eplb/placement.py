"""Expert placement: which logical expert each physical expert slot holds, and how to choose one.

(Minimal version for the expert-parallel runtime; the full algorithm and its simulation live in the
branch that owns this module, behind the same names.)

A `Placement` covers one MoE layer: `num_ranks * slots_per_rank` physical slots, slot p on rank
p // slots_per_rank. `balanced_placement` gives the `num_redundant` extra slots to the hottest experts
(greedily, each to the expert with the highest load per replica), then packs the replicas on the ranks
heaviest first onto the least loaded rank with a free slot (a replica's load is its expert's load split
evenly among its replicas).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    num_experts: int
    num_ranks: int
    physical_to_logical: tuple[int, ...]

    @property
    def slots_per_rank(self) -> int:
        return len(self.physical_to_logical) // self.num_ranks

    def replicas(self, expert: int) -> tuple[int, ...]:
        return tuple(p for p, e in enumerate(self.physical_to_logical) if e == expert)

    def rank_experts(self, rank: int) -> tuple[int, ...]:
        s = self.slots_per_rank
        return self.physical_to_logical[rank * s:(rank + 1) * s]


def _check(num_experts: int, num_ranks: int, num_redundant: int) -> None:
    if num_experts <= 0 or num_ranks <= 0 or num_redundant < 0:
        raise ValueError(f"bad placement sizes: {num_experts} experts, {num_ranks} ranks, {num_redundant} redundant")
    if (num_experts + num_redundant) % num_ranks:
        raise ValueError(f"{num_experts} experts + {num_redundant} redundant slots do not split evenly over "
                         f"{num_ranks} ranks")


def initial_placement(num_experts: int, num_ranks: int, num_redundant: int) -> Placement:
    _check(num_experts, num_ranks, num_redundant)
    slots = list(range(num_experts)) + [e % num_experts for e in range(num_redundant)]
    return Placement(num_experts, num_ranks, tuple(slots))


def balanced_placement(load: Sequence[float], num_ranks: int, num_redundant: int) -> Placement:
    num_experts = len(load)
    _check(num_experts, num_ranks, num_redundant)
    copies = [1] * num_experts
    for _ in range(num_redundant):
        e = max(range(num_experts), key=lambda i: (load[i] / copies[i], -i))
        copies[e] += 1
    items = sorted(((load[e] / copies[e], e) for e in range(num_experts) for _ in range(copies[e])),
                   key=lambda t: (-t[0], t[1]))
    per_rank = (num_experts + num_redundant) // num_ranks
    totals = [0.0] * num_ranks
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    for w, e in items:
        free = [r for r in range(num_ranks) if len(held[r]) < per_rank]
        r = min(free, key=lambda r: (e in held[r], totals[r], r))  # a rank without this expert first
        held[r].append(e)
        totals[r] += w
    return Placement(num_experts, num_ranks, tuple(e for r in range(num_ranks) for e in sorted(held[r])))


def rank_loads(placement: Placement, load: Sequence[float]) -> list[float]:
    out = [0.0] * placement.num_ranks
    s = placement.slots_per_rank
    for p, e in enumerate(placement.physical_to_logical):
        out[p // s] += load[e] / len(placement.replicas(e))
    return out
