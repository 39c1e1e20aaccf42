"""Expert-parallel load balancing: where each MoE layer's experts (and replicas of the hot ones) live.

- `placement.py`: the `Placement` of one layer's logical experts on physical slots of ranks, the initial
  (contiguous) placement, the balanced one computed from a window of expert loads, and a helper that keeps
  experts in their slots across a switch (less weight movement);
- `policy.py`: how replicas are used, as pure functions the engine and the simulation share: the rank-side
  replica choice (`SPLIT_ROWS`, each rank's order of preference, the rows each replica takes) and the
  balancer's re-placement rule (`plan_placement`);
- `stats.py`: the sliding window of per-step, per-expert token counts the rebalancer reads;
- `balancer.py`: the engine-side balancer of expert parallelism (counts all-reduced across ranks, a new
  placement per MoE layer every interval, switched between steps on all ranks; imbalance and replica map
  for /metrics).

`placement.py`, `policy.py` and `stats.py` are pure Python / torch, no distributed code (the runtime all-reduces counts before recording them).
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
