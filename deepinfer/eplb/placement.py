"""Where one MoE layer's experts live: a `Placement` of logical experts on the physical expert slots of the
ranks, the initial placement, and the balanced placement computed from observed expert loads.

A layer has E logical experts and N ranks with S slots each (S * N = E + R, R the redundant slots). Physical
slot p is on rank p // S and holds logical expert `physical_to_logical[p]`; every expert has at least one
slot and no rank holds one expert twice. A token routed to an expert with several replicas goes to one of
them; the expected load of each replica is the expert's load divided by its replica count.

`balanced_placement` (the idea of DeepSeek's EPLB, written from its description):
  1. replicate: start with one replica per expert; R times, give one more replica to the expert with the
     highest load per replica (ties: the lower id), never more replicas than ranks. The replicas go to the
     hottest experts: a hotter expert never has fewer replicas than a cooler one. With `min_replica_rows`
     and `step_rows` (the balancer: `SPLIT_ROWS`, and a rank's rows of the expert in the window's median
     step, `layers/ep_moe.py`), only where each of the expert's replicas keeps at least that many: a replica costs a read of the expert's weights in
     every step it runs, which a few rows do not repay (on CPU a matmul of a few rows costs about its
     weight read). The slots left then copy the coldest experts (lowest load first), whose copies are
     rarely read at all; every slot must hold some expert.
  2. pack: the replicas, heaviest first (load / replicas; ties: lower expert id), each go to the rank with
     the smallest load so far among those with a free slot that do not hold that expert yet (ties: fewer
     slots used, then the lower rank): greedy longest-processing-time with a per-rank slot capacity. If
     only ranks already holding the expert have free slots (possible for the last, lightest replicas), a
     replica of another expert on a rank without it moves to the free slot and this one takes its place.
  3. with `previous` (the placement being replaced): ranks are interchangeable for balance, so the packed
     rank sets are matched to the ranks that already hold most of each set (greedily, largest overlap
     first; ties: lower ids), which keeps the loads and cuts the weights a switch moves;
  4. each rank's experts are laid out in ascending id (what `RoutedExperts.local_experts` wants).

With `num_nodes` (the hierarchical variant, for ranks grouped in nodes with a faster link inside a node):
the logical experts are first packed onto nodes by LPT (E / nodes each, balancing node load), then each
node replicates with its share of the redundant slots (R / nodes) and packs onto its own ranks as above,
so all of an expert's replicas (and its dispatch traffic) stay inside one node (with `previous`, each node's
rank sets are matched to that node's ranks).

Switching placements moves weights: `moved_slots` counts the expert weights a switch has to bring onto
ranks (an expert that stays on a rank costs nothing), and `keep_slots` reorders each rank's slots of a new
placement so an expert that stays on a rank also stays in its slot (for a runtime that copies slot by
slot; the result is then not in ascending order per rank).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Placement:
    """The physical slots of one MoE layer's experts: slot p is on rank p // slots_per_rank and holds logical
    expert physical_to_logical[p]."""

    num_experts: int  # logical experts of one MoE layer
    num_ranks: int
    physical_to_logical: tuple[int, ...]  # len = num_ranks * slots_per_rank

    def __post_init__(self) -> None:
        object.__setattr__(self, "physical_to_logical", tuple(int(e) for e in self.physical_to_logical))
        e, n, p2l = self.num_experts, self.num_ranks, self.physical_to_logical
        if e <= 0 or n <= 0:
            raise ValueError(f"need num_experts > 0 and num_ranks > 0, got {e} and {n}")
        if not p2l or len(p2l) % n:
            raise ValueError(f"{len(p2l)} physical slots do not split evenly over {n} ranks")
        if len(p2l) < e:
            raise ValueError(f"{len(p2l)} physical slots cannot hold {e} experts")
        bad = [x for x in p2l if not 0 <= x < e]
        if bad:
            raise ValueError(f"expert id {bad[0]} out of range ({e} experts)")
        missing = sorted(set(range(e)) - set(p2l))
        if missing:
            raise ValueError(f"expert {missing[0]} has no physical slot")
        s = len(p2l) // n
        for r in range(n):
            held = p2l[r * s:(r + 1) * s]
            if len(set(held)) != len(held):
                dup = next(x for x in held if held.count(x) > 1)
                raise ValueError(f"rank {r} holds expert {dup} more than once")

    @property
    def slots_per_rank(self) -> int:
        return len(self.physical_to_logical) // self.num_ranks

    @property
    def num_redundant(self) -> int:
        return len(self.physical_to_logical) - self.num_experts

    @cached_property
    def _replicas(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in range(self.num_experts)]
        for p, e in enumerate(self.physical_to_logical):
            out[e].append(p)
        return tuple(tuple(x) for x in out)

    def replicas(self, expert: int) -> tuple[int, ...]:
        """The physical slots holding logical `expert`, ascending."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range ({self.num_experts} experts)")
        return self._replicas[expert]

    def replica_counts(self) -> list[int]:
        """Replicas per logical expert."""
        return [len(r) for r in self._replicas]

    def rank_experts(self, rank: int) -> tuple[int, ...]:
        """The logical experts held on `rank`, its slots in order."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} out of range ({self.num_ranks} ranks)")
        s = self.slots_per_rank
        return self.physical_to_logical[rank * s:(rank + 1) * s]


def _check_sizes(num_experts: int, num_ranks: int, num_redundant: int) -> int:
    """Validate the sizes; return the slots per rank."""
    if num_experts <= 0 or num_ranks <= 0:
        raise ValueError(f"need num_experts > 0 and num_ranks > 0, got {num_experts} and {num_ranks}")
    if num_redundant < 0:
        raise ValueError(f"num_redundant must be >= 0, got {num_redundant}")
    if (num_experts + num_redundant) % num_ranks:
        raise ValueError(f"num_experts + num_redundant ({num_experts} + {num_redundant}) must be a multiple of "
                         f"num_ranks ({num_ranks})")
    if num_redundant > num_experts * (num_ranks - 1):
        raise ValueError(f"{num_redundant} redundant slots: an expert can have at most one replica per rank "
                         f"(at most {num_experts * (num_ranks - 1)} redundant slots with {num_ranks} ranks)")
    return (num_experts + num_redundant) // num_ranks


def initial_placement(num_experts: int, num_ranks: int, num_redundant: int = 0) -> Placement:
    """The contiguous split: slots 0..E-1 hold experts 0..E-1 in order, the R redundant slots after them hold
    replicas of experts 0, 1, ... (wrapping when R > E). Needs (E + R) % N == 0."""
    _check_sizes(num_experts, num_ranks, num_redundant)
    p2l = list(range(num_experts)) + [i % num_experts for i in range(num_redundant)]
    return Placement(num_experts, num_ranks, tuple(p2l))


def _loads(load: Sequence[float]) -> list[float]:
    out = [float(x) for x in load]
    if any(not x >= 0 or x == float("inf") for x in out):  # also rejects NaN
        raise ValueError("expert loads must be finite and >= 0")
    return out


def _replicate(load: list[float], extra: int, max_replicas: int, step_rows: list[float] | None = None,
               min_replica_rows: float = 0.0) -> list[int]:
    """Replica counts: one each, then `extra` more, each to the expert with the highest load per replica among
    those whose replicas would each keep at least `min_replica_rows` of its `step_rows` (default: its load);
    extras no expert qualifies for go to the coldest experts (lowest load, ties: lower id; one more replica
    each in turn)."""
    rows = load if step_rows is None else step_rows
    counts = [1] * len(load)
    heap = [(-x, e) for e, x in enumerate(load)]  # (-load per replica, id): ties go to the lower id
    heapq.heapify(heap)
    left = extra
    while left and heap:
        _, e = heapq.heappop(heap)
        if rows[e] / (counts[e] + 1) < min_replica_rows:
            continue  # this expert's next replica does not pay, nor any later one (its rows only divide more)
        counts[e] += 1
        left -= 1
        if counts[e] < max_replicas:
            heapq.heappush(heap, (-load[e] / counts[e], e))
    coldest = sorted(range(len(load)), key=lambda e: (load[e], e))
    while left:  # callers bound extra by len(load) * (max_replicas - 1), so some expert always has room
        for e in coldest:
            if left and counts[e] < max_replicas:
                counts[e] += 1
                left -= 1
    return counts


def _pack(load: list[float], counts: list[int], num_ranks: int, slots: int) -> list[list[int]]:
    """LPT with a slot capacity per rank and no expert twice on a rank; returns each rank's experts."""
    items = sorted(((load[e] / c, e) for e, c in enumerate(counts) for _ in range(c)), key=lambda t: (-t[0], t[1]))
    rank_load = [0.0] * num_ranks
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    weight = {e: load[e] / c for e, c in enumerate(counts)}
    for w, e in items:
        best, key = -1, None
        for r in range(num_ranks):
            if len(held[r]) < slots and e not in held[r]:
                k = (rank_load[r], len(held[r]))
                if key is None or k < key:
                    best, key = r, k
        if best < 0:
            best = _make_room(held, e, slots, weight, rank_load)
        held[best].append(e)
        rank_load[best] += w
    return held


