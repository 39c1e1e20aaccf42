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

- `CompressorWindow(ratio, overlap)`: DeepSeek-V4's compressor rows (each token's projections that
  a compression group pools) of the tokens a group still to complete needs: the last `ratio`
  tokens (`overlap`: 2 * ratio, a CSA entry also pools the previous group's rows). It keeps blocks
  like a sliding window of that width, so the partial group's state is paged, bounded per
  request, and restored on a prefix hit by the same rule as a window's K/V.
- `Compressed(ratio)`: one entry per `ratio` tokens (V4's compressed KV, plus the indexer keys for
  CSA), kept for the whole sequence. A block holds `entries_per_block` = max(1, block_size // ratio)
  entries, so it covers max(block_size, ratio) tokens: exactly one token block when ratio <=
  block_size, `ratio // block_size` token blocks otherwise. A block is complete (and cacheable) once
  the last token it covers is computed, and is named by the chained hash of that last token block;
  a prefix hit at a token-block boundary therefore only ever needs complete compressed blocks.

Block i of every token-aligned group (all but `Compressed`) covers the same token positions and is
named by the same chained hash (`hashing.py`); only which blocks a group keeps differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class _TokenAligned:
    """A spec whose block i holds token positions i * block_size .. (i + 1) * block_size - 1."""

    def num_blocks(self, num_tokens: int, block_size: int) -> int:
        """Blocks (table length) holding `num_tokens` tokens' state."""
        return -(-num_tokens // block_size)

    def tokens_per_block(self, block_size: int) -> int:
        return block_size


class _Windowed(_TokenAligned):
    """Token-aligned state read only for the last `window` positions."""

    window: int

    def first_needed_block(self, start: int, block_size: int) -> int:
        """The first block a step whose earliest query sits at position `start` reads: the one holding
        key position start - window + 1. Blocks before it are out of every later query's window too."""
        return max(0, start - self.window + 1) // block_size


@dataclass(frozen=True)
class FullAttention(_TokenAligned):
    """Causal attention over the whole sequence."""

    def first_needed_block(self, start: int, block_size: int) -> int:
        """The first block a step computing positions `start` .. reads: always block 0."""
        return 0


@dataclass(frozen=True)
class SlidingWindow(_Windowed):
    """Causal attention over the last `window` positions, the query's own included (HF's semantics:
    query q sees key k iff q - window < k <= q)."""

    window: int

    def __post_init__(self) -> None:
        if self.window <= 0:
            raise ValueError(f"a sliding window must be positive, got {self.window}")


@dataclass(frozen=True)
class CompressorWindow(_Windowed):
    """The compressor rows of the last `ratio` tokens (2 * ratio with `overlap`), kept like a window:
    a compression group completing at or after position `start` reads rows from
    floor(start / ratio) * ratio - (ratio if overlap) >= start - window + 1 on."""

    ratio: int
    overlap: bool = False

    def __post_init__(self) -> None:
        if self.ratio <= 0:
            raise ValueError(f"a compression ratio must be positive, got {self.ratio}")

    @property
    def window(self) -> int:  # type: ignore[override]
        return self.ratio * (2 if self.overlap else 1)


@dataclass(frozen=True)
class Compressed:
    """One entry per `ratio` tokens for the whole sequence (see the module docstring for the layout)."""

    ratio: int

    def __post_init__(self) -> None:
        if self.ratio <= 0:
            raise ValueError(f"a compression ratio must be positive, got {self.ratio}")

    def check(self, block_size: int) -> None:
        if block_size % self.ratio and self.ratio % block_size:
            raise ValueError(f"compression ratio {self.ratio} and block size {block_size}: one must divide the other")

    def entries_per_block(self, block_size: int) -> int:
        return max(1, block_size // self.ratio)

    def tokens_per_block(self, block_size: int) -> int:
        return max(block_size, self.ratio)

    def first_needed_block(self, start: int, block_size: int) -> int:
        return 0

    def num_blocks(self, num_tokens: int, block_size: int) -> int:
        """Blocks holding the entries of the groups complete within `num_tokens` tokens (the last one
        possibly partly filled)."""
        per = self.entries_per_block(block_size)
        return -(-(num_tokens // self.ratio) // per)


KVSpec = FullAttention | SlidingWindow | CompressorWindow | Compressed


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
