"""The engine-side expert load balancer: counts expert load per step, re-places experts every interval.

Per step (a step counts when any rank ran a forward) each MoE layer's counters are read: tokens of this
rank's batch routed to each logical expert, pairs this rank's slots computed, and their compute time. They
enter a sliding window of `eplb_window_steps` steps. Every `eplb_step_interval` steps, on every rank at the
same step:

  1. the window's per-expert counts are all-reduced (int64: every rank gets the same numbers), and so are
     the per-rank expert tokens of the interval just ended (imbalance = max / mean, for /metrics);
  2. with `enable_eplb`, each layer gets `eplb.policy.plan_placement` (`balanced_placement(load, ranks,
     num_redundant, ...)`: a deterministic function of the same numbers, so every rank computes the same
     placement without sending it; `bench eplb` simulates with the same function). It builds two
     candidates that differ in when an expert earns its c-th replica, from its rows in the window's median
     step: each rank's rows (all ranks' / ranks) reach c x `SPLIT_ROWS` (where a rank would cut its own
     rows into c chunks that each repay a weight read: right at EP = 2, where packing alone balances), or
     all ranks' rows do (each of c replicas gets ~1/c of them: right at 64-128 ranks, where a hot expert has
     a few rows per rank); it takes the one whose busiest rank costs less in the median step, counting
     rows plus a weight read (`SPLIT_ROWS` rows' worth) per slot that gets rows (`eplb.policy.step_cost`).
     The median, not the mean: a prefill step's thousands of rows would otherwise make replicas that every
     decode step pays for;
  3. a layer whose new placement lowers its busiest rank's expected load (window load) by at least
     `MIN_GAIN` (`eplb/policy.py`) is re-placed (otherwise sampling noise would move weights every
     interval for nothing);
  4. re-placing (`ExpertParallelExperts.apply_placement`): the weights of experts a rank newly holds (and
     their GGUF blocks, when the model has them) come from the rank that holds them, by all_to_all over
     the process group. Not from the checkpoint: the checkpoint may be a GGUF or a safetensors directory
     on a slow mount, and a rank holds 1/N of the experts in memory, never the whole file; the peer
     already has the tensor in the dtype and layout used.
     All ranks decide the same, from the same all-reduced numbers.

The move runs on a thread while serving continues (ranks > 1: its all_to_all goes over a second process
group, `move_comm`, so it never interleaves with the MoE exchanges of the step loop); the new weights land
in new tensors, the old ones stay in use. The switch happens between two steps on all ranks together: the
step protocol's last all_reduce of each step carries "my move is done", and when every rank's is, every
rank swaps in the same step (`switch`). No step mixes two placements. One rank: moved and switched at once.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
import torch.distributed as dist

from deepinfer.config import ParallelConfig
from deepinfer.eplb.policy import plan_placement
from deepinfer.eplb.stats import ExpertLoadWindow
from deepinfer.layers.ep_moe import ExpertComm, ExpertParallelExperts, PreparedPlacement

logger = logging.getLogger(__name__)


class ExpertBalancer:
    def __init__(self, config: ParallelConfig, layers: list[ExpertParallelExperts], rank: int, world: int,
                 group: dist.ProcessGroup | None, move_comm: ExpertComm | None = None) -> None:
        """`group`: the all-reduces of counts (step loop's thread); `move_comm`: the weight moves (their
        thread)."""
        self.config = config
        self.move_comm = move_comm
        self.pending: list[tuple[ExpertParallelExperts, object]] | None = None  # (layer, new placement)
        self._moved: list[PreparedPlacement] = []
        self._move_done = threading.Event()
        self._move_error: BaseException | None = None
        self._move_started = 0.0
        self.layers = layers
        self.rank, self.world, self.group = rank, world, group
        self.steps = 0
        self.window = (ExpertLoadWindow(len(layers), layers[0].num_logical, config.eplb_window_steps)
                       if layers else None)  # this rank's routed pairs per layer and expert
        self.interval_pairs = 0  # pairs this rank computed since the last interval
        self.total_pairs = 0
        self.total_compute_seconds = 0.0
        self.total_weight_reads = 0  # slot matmuls this rank ran (each reads one slot's weights)
        self.rebalances = 0
        self.last_rebalance_time = 0.0  # wall clock (time.time()) of the last switch, 0 = never
        self.last_rebalance_seconds = 0.0
        self.imbalance = 1.0  # max / mean of per-rank expert tokens over the last interval
        self.imbalance_first: float | None = None  # over the first interval (the initial placement)
        self.rank_pairs: list[int] = [0] * world  # per-rank expert tokens over the last interval

    def end_step(self) -> None:
        """Called once per step on every rank (after the step's forwards)."""
        routed = []
        for layer in self.layers:
            counts, pairs, seconds, reads = layer.stats.take()
            routed.append(counts)
            self.total_weight_reads += reads
            self.interval_pairs += pairs
            self.total_pairs += pairs
            self.total_compute_seconds += seconds
        if self.window is not None:
            self.window.record(torch.stack(routed))
        self.steps += 1
        if self.steps % self.config.eplb_step_interval == 0:
            self._interval()

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def _interval(self) -> None:
        per_rank = torch.zeros(self.world, dtype=torch.long)
        per_rank[self.rank] = self.interval_pairs
        self.rank_pairs = self._all_reduce(per_rank).tolist()
        self.interval_pairs = 0
        mean = sum(self.rank_pairs) / self.world
        self.imbalance = max(self.rank_pairs) / mean if mean else 1.0
        if self.imbalance_first is None:
            self.imbalance_first = self.imbalance
        if not self.config.enable_eplb or not self.layers or self.pending is not None:
            return
        steps = self._all_reduce(self.window.window_steps_rows())  # [steps, layers, experts], all ranks' pairs
        load = steps.sum(dim=0)  # the window's load: one all-reduce serves both
        typical = steps.median(dim=0).values.tolist()  # all ranks' rows of each expert in the median step
        changes = []
        for layer, row, rows in zip(self.layers, load.tolist(), typical, strict=True):
            new = plan_placement(row, rows, self.world, self.config.num_redundant_experts, layer.placement)
            if new is not None:
                changes.append((layer, new))
        if not changes:
            return
        self.pending = changes
        self._move_started = time.perf_counter()
        self._move_done.clear()
        if self.world == 1:
            self._move()
            self.switch()
        else:
            threading.Thread(target=self._move, name="deepinfer-eplb-move", daemon=True).start()

    def _move(self) -> None:
        try:
            self._moved = [layer.prepare_placement(new, self.move_comm) for layer, new in self.pending]
        except BaseException as e:  # noqa: BLE001 - raised on the step loop's thread by `switch`
            self._move_error = e
        finally:
            self._move_done.set()

    @property
    def move_ready(self) -> bool:
        """A re-placement is pending and this rank's weights for it are in place."""
        return self.pending is not None and self._move_done.is_set()

    def switch(self) -> None:
        """Take the moved weights (every rank at the same step; see the module docstring)."""
        if self._move_error is not None:
            raise RuntimeError("moving expert weights between ranks failed") from self._move_error
        for (layer, new), prepared in zip(self.pending, self._moved, strict=True):
            layer.switch_placement(new, prepared)
        self.pending, self._moved = None, []
        self.rebalances += 1
        self.last_rebalance_time = time.time()
        self.last_rebalance_seconds = time.perf_counter() - self._move_started

    def stats(self) -> dict:
        """What /metrics shows; per-rank values are this rank's, the rest agree on every rank."""
        return {"rank": self.rank, "expert_tokens_total": self.total_pairs,
                "expert_compute_seconds_total": self.total_compute_seconds, "steps": self.steps,
                "expert_weight_reads_total": self.total_weight_reads,
                "imbalance": self.imbalance, "imbalance_first": self.imbalance_first,
                "rank_expert_tokens_interval": list(self.rank_pairs), "rebalances": self.rebalances,
                "last_rebalance_time": self.last_rebalance_time,
                "last_rebalance_seconds": self.last_rebalance_seconds,
                "replicas": [layer.placement.replica_counts() for layer in self.layers],
                "placement": [list(layer.placement.physical_to_logical) for layer in self.layers],
                "window_routed": self.window.window_load().tolist() if self.window is not None else [],
                # GGUF: slots multiplying their expert's quantized blocks, and expert matmul pairs they served
                "quantized_slots": sum(layer.num_quantized for layer in self.layers),
                "quantized_expert_calls": sum(layer.quantized_calls for layer in self.layers)}