def _make_room(held: list[list[int]], e: int, slots: int, weight: dict[int, float], rank_load: list[float]) -> int:
    """Every rank with a free slot already holds `e`: move some other expert x from a rank b without `e` into
    such a free slot (its rank must not hold x), freeing a slot on b; return b."""
    free = [a for a in range(len(held)) if len(held[a]) < slots]
    for b in sorted(range(len(held)), key=lambda r: rank_load[r]):
        if e in held[b]:
            continue
        for a in free:
            for x in sorted(held[b], key=lambda x: weight[x]):
                if x not in held[a]:
                    held[b].remove(x)
                    held[a].append(x)
                    rank_load[b] -= weight[x]
                    rank_load[a] += weight[x]
                    return b
    raise RuntimeError(f"no rank can take a replica of expert {e}")  # unreachable with valid sizes


def _flat(ranks: list[list[int]]) -> tuple[int, ...]:
    return tuple(e for held in ranks for e in sorted(held))


def _match_previous(sets: list[list[int]], previous: Placement, first_rank: int) -> list[list[int]]:
    """Reorder `sets` (for ranks first_rank, first_rank + 1, ...) so each goes to the rank of `previous` holding
    most of its experts: greedy matching by largest overlap, ties to the lower set then rank."""
    ranks = range(first_rank, first_rank + len(sets))
    held = {r: set(previous.rank_experts(r)) for r in ranks}
    pairs = sorted(((len(set(s) & held[r]), i, r) for i, s in enumerate(sets) for r in ranks),
                   key=lambda t: (-t[0], t[1], t[2]))
    out: dict[int, list[int]] = {}
    used: set[int] = set()
    for _, i, r in pairs:
        if i not in used and r not in out:
            out[r] = sets[i]
            used.add(i)
    return [out[r] for r in ranks]


