"""Routed experts split over expert-parallel ranks: all-to-all dispatch and combine around `RoutedExperts`.

An `ExpertParallelExperts` replaces a model's `RoutedExperts` (same `forward(x, expert_ids, weights)`, same
`expert_weight(expert, proj)` for the loaders). It holds this rank's *physical slots* of a `Placement`
(`deepinfer/eplb/placement.py`): slot p lives on rank p // slots_per_rank and holds logical expert
`physical_to_logical[p]`; a hot expert may have several slots (replicas), on several ranks (never two on one
rank: `Placement` refuses that, as a second copy on one rank could only read the same weights again).

One forward, on every rank at once (ranks without tokens pass empty tensors and still take part):

    (token t, its j-th expert e) pairs ──▶ slot: one of e's replicas (replica choice, below)
      ──▶ sort pairs by the slot's rank ──▶ all_to_all: pair counts, then rows of x with (slot, weight) appended
      ──▶ each rank runs its slots' pairs grouped by slot (`RoutedExperts.compute`, one output row per pair)
      ──▶ all_to_all back ──▶ each token sums its k pair outputs in ascending logical expert id

The last step adds in the order the single-process layer does (its `index_add_` goes expert by expert in
ascending id, starting from zeros), so the sum of a token's expert outputs is the same float whichever rank
computed each term; only an expert matmul's row count differs with the batch (as it does between batches in
one process). A replica changes which rank computes a term, never its value.

Replica choice (cost-aware, deterministic, decided by each rank for its own pairs without communication).
An expert matmul on CPU costs about one read of the slot's weights plus a cost per row: measured for the
EPLB benchmark's experts (fp32, hidden 512, intermediate 512, 3 MiB per slot, one thread, 16 experts in
turn so the weights come from memory; `benchmarks/BENCHMARKS.md`, "cost-aware replica choice"), ~0.6-0.8
ms for one row and ~0.04-0.06 ms per further row, so a second replica's weight read is repaid only by
about 16 rows moved to it: `SPLIT_ROWS`. (The GGUF block path reads its blocks once per `max_rows()` = 8
rows, so for it one pass serves up to 8 rows at about the cost of one: also below `SPLIT_ROWS`.) For a
logical expert e with c replicas and n of this rank's pairs in this forward:

  - u = min(c, max(1, n // SPLIT_ROWS)) replicas take them: with few rows (n < 2 * SPLIT_ROWS) all n go to
    ONE replica, so replication never reads an expert's weights twice for the rows of one rank;
  - the replicas in this rank's order of preference: the one on this rank first (its pairs need no
    all-to-all), otherwise one picked by rotation over the ranks that do not hold e (the j-th of them, in
    rank order, starts at replica (j + e) % c), so those ranks spread over the replicas evenly and each
    replica keeps the expected load of e / c that `balanced_placement` packs by; then the others in order;
  - the n pairs, in pair order, are cut into u contiguous chunks of equal size (to within one), chunk i to
    the i-th preferred replica.

The rule's parts live in `eplb/policy.py` (`SPLIT_ROWS`, `replica_preference`, `replicas_used`,
`chunk_rows`), which the `bench eplb` simulation uses too; `_choose_slots` below is its vectorised form
(per-layer slot table built once per placement, no Python per pair or per slot in a forward).

Replicas sit on distinct ranks (a `Placement` never holds an expert twice on one rank). The balancer adds
a replica only where its rows repay its weight read under this rule: `eplb.policy.plan_placement` takes, of
the placements where a c-th replica needs c x `SPLIT_ROWS` of the expert's rows in the window's median step
per rank or in all ranks, the one whose busiest rank costs less in rows plus weight reads (`step_cost`);
slots no replica earns copy the coldest experts, whose copies are rarely read at all.

GGUF blocks (`RoutedExperts.attach_quantized`): each slot gets its logical expert's blocks at load; a
re-placement moves them with the dense weights (a local copy keeps the slot's blocks, a slot filled from
another rank receives them as bytes over the same all_to_all), so a slot's blocks always mirror its dense
weights and a moved expert keeps its fast path.

Load statistics (for EPLB and /metrics) accumulate in `ExpertStats`: tokens routed to each logical expert by
this rank's batch, pairs computed here, the slot matmuls that computed them (each reads its slot's weights:
`weight_reads`), and the time spent computing them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.eplb.placement import Placement
from deepinfer.eplb.policy import SPLIT_ROWS, replica_preference
from deepinfer.layers.gguf_kernels import QuantizedWeight
from deepinfer.layers.moe import RoutedExperts

__all__ = ["SPLIT_ROWS", "ExpertComm", "ExpertParallelExperts", "ExpertStats", "PreparedPlacement"]


class ExpertComm:
    """The all-to-all exchanges of one process group (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world

    def exchange_counts(self, send_counts: torch.Tensor) -> list[int]:
        """send_counts [world] int64 (rows for each rank) -> rows each rank sends here."""
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts, group=self.group)
        return recv.tolist()

    def exchange(self, rows: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> torch.Tensor:
        """Rows grouped by destination rank -> rows received, grouped by source rank."""
        out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), list(recv_counts), list(send_counts), group=self.group)
        return out


