"""The expert load window: per-step, per-layer, per-expert token counts over the last `window_steps` steps,
which the rebalancer turns into a placement and `/metrics` into an imbalance.

A ring buffer of `window_steps` rows (int64 counts [layers, experts] per step) and their running sum:
`record` overwrites the oldest row, so a step older than the window drops out of `window_load` exactly.
Counts are whatever the caller records: a rank's own, or (expert parallelism) all ranks' after an
all-reduce, which is the caller's job; nothing here is distributed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.eplb.placement import Placement, rank_loads


class ExpertLoadWindow:
    """Sliding window of per-step expert token counts for `num_layers` MoE layers of `num_experts` experts."""

    def __init__(self, num_layers: int, num_experts: int, window_steps: int) -> None:
        if num_layers <= 0 or num_experts <= 0 or window_steps <= 0:
            raise ValueError(f"need num_layers, num_experts and window_steps > 0, got {num_layers}, "
                             f"{num_experts}, {window_steps}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.window_steps = window_steps
        self._rows = torch.zeros(window_steps, num_layers, num_experts, dtype=torch.int64)
        self._sum = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        self._next = 0  # row the next record overwrites
        self.steps_recorded = 0  # all steps ever recorded

    @property
    def steps_in_window(self) -> int:
        return min(self.steps_recorded, self.window_steps)

    def record(self, step_counts: torch.Tensor | Sequence) -> None:
        """Add one step: token counts [num_layers, num_experts] (or [num_experts] with one layer), >= 0."""
        counts = torch.as_tensor(step_counts).to(torch.int64)
        if counts.dim() == 1 and self.num_layers == 1:
            counts = counts[None]
        if tuple(counts.shape) != (self.num_layers, self.num_experts):
            raise ValueError(f"step counts of shape {tuple(counts.shape)}, expected "
                             f"({self.num_layers}, {self.num_experts})")
        if bool((counts < 0).any()):
            raise ValueError("token counts must be >= 0")
        self._sum += counts - self._rows[self._next]
        self._rows[self._next] = counts
        self._next = (self._next + 1) % self.window_steps
        self.steps_recorded += 1

    def window_load(self) -> torch.Tensor:
        """Tokens per expert over the window: int64 [num_layers, num_experts] (a copy)."""
        return self._sum.clone()

    def window_steps_rows(self) -> torch.Tensor:
        """The counts of each step in the window: int64 [steps_in_window, num_layers, num_experts] (a copy, in
        ring order, not time order)."""
        return self._rows[:self.steps_in_window].clone()

    def imbalance(self, placement: Placement, layer: int = 0) -> float:
        """max / mean of the ranks' expected loads under `placement` for `layer`'s window load (1.0: balanced,
        or nothing recorded)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range ({self.num_layers} layers)")
        if placement.num_experts != self.num_experts:
            raise ValueError(f"placement of {placement.num_experts} experts for a window of {self.num_experts}")
        return imbalance(rank_loads(placement, self._sum[layer].tolist()))

    def reset(self) -> None:
        self._rows.zero_()
        self._sum.zero_()
        self._next = 0
        self.steps_recorded = 0


def imbalance(loads: Sequence[float]) -> float:
    """max / mean of per-rank loads; 1.0 when all are zero."""
    total = float(sum(loads))
    return 1.0 if total <= 0 else max(loads) * len(loads) / total