def balanced_placement(load: Sequence[float], num_ranks: int, num_redundant: int = 0, *,
                       num_nodes: int | None = None, previous: Placement | None = None,
                       step_rows: Sequence[float] | None = None, min_replica_rows: float = 0.0) -> Placement:
    """A placement for per-expert `load` (tokens over a window): the `num_redundant` extra slots replicate the
    hottest experts and the replicas are packed so each rank's expected load is balanced (see the module
    docstring). `num_nodes`: the hierarchical variant (experts to nodes first, replicas stay in their node).
    `previous`: the placement being replaced; the result keeps as many experts on their ranks as it can
    without changing any rank's load set. `step_rows` (per expert, default `load`) and `min_replica_rows`: an
    expert gets another replica only if each of its replicas then keeps at least `min_replica_rows` of its
    `step_rows` (a replica that would not repay its weight reads is not made; the slots left over copy the
    coldest experts); `min_replica_rows` 0: every extra slot replicates the hottest."""
    if not min_replica_rows >= 0:
        raise ValueError(f"min_replica_rows must be >= 0, got {min_replica_rows}")
    rows = None if step_rows is None else _loads(step_rows)
    if rows is not None and len(rows) != len(load):
        raise ValueError(f"{len(rows)} step rows for {len(load)} experts")
    loads = _loads(load)
    e = len(loads)
    slots = _check_sizes(e, num_ranks, num_redundant)
    if previous is not None and (previous.num_experts, previous.num_ranks) != (e, num_ranks):
        raise ValueError(f"previous placement has {previous.num_experts} experts on {previous.num_ranks} ranks, "
                         f"not {e} on {num_ranks}")
    if num_nodes is None or num_nodes == 1:
        counts = _replicate(loads, num_redundant, num_ranks, rows, min_replica_rows)
        packed = _pack(loads, counts, num_ranks, slots)
        if previous is not None:
            packed = _match_previous(packed, previous, 0)
        return Placement(e, num_ranks, _flat(packed))
    if num_nodes <= 0 or num_ranks % num_nodes or e % num_nodes or num_redundant % num_nodes:
        raise ValueError(f"num_nodes={num_nodes} must divide num_ranks ({num_ranks}), the experts ({e}) and the "
                         f"redundant slots ({num_redundant})")
    per_node_ranks = num_ranks // num_nodes
    per_node_extra = num_redundant // num_nodes
    if per_node_extra > (e // num_nodes) * (per_node_ranks - 1):
        raise ValueError(f"{per_node_extra} redundant slots per node exceed one replica per rank of the node's "
                         f"{e // num_nodes} experts on {per_node_ranks} ranks")
    nodes = _pack(loads, [1] * e, num_nodes, e // num_nodes)  # LPT of logical experts onto nodes
    ranks: list[list[int]] = []
    for members in nodes:
        members = sorted(members)
        sub = [loads[x] for x in members]
        counts = _replicate(sub, per_node_extra, per_node_ranks,
                            None if rows is None else [rows[x] for x in members], min_replica_rows)
        node_sets = [[members[i] for i in held] for held in _pack(sub, counts, per_node_ranks, slots)]
        if previous is not None:
            node_sets = _match_previous(node_sets, previous, len(ranks))
        ranks.extend(node_sets)
    return Placement(e, num_ranks, _flat(ranks))


def rank_loads(placement: Placement, load: Sequence[float]) -> list[float]:
    """Each rank's expected load: the sum over its slots of the expert's load / its replica count."""
    loads = _loads(load)
    if len(loads) != placement.num_experts:
        raise ValueError(f"{len(loads)} loads for {placement.num_experts} experts")
    counts = placement.replica_counts()
    per_replica = [x / c for x, c in zip(loads, counts, strict=True)]
    return [sum(per_replica[x] for x in placement.rank_experts(r)) for r in range(placement.num_ranks)]


def _same_shape(a: Placement, b: Placement) -> None:
    if (a.num_experts, a.num_ranks, a.slots_per_rank) != (b.num_experts, b.num_ranks, b.slots_per_rank):
        raise ValueError("placements differ in experts, ranks or slots per rank")


def moved_slots(old: Placement, new: Placement) -> int:
    """Expert weights a switch from `old` to `new` brings onto ranks: per rank, the experts of `new` it did
    not hold in `old` (slot order does not count: a rank permutes its own slots without any transfer)."""
    _same_shape(old, new)
    return sum(len(set(new.rank_experts(r)) - set(old.rank_experts(r))) for r in range(new.num_ranks))


def keep_slots(new: Placement, old: Placement) -> Placement:
    """`new` with each rank's slots reordered so an expert it held in `old` stays in its old slot (the same
    experts per rank as `new`, so the same loads; only fewer slot-to-slot copies)."""
    _same_shape(old, new)
    s = new.slots_per_rank
    out: list[int] = []
    for r in range(new.num_ranks):
        before, after = old.rank_experts(r), new.rank_experts(r)
        stay = set(before) & set(after)
        incoming = iter(x for x in after if x not in stay)
        out.extend(x if x in stay else next(incoming) for x in before[:s])
    return Placement(new.num_experts, new.num_ranks, tuple(out))
