"""What KV state each layer keeps: the KV spec of every layer group a model declares.

A model's layers fall into groups that keep the same kind of KV state; the KV cache manager
allocates, frees, hashes and caches each group by its spec, so adding a layer kind means adding
a spec here and its rules in `manager.py`, not touching the scheduler or the runner.

- `FullAttention`: every token's K/V is kept for the whole sequence (one block per
  `block_size` tokens, for every token so far).
- `SlidingWindow(window)`: a token attends to the last `window` positions (itself included),
  so blocks that fall wholly out of the window of the next token to compute are freed while the
  sequence runs, and a prefix-cache hit of length L needs only the blocks covering positions
  L - window + 1 .. L - 1 (plus the full groups' blocks).

Every group's block i covers the same token positions and is named by the same chained hash
(`hashing.py`); only which blocks a group keeps differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FullAttention:
    """Causal attention over the whole sequence."""

    def first_needed_block(self, start: int, block_size: int) -> int:
        """The first block a step computing positions `start` .. reads: always block 0."""
        return 0


@dataclass(frozen=True)
class SlidingWindow:
    """Causal attention over the last `window` positions, the query's own included (HF's semantics:
    query q sees key k iff q - window < k <= q)."""

    window: int

    def __post_init__(self) -> None:
        if self.window <= 0:
            raise ValueError(f"a sliding window must be positive, got {self.window}")

    def first_needed_block(self, start: int, block_size: int) -> int:
        """The first block a step whose earliest query sits at position `start` reads: the one holding
        key position start - window + 1. Blocks before it are out of every later query's window too."""
        return max(0, start - self.window + 1) // block_size


KVSpec = FullAttention | SlidingWindow


@dataclass(frozen=True)
class KVGroup:
    """Layers (by index) that keep the same kind of KV state."""

    layers: tuple[int, ...]
    spec: KVSpec


def group_layers(layer_specs: Sequence[KVSpec]) -> list[KVGroup]:
    """One group per distinct spec, full attention first (the manager's group 0 then keeps every block, as
    its pool and tables stand for the model's: usage, tiers, export), the rest in order of first appearance
    (Gemma 3's first layer is a sliding one); a model of one kind is one group."""
    order: dict[KVSpec, list[int]] = {}
    for i, spec in enumerate(layer_specs):
        order.setdefault(spec, []).append(i)
    groups = [KVGroup(tuple(layers), spec) for spec, layers in order.items()]
    return sorted(groups, key=lambda g: not isinstance(g.spec, FullAttention))  # stable: the rest keep their order
