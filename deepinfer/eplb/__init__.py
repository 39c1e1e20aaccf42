"""Expert-parallel load balancing: where each MoE layer's experts (and replicas of the hot ones) live.

- `placement.py`: the `Placement` of one layer's logical experts on physical slots of ranks, the initial
  (contiguous) placement, the balanced one computed from a window of expert loads, and a helper that keeps
  experts in their slots across a switch (less weight movement);
- `stats.py`: the sliding window of per-step, per-expert token counts the rebalancer reads.

Pure Python / torch: no distributed code here (the runtime all-reduces counts before recording them).
The at-scale simulation that replays routing through these is `deepinfer/bench/eplb.py`.
"""

from deepinfer.eplb.placement import (
    Placement,
    balanced_placement,
    initial_placement,
    keep_slots,
    moved_slots,
    rank_loads,
)
from deepinfer.eplb.stats import ExpertLoadWindow

__all__ = ["ExpertLoadWindow", "Placement", "balanced_placement", "initial_placement", "keep_slots",
           "moved_slots", "rank_loads"]
