"""Expert parallelism inside one engine rank: the process group, the model's MoE layers swapped for their
expert-parallel form, and the step protocol that keeps every rank's collectives in step.

Lifecycle (one per engine; `LLMEngine` makes it when `ParallelConfig.expert_parallel`):

    ExpertParallel(config, rank)      joins the process group (gloo on CPU, NCCL on CUDA; a timeout on
                                      every collective, so a dead peer ends a rank instead of hanging it)
    .attach(model)                    before loading: each RoutedExperts -> ExpertParallelExperts holding
                                      this rank's slots of `initial_placement` (the loaders then copy only
                                      those experts from the checkpoint)
    .after_load()                     replicas within a rank get their weights
    per step: model forwards ...      a pre-hook on the first MoE layer announces each forward (see below)
              .finish_tick()          idle ranks join the others' forwards; all switch to EPLB's moved
                                      weights when every rank has them; then EPLB's `end_step`

Step protocol (ranks > 1). Attention is data-parallel, so ranks run different requests and may run a
different number of forwards in a step (none, one, or several). Every forward, on reaching its first MoE
layer, all_reduces 1 ("I run a forward"); a rank done with its step all_reduces 0 in a loop: a non-zero sum
means someone is in a forward, so it runs an idle one (each MoE layer's exchanges with no tokens) to match;
a zero sum means every rank is done, and the step ends on all ranks at once. Every rank sees the same sequence of sums, so
all agree on whether the step ran anything (the balancer's step count) and reach `end_step` together.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from deepinfer.config import ParallelConfig
from deepinfer.eplb.balancer import ExpertBalancer
from deepinfer.eplb.placement import initial_placement
from deepinfer.layers.ep_moe import ExpertComm, ExpertParallelExperts
from deepinfer.layers.moe import RoutedExperts

logger = logging.getLogger(__name__)

# a collective waits at most this long for its peers: a rank that died (or hangs) ends the others
COLLECTIVE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RankInfo:
    """Where a rank sits in the process group (set by the front end that starts the ranks)."""

    rank: int
    world: int
    master_port: int
    master_addr: str = "127.0.0.1"


class ExpertParallel:
    def __init__(self, config: ParallelConfig, rank: RankInfo | None, device: torch.device) -> None:
        world = rank.world if rank is not None else 1
        if world != config.expert_parallel_size:
            raise ValueError(f"expert_parallel_size={config.expert_parallel_size} needs that many engine ranks "
                             f"(started by the expert-parallel front end), got {world}")
        self.config = config
        self.rank = rank.rank if rank is not None else 0
        self.world = world
        self.device = device
        self.group = None
        self.move_group = None
        if world > 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            if device.type == "cuda":
                torch.cuda.set_device(device.index if device.index is not None else self.rank)
            dist.init_process_group(backend, init_method=f"tcp://{rank.master_addr}:{rank.master_port}",
                                    rank=self.rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
            self.group = dist.group.WORLD
            # EPLB moves weights on a thread of its own, over a group of its own (see eplb/balancer.py)
            self.move_group = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        self.comm = ExpertComm(self.group, self.rank, world) if world > 1 else None
        self.move_comm = ExpertComm(self.move_group, self.rank, world) if world > 1 else None
        self.layers: list[ExpertParallelExperts] = []
        self.balancer: ExpertBalancer | None = None
        self._forwards = 0  # forwards (any rank's, ranks > 1) in the current step
        self.last_tick_ran = False  # the last finished step ran a forward on some rank

    # ------------------------------------------------------------------ model

    def attach(self, model: nn.Module) -> None:
        """Swap every RoutedExperts of `model` (in forward order) for this rank's expert-parallel slots."""
        targets = [(name, m) for name, m in model.named_modules() if isinstance(m, RoutedExperts)]
        if not targets:
            raise ValueError(f"expert parallelism / EPLB need a mixture-of-experts model; "
                             f"{type(model).__name__} has no routed experts")
        r = self.config.num_redundant_experts
        for name, base in targets:
            parent_name, _, attr = name.rpartition(".")
            layer = ExpertParallelExperts(base, initial_placement(base.num_experts, self.world, r), self.rank,
                                          self.comm)
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, layer)
            self.layers.append(layer)
        # the step's sync runs when a forward reaches its first MoE layer, not on model.__call__: the runner
        # calls model.hidden_states / compute_logits, which module hooks on the model never see
        self.layers[0].register_forward_pre_hook(self._on_forward)
        self.balancer = ExpertBalancer(self.config, self.layers, self.rank, self.world, self.group, self.move_comm)
        logger.info("expert parallel rank %d/%d: %d MoE layers, %d slots each (%d experts, %d redundant)",
                    self.rank, self.world, len(self.layers), self.layers[0].placement.slots_per_rank,
                    self.layers[0].num_logical, r)

    def after_load(self) -> None:
        for layer in self.layers:
            layer.fill_replicas()

    def reset(self) -> None:
        """Forget what start-up forwards (the cost-model profile) counted."""
        self._forwards = 0
        for layer in self.layers:
            layer.stats.take()

    # ------------------------------------------------------------------ step protocol

    def _sync(self, flag: int, stopping: bool = False, moved: bool = False) -> tuple[int, int, int]:
        """All-reduce (forward, stopping, EPLB move done) flags: how many ranks are entering a forward, were
        asked to stop, have their moved expert weights ready."""
        t = torch.tensor([flag, int(stopping), int(moved)], dtype=torch.long, device=self.device)
        dist.all_reduce(t, group=self.group)
        n, stops, moves = t.tolist()
        self._forwards += n > 0
        return n, stops, moves

    def _on_forward(self, module: nn.Module, args: tuple) -> None:
        if self.world > 1:
            self._sync(1)
        else:
            self._forwards += 1

    def finish_tick(self, stopping: bool = False) -> bool:
        """End this rank's part of a step (every rank calls it once per loop turn). `stopping`: this rank
        was asked to shut down; True once every rank was, at the same turn on all of them (so none leaves
        while a peer still waits in a collective)."""
        stops = int(stopping)
        if self.world > 1:
            with torch.inference_mode():
                while True:
                    n, stops, moves = self._sync(0, stopping, self.balancer is not None and self.balancer.move_ready)
                    if not n:
                        break
                    for layer in self.layers:
                        layer.idle()
            if moves == self.world:  # every rank's moved weights are in place: all switch at this step
                self.balancer.switch()
        ran = self._forwards > 0
        self.last_tick_ran = ran
        self._forwards = 0
        if ran and self.balancer is not None:
            self.balancer.end_step()
        return stops == self.world

    def stats(self) -> dict:
        return self.balancer.stats() if self.balancer is not None else {}

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
