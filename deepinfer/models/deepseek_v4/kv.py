"""One step's DeepSeek-V4 KV metadata: which cache slots every new token writes and every query reads.

A V4 layer keeps three kinds of paged state (`kvcache/spec.py`): the sliding window's K=V
(`SlidingWindow`, every layer), the compressor rows of the tokens a compression group still needs
(`CompressorWindow`, CSA / HCA layers) and the compressed entries (`Compressed`, plus the indexer keys
for CSA). `build_step_meta` turns the runner's per-group `AttentionBatch`es (the same sequences, each
group's own block tables) into index tensors every layer of the step shares:

- where each new token's K=V and compressor rows go;
- the compression groups this step completes (entry w of ratio m completes at token (w + 1) * m - 1):
  the compressor-row slots each pools and the compressed slot it is written to;
- per attention segment (all single-token rows together, each longer chunk alone), padded: each query's window
  keys and compressed entries, with the causal masks the full forward uses (a query at p sees window
  keys p - window < k <= p and entries w < (p + 1) // m).

A replayed prefix hit (`kvcache/manager.py`: the compressed entries are held, the window and compressor
rows are not) comes with `replay_ends` and `key_floors`: its groups completing before the replay's end
are held entries, so they are not pooled again (their rows before the floor do not exist), and window
keys below the floor are never read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.kvcache.spec import Compressed, CompressorWindow, KVSpec, SlidingWindow
from deepinfer.layers.attention import AttentionBatch


@dataclass
class NewEntries:
    """Compression groups completed in this step, for one ratio (all sequences together)."""

    rows: torch.Tensor  # [N, span] compressor-row slots pooled by each entry (padding: slot 0)
    valid: torch.Tensor  # [N, span] bool: False for rows before position 0 (CSA's first entry)
    positions: torch.Tensor  # [N] the entry's rope position, w * ratio
    dest: torch.Tensor  # [N] its slot in the compressed cache


@dataclass
class CompressedKeys:
    keys: torch.Tensor  # [B, C] compressed-cache slot of each entry a segment's sequences may read
    mask: torch.Tensor  # [B, Q, C] bool: entry visible to the query (causal; padding False)


@dataclass
class Segment:
    """Sequences attended in one padded batch."""

    rows: torch.Tensor  # [B, Q] the step row of each query (padding: row 0)
    valid: torch.Tensor  # [B, Q] bool
    positions: torch.Tensor  # [B, Q] query positions
    window_keys: torch.Tensor  # [B, K] window-cache slots
    window_mask: torch.Tensor  # [B, Q, K] bool
    compressed: dict[int, CompressedKeys] = field(default_factory=dict)  # by ratio


@dataclass
class V4StepMeta:
    window_slots: torch.Tensor  # [T] window-cache slot of each new token
    row_slots: dict[int, torch.Tensor]  # ratio -> [T] compressor-row slot of each new token
    new_entries: dict[int, NewEntries]  # ratio -> groups completed this step
    segments: list[Segment]
    num_tokens: int


def _slots(table: list[int], positions: torch.Tensor, per_block: int) -> torch.Tensor:
    t = torch.tensor(table, dtype=torch.long) if table else torch.zeros(1, dtype=torch.long)
    return t[positions // per_block] * per_block + positions % per_block


def build_step_meta(specs: list[KVSpec], batches: list[AttentionBatch], device: torch.device) -> V4StepMeta:
    """The step's metadata from one `AttentionBatch` per KV group (`specs[i]` is group i's spec)."""
    base = batches[0]
    bs = base.block_size
    window_gi = next(i for i, s in enumerate(specs) if isinstance(s, SlidingWindow))
    window = specs[window_gi].window
    rows_gi = {s.ratio: i for i, s in enumerate(specs) if isinstance(s, CompressorWindow)}
    comp_gi = {s.ratio: i for i, s in enumerate(specs) if isinstance(s, Compressed)}
    overlap = {s.ratio: s.overlap for s in specs if isinstance(s, CompressorWindow)}
    starts = [c - q for q, c in zip(base.query_lens, base.context_lens, strict=True)]
    floors = base.key_floors or [0] * len(starts)
    replay_ends = base.replay_ends or [0] * len(starts)
    new_positions = [torch.arange(s, c) for s, c in zip(starts, base.context_lens, strict=True)]

    def token_slots(gi: int) -> torch.Tensor:
        tables = batches[gi].block_tables
        parts = [_slots(t, p, bs) for t, p in zip(tables, new_positions, strict=True)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    window_slots = token_slots(window_gi)
    row_slots = {m: token_slots(gi) for m, gi in rows_gi.items()}
    new_entries = {}
    for m, gi in comp_gi.items():
        epb = specs[gi].entries_per_block(bs)
        span = 2 * m if overlap[m] else m
        rows, valid, pos, dest = [], [], [], []
        for i, (s, c) in enumerate(zip(starts, base.context_lens, strict=True)):
            ws = torch.arange(min(max(s, replay_ends[i]), c) // m, c // m)  # held entries are not written again
            if not len(ws):
                continue
            tok = (ws[:, None] + 1) * m - span + torch.arange(span)[None, :]  # [n, span] pooled tokens
            ok = tok >= 0
            rows.append(_slots(batches[rows_gi[m]].block_tables[i], tok.clamp(min=0), bs) * ok)
            valid.append(ok)
            pos.append(ws * m)
            dest.append(_slots(batches[gi].block_tables[i], ws, epb))
        if rows:
            new_entries[m] = NewEntries(torch.cat(rows).to(device), torch.cat(valid).to(device),
                                        torch.cat(pos).to(device), torch.cat(dest).to(device))
    # segments: all single-token rows together (wherever they sit in the batch), each longer chunk alone
    singles = [i for i, q in enumerate(base.query_lens) if q == 1]
    groups = ([singles] if singles else []) + [[i] for i, q in enumerate(base.query_lens) if q > 1]
    offsets = [0]
    for q in base.query_lens:
        offsets.append(offsets[-1] + q)
    segments = []
    for seqs in groups:
        qmax = max(base.query_lens[i] for i in seqs)
        lo = [max(0, starts[i] - window + 1, floors[i]) for i in seqs]
        kmax = max(base.context_lens[i] - lo_i for i, lo_i in zip(seqs, lo, strict=True))
        b = len(seqs)
        rows = torch.zeros(b, qmax, dtype=torch.long)
        valid = torch.zeros(b, qmax, dtype=torch.bool)
        qpos = torch.zeros(b, qmax, dtype=torch.long)
        wkeys = torch.zeros(b, kmax, dtype=torch.long)
        wmask = torch.zeros(b, qmax, kmax, dtype=torch.bool)
        comp = {}
        for j, i in enumerate(seqs):
            q, c = base.query_lens[i], base.context_lens[i]
            rows[j, :q] = torch.arange(offsets[i], offsets[i] + q)
            valid[j, :q] = True
            qpos[j, :q] = new_positions[i]
            kp = torch.arange(lo[j], c)
            wkeys[j, :len(kp)] = _slots(batches[window_gi].block_tables[i], kp, bs)
            p = new_positions[i][:, None]
            wmask[j, :q, :len(kp)] = (kp[None, :] <= p) & (kp[None, :] > p - window)
        for m, gi in comp_gi.items():
            epb = specs[gi].entries_per_block(bs)
            cmax = max(base.context_lens[i] // m for i in seqs)
            ckeys = torch.zeros(b, cmax, dtype=torch.long)
            cmask = torch.zeros(b, qmax, cmax, dtype=torch.bool)
            for j, i in enumerate(seqs):
                n = base.context_lens[i] // m
                if n:
                    e = torch.arange(n)
                    ckeys[j, :n] = _slots(batches[gi].block_tables[i], e, epb)
                    q = base.query_lens[i]
                    cmask[j, :q, :n] = e[None, :] < ((new_positions[i] + 1) // m)[:, None]
            comp[m] = CompressedKeys(ckeys.to(device), cmask.to(device))
        segments.append(Segment(rows.to(device), valid.to(device), qpos.to(device), wkeys.to(device),
                                wmask.to(device), comp))
    return V4StepMeta(window_slots.to(device), {m: s.to(device) for m, s in row_slots.items()}, new_entries,
                      segments, offsets[-1])
