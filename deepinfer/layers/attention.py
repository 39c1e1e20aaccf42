"""Attention backend interface and the per-step batch description it consumes.

Lifecycle of one step: the runner describes the batch (`AttentionBatch`: for
each sequence its new-token count, its total context length and its block
table), the backend turns that into its own metadata once (`prepare`), and
every layer then calls `forward` with that metadata. K/V live in a paged pool
(`[num_blocks, block_size, kv_heads, head_dim]` per layer); no sequence owns a
contiguous cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionBatch:
    """One step's sequences, in batch order; single-token sequences (decodes) come first.

    query_lens[i] new tokens of sequence i occupy a contiguous range of the flattened
    batch; they sit at positions [context_lens[i] - query_lens[i], context_lens[i]).
    """

    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    num_decodes: int  # the first num_decodes sequences have query_len == 1
    slot_mapping: torch.Tensor  # [num_tokens] flat slot (block * block_size + offset) of each new token
    block_size: int
    # sliding-window layers: a query at position p sees keys p - window < k <= p only, and table entries
    # of blocks wholly before its window may be invalid (negative); None: full causal attention
    window: int | None = None
    # sliding-window layers: per sequence, the first key position that has KV (a replayed prefix hit's
    # start, kvcache/manager.py); keys before it are masked and their table entries never read. None: 0
    key_floors: list[int] | None = None
    # models with their own KV state (DeepSeek-V4): per sequence, the end of a replayed prefix hit; state
    # kept for the whole sequence that positions before it complete is held, and not written again
    replay_ends: list[int] | None = None
    # positions past its context that each sequence's block table must still cover: the runner decodes
    # `lookahead` more tokens per row in the same call (`num_scheduler_steps`; the C rows path only)
    lookahead: int = 0
    # per new token, flattened in batch order: the last key position it attends to (its own position, or
    # later for a token of a run that attends to itself both ways: Gemma 3's image placeholders, whose run
    # the step holds to its end); None: every token its own position
    horizons: list[int] | None = None


class AttentionBackend(ABC):
    """Computes causal attention of a step's new tokens over their paged context.

    Contract:
    - `allocate_cache` returns one cache object per layer, zero-initialised (masked-out
      slots are multiplied by zero probabilities, so they must hold finite values).
    - `prepare` is called once per step with the step's `AttentionBatch`; it may build
      index tensors; it must not read or write the cache.
    - `forward(q, k, v, cache, meta)` first stores the new k/v at `slot_mapping`, then
      returns attention output for q: token t of sequence i attends to context positions
      0..(its own position), exactly like dense causal attention over that sequence; with a
      `window`, only to the last `window` of them (its own included), never reading a block
      wholly before that. With `horizons`, to positions up to its horizon instead of its own
      (the window still counted back from its own position).
    """

    @abstractmethod
    def allocate_cache(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, device: torch.device) -> list[Any]: ...

    @abstractmethod
    def prepare(self, batch: AttentionBatch) -> Any: ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: Any, meta: Any,
                scale: float | None = None) -> torch.Tensor:
        """q: [T, heads, D]; k, v: [T, kv_heads, D]; returns [T, heads, D]. `scale` multiplies q.k
        (default D ** -0.5; Gemma's is query_pre_attn_scalar ** -0.5)."""