@dataclass
class ExpertStats:
    """Counters one MoE layer accumulates between two reads by the balancer."""

    routed: torch.Tensor  # [num_logical] int64: pairs of this rank's tokens routed to each logical expert
    computed_pairs: int = 0  # pairs this rank's slots computed (its expert tokens)
    compute_seconds: float = 0.0
    weight_reads: int = 0  # slot matmul pairs run here (each reads one slot's weights)

    def take(self) -> tuple[torch.Tensor, int, float, int]:
        out = (self.routed.clone(), self.computed_pairs, self.compute_seconds, self.weight_reads)
        self.routed.zero_()
        self.computed_pairs, self.compute_seconds, self.weight_reads = 0, 0.0, 0
        return out


@dataclass
class PreparedPlacement:
    """A rank's slot contents under a new placement, built beside the ones in use (`prepare_placement`)."""

    w13: torch.Tensor
    w2: torch.Tensor
    blocks: list  # per local slot: its expert's GGUF blocks (w13, w2), or None (dense)
    received: int  # experts whose weights came from another rank


class ExpertParallelExperts(RoutedExperts):
    """This rank's physical slots of one MoE layer's experts; see the module docstring. `comm` None: one rank
    (EPLB replicas without expert parallelism)."""

    def __init__(self, base: RoutedExperts, placement: Placement, rank: int, comm: ExpertComm | None) -> None:
        if placement.num_experts != base.num_experts:
            raise ValueError(f"placement for {placement.num_experts} experts on a layer of {base.num_experts}")
        s = placement.slots_per_rank
        super().__init__(len(placement.physical_to_logical), base.hidden, base.intermediate,
                         local_experts=range(rank * s, (rank + 1) * s), swiglu_limit=base.swiglu_limit)
        self.to(device=base.w13.device, dtype=base.w13.dtype)
        self.num_logical = base.num_experts
        self.rank = rank
        self.comm = comm
        self.stats = ExpertStats(torch.zeros(self.num_logical, dtype=torch.long))
        self._set_placement(placement)

    def _set_placement(self, placement: Placement) -> None:
        self.placement = placement
        reps = [placement.replicas(e) for e in range(self.num_logical)]
        if any(not r for r in reps):
            raise ValueError("a placement must hold every expert at least once")
        prefs = [replica_preference(placement, self.rank, e) for e in range(self.num_logical)]
        width = max(len(r) for r in reps)
        table = torch.tensor([p + [p[0]] * (width - len(p)) for p in prefs], dtype=torch.long)
        self.replica_table = table.to(self.w13.device)  # [logical, max replicas] slots, this rank's preference
        self.replica_count = torch.tensor([len(r) for r in reps], dtype=torch.long, device=self.w13.device)

    @property
    def num_logical_experts(self) -> int:
        return self.num_logical

    @property
    def held_experts(self) -> tuple[int, ...]:
        """The logical experts this rank holds (the loaders check each was in the checkpoint)."""
        return tuple(sorted(set(self.placement.rank_experts(self.rank))))

    def expert_weight(self, expert: int, proj: str) -> torch.Tensor | None:
        """The first local slot holding logical `expert` (`fill_replicas` copies it to the others)."""
        if not 0 <= expert < self.num_logical:
            raise ValueError(f"expert {expert} out of range ({self.num_logical} experts)")
        slots = self._local_slots(expert)
        return super().expert_weight(slots[0], proj) if slots else None

    def slot_experts(self) -> list[int]:
        """The logical expert each local slot holds (GGUF blocks attach by it)."""
        return list(self.placement.rank_experts(self.rank))

    def _local_slots(self, expert: int) -> list[int]:
        s = self.placement.slots_per_rank
        return [self.rank * s + i for i, e in enumerate(self.placement.rank_experts(self.rank)) if e == expert]

    @torch.no_grad()
    def fill_replicas(self) -> None:
        """After loading: a logical expert held in several local slots gets its weights in all of them."""
        s = self.placement.slots_per_rank
        for expert in self.held_experts:
            first, *rest = (p - self.rank * s for p in self._local_slots(expert))
            for i in rest:
                self.w13[i].copy_(self.w13[first])
                self.w2[i].copy_(self.w2[first])

    # ------------------------------------------------------------------ compute

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        t, k = expert_ids.shape
        flat = expert_ids.reshape(-1)
        token = torch.arange(t, device=x.device).repeat_interleave(k)
        n = torch.bincount(flat, minlength=self.num_logical)  # this rank's pairs per logical expert
        if t:
            self.stats.routed += n.to(self.stats.routed.device)
        slot = self._choose_slots(flat, n)
        w = weights.reshape(-1)
        if self.comm is None:
            pair_out = self._compute_pairs(x[token], slot, w)
        else:
            dest = slot // self.placement.slots_per_rank
            order = torch.argsort(dest, stable=True)
            send = torch.bincount(dest, minlength=self.comm.world)
            recv = self.comm.exchange_counts(send)
            send = send.tolist()
            # one exchange carries each pair's row of x and its (slot, weight) as float32 bits reinterpreted in
            # x's dtype: exact, and one all_to_all per layer fewer than sending them apart
            meta = torch.stack([slot[order].to(torch.float32), w[order].to(torch.float32)], dim=1)
            rows = torch.cat([x[token[order]], meta.view(x.dtype)], dim=1)
            rows_in = self.comm.exchange(rows, send, recv)
            meta_in = rows_in[:, self.hidden:].contiguous().view(torch.float32)
            y = self._compute_pairs(rows_in[:, :self.hidden], meta_in[:, 0].long(), meta_in[:, 1].to(w.dtype))
            back = self.comm.exchange(y, recv, send)
            pair_out = torch.empty_like(back)
            pair_out[order] = back
        # combine: each token's terms in ascending logical expert id, from zeros (the single-process order)
        by_expert = torch.argsort(expert_ids, dim=1, stable=True)
        terms = pair_out.view(t, k, self.hidden).gather(1, by_expert[:, :, None].expand(t, k, self.hidden))
        out = torch.zeros_like(x)
        for j in range(k):
            out += terms[:, j]
        return out

    def _choose_slots(self, flat: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """The physical slot of each pair (logical expert `flat[i]`; `n` pairs per expert): expert e's pairs,
        in order, cut into u_e = min(replicas, max(1, n_e // SPLIT_ROWS)) equal contiguous chunks, chunk i to
        this rank's i-th preferred replica (see the module docstring)."""
        if not flat.numel():
            return flat.clone()
        order = torch.argsort(flat, stable=True)
        start = torch.cumsum(n, 0) - n  # first sorted position of each expert's pairs
        index = torch.empty_like(flat)
        index[order] = torch.arange(flat.numel(), device=flat.device) - start[flat[order]]  # i-th pair of its expert
        used = torch.minimum(self.replica_count, torch.clamp(n // SPLIT_ROWS, min=1))
        chunk = index * used[flat] // n[flat]
        return self.replica_table[flat, chunk]

    def _compute_pairs(self, x: torch.Tensor, slot: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """One output row per pair: pair i's expert(x[i]) * w[i] in x's dtype."""
        started = time.perf_counter()
        groups = self.group(slot[:, None], w[:, None])
        out = self.compute(x, groups)
        self.stats.compute_seconds += time.perf_counter() - started
        self.stats.computed_pairs += int(slot.shape[0])
        self.stats.weight_reads += sum(c > 0 for c in groups.counts)
        return out

    def idle(self) -> None:
        """Take part in one forward's exchanges with no tokens (a rank with nothing to run this step)."""
        x = self.w13.new_zeros((0, self.hidden))
        self.forward(x, torch.zeros((0, 1), dtype=torch.long, device=x.device), x.new_zeros((0, 1)))

    # ------------------------------------------------------------------ re-placement

    @torch.no_grad()
    def prepare_placement(self, new: Placement, comm: ExpertComm | None) -> PreparedPlacement:
        """This rank's slot weights under `new`, in new tensors: each slot whose expert this rank does not
        hold gets its weights from the lowest rank that holds it, by one all_to_all on `comm` (every rank
        calls this for the same layers in the same order); the others copy locally. GGUF blocks travel the
        same way (a second all_to_all of their bytes, when the layer has blocks: the same on every rank, as
        they come from one file's tensors), so a moved expert keeps its fast path. Reads the current weights
        only, so forwards may run meanwhile (the balancer runs it on a thread)."""
        old, r = self.placement, self.rank
        s = old.slots_per_rank
        if new.num_experts != old.num_experts or len(new.physical_to_logical) != len(old.physical_to_logical):
            raise ValueError("a new placement must keep the layer's experts and slot count")
        world = old.num_ranks
        held = [set(old.rank_experts(q)) for q in range(world)]
        source = {e: min(q for q in range(world) if e in held[q]) for e in range(old.num_experts)}
        # what each rank needs from whom, in slot order: the same lists on every rank
        wants = [[(p, new.physical_to_logical[p]) for p in range(q * s, (q + 1) * s)
                  if new.physical_to_logical[p] not in held[q]] for q in range(world)]
        old_local = {e: self._local_slots(e)[0] - r * s for e in held[r]}
        w13, w2 = torch.empty_like(self.w13), torch.empty_like(self.w2)
        blocks: list[tuple[QuantizedWeight, QuantizedWeight] | None] = [None] * s
        for i, e in enumerate(new.rank_experts(r)):
            if e in held[r]:
                w13[i].copy_(self.w13[old_local[e]])
                w2[i].copy_(self.w2[old_local[e]])
                blocks[i] = self.quantized[old_local[e]]  # same slot as the dense copy: never stale
        received = 0
        if comm is not None:
            width = self.w13[0].numel() + self.w2[0].numel()
            sends = [[e for _, e in wants[q] if source[e] == r] for q in range(world)]
            rows = [torch.cat([self.w13[old_local[e]].reshape(-1), self.w2[old_local[e]].reshape(-1)])
                    for q in range(world) for e in sends[q]]
            send_buf = torch.stack(rows) if rows else self.w13.new_zeros((0, width))
            recv_from = [[(p, e) for p, e in wants[r] if source[e] == q] for q in range(world)]
            send_counts, recv_counts = [len(x) for x in sends], [len(x) for x in recv_from]
            got = comm.exchange(send_buf, send_counts, recv_counts)
            n13 = self.w13[0].numel()
            arrivals = [pe for q in range(world) for pe in recv_from[q]]
            for row, (p, _) in zip(got, arrivals, strict=True):
                w13[p - r * s].copy_(row[:n13].view_as(self.w13[0]))
                w2[p - r * s].copy_(row[n13:].view_as(self.w2[0]))
                received += 1
            if self.block_kinds is not None:
                sent_blocks = [self.quantized[old_local[e]] for q in range(world) for e in sends[q]]
                for (p, _), pair in zip(arrivals, self._exchange_blocks(comm, sent_blocks, send_counts, recv_counts),
                                        strict=True):
                    blocks[p - r * s] = pair
        return PreparedPlacement(w13, w2, blocks, received)

    def _exchange_blocks(self, comm: ExpertComm, pairs: list[tuple[QuantizedWeight, QuantizedWeight] | None],
                         send_counts: list[int], recv_counts: list[int]
                         ) -> list[tuple[QuantizedWeight, QuantizedWeight] | None]:
        """Send each moved expert's (w13, w2) blocks as one byte row (a leading 0 byte: the source slot has
        none, the receiver multiplies the dense weights); returns the received pairs in arrival order."""
        (k13, k2), (n13, h13), (n2, h2) = self.block_kinds, self.w13.shape[1:], self.w2.shape[1:]
        b13, b2 = QuantizedWeight.nbytes(k13, n13, h13), QuantizedWeight.nbytes(k2, n2, h2)
        width = 1 + b13 + b2
        rows = [torch.cat([torch.ones(1, dtype=torch.uint8), a.to_bytes(), b.to_bytes()]) if (a, b) != (None, None)
                else torch.zeros(width, dtype=torch.uint8) for a, b in (pr or (None, None) for pr in pairs)]
        send = torch.stack(rows) if rows else torch.zeros((0, width), dtype=torch.uint8)
        got = comm.exchange(send, send_counts, recv_counts)
        return [(QuantizedWeight.from_bytes(k13, n13, h13, row[1:1 + b13]),
                 QuantizedWeight.from_bytes(k2, n2, h2, row[1 + b13:])) if row[0] else None for row in got]

    def switch_placement(self, new: Placement, prepared: PreparedPlacement) -> None:
        """Take `prepare_placement`'s weights and blocks (between two forwards, on every rank at the same
        step)."""
        self.w13.data = prepared.w13
        self.w2.data = prepared.w2
        self.quantized = list(prepared.blocks)
        self._set_placement(new)

    def apply_placement(self, new: Placement) -> int:
        """Prepare and switch at once (every rank calls it at the same point); returns experts received."""
        prepared = self.prepare_placement(new, self.comm)
        self.switch_placement(new, prepared)
        return prepared.received

    def extra_repr(self) -> str:
        return f"rank={self.rank}, slots={self.placement.rank_experts(self.rank)}, " + super().extra_repr()
