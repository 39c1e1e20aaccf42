"""Adapters applied to a model's projections, several in one step.

`LoRALayers` owns, for each projection any loaded adapter adapts, a `LoRASite` (set as `Linear.lora`); each
site holds every loaded adapter's matrices for that projection by slot. A step says which slot each of its rows
runs with (`LoRALayers.step`, entered by the runner around the forward; -1: the base model); a projection then
adds `(B (A x)) * scaling` of each row's adapter to that row's output.

One step's adapters are applied together, in a fixed number of torch operations whatever their count (a loop over
adapters cost 8 of 21 s of a 64-request run over four adapters here, all of it dispatch): the A's of the step's
slots stacked into one matrix [columns, in] and their B's side by side [out, columns], so `t = x A^T` has every
slot's columns for every row; a 0/1 mask keeps each row's own slot's columns (exact zeros elsewhere; a step with
one adapter needs none: rows without it have scale 0), `d = t B^T`, and `y += d * scale[row]`. A fused projection (Q/K/V, gate/up) stacks its shards' A's, and its B is block
diagonal over the shards (zero where a shard's rank does not reach another shard's features). The stacks are built
per set of slots and kept for the next steps with the same set. Against peft's `(B_shard (A_shard x)) * scaling`
per shard the products are the same; the sums run over more (zero) terms, which can move the last bit.

Steps with adapter rows skip the whole-layer C path (it reads the base weights only) and the fused gate/up + SiLU
tiles: the model and `Linear.silu_mul_into` ask `LoRALayers.active`. The batched decode path (C calls between the
projections' `forward`s) serves them.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from deepinfer.lora.adapter import AdapterWeights

MAX_STACKS = 4  # sets of slots whose stacked matrices a site keeps


@dataclass
class _SlotWeights:
    a: torch.Tensor  # [the shards' ranks summed, in]
    b: torch.Tensor  # [out, the shards' ranks summed]: each shard's B in its features' rows and its rank's columns
    scaling: float


class LoRASite:
    """One projection's adapters, by slot."""

    def __init__(self, owner: LoRALayers) -> None:
        self.owner = owner
        self.slots: dict[int, _SlotWeights] = {}
        # slots -> (A stacked, transposed [in, columns], B side by side, transposed [columns, out], each column's
        # slot [columns], and the column layout: each slot's column count, which names the step's mask for it)
        self._stacks: OrderedDict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]] = \
            OrderedDict()

    def set_slot(self, slot: int, weights: _SlotWeights | None) -> None:
        if weights is None:
            self.slots.pop(slot, None)
        else:
            self.slots[slot] = weights
        self._stacks.clear()

    def _stack(self, slots: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
        stack = self._stacks.get(slots)
        if stack is None:
            ws = [self.slots[s] for s in slots]
            cols = torch.cat([torch.full((w.a.shape[0],), s, dtype=torch.long) for s, w in zip(slots, ws, strict=True)])
            layout = tuple((s, w.a.shape[0]) for s, w in zip(slots, ws, strict=True))
            stack = self._stacks[slots] = (torch.cat([w.a for w in ws]).t().contiguous(),
                                           torch.cat([w.b for w in ws], dim=1).t().contiguous(),
                                           cols.to(ws[0].a.device), layout)
            if len(self._stacks) > MAX_STACKS:
                self._stacks.popitem(last=False)
        else:
            self._stacks.move_to_end(slots)
        return stack

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the projection's output for x, the step's rows) with each row's adapter added, in place."""
        step = self.owner.current
        if step is None:
            return y
        slots = tuple(s for s in step.slots if s in self.slots)
        if not slots:
            return y  # none of the step's adapters adapts this projection
        if x.dim() != 2 or x.shape[0] != step.row_slots.shape[0]:
            raise RuntimeError(f"a projection with LoRA adapters got {tuple(x.shape)} for a step of "
                               f"{step.row_slots.shape[0]} rows")
        a_t, b_t, cols, layout = self._stack(slots)
        t = torch.mm(x, a_t)
        # a step with one adapter: the other rows have scale 0, nothing to mask (but with several, the rows of one
        # that leaves this projection alone have its scale, and must not get another's columns)
        if len(step.slots) > 1:
            t.mul_(step.mask(layout, cols))
        return y.addcmul_(torch.mm(t, b_t), step.scale)


@dataclass
class StepAdapters:
    """Which slot each row of one step runs with (`row_slots`, -1: none), and what the sites derive from it."""

    row_slots: torch.Tensor  # [rows] long
    scale: torch.Tensor  # [rows, 1]: each row's adapter's scaling (0 for rows without one), in the model's dtype
    slots: tuple[int, ...]  # the distinct slots of the step, sorted
    _masks: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def mask(self, layout: tuple, cols: torch.Tensor) -> torch.Tensor:
        """[rows, columns] 1 where the column belongs to the row's slot, else 0; `layout` names the columns
        (each slot's column count, `LoRASite._stack`), so sites whose stacks share it share the mask."""
        m = self._masks.get(layout)
        if m is None:
            m = self._masks[layout] = (self.row_slots.unsqueeze(1) == cols.unsqueeze(0)).to(self.scale.dtype)
        return m


class LoRALayers:
    """The adapters loaded into one model, by slot (a small int the manager chooses). `model.lora_target(name)`
    maps an adapter's module name to (projection, first output feature, output features); see models/llama.py."""

    def __init__(self, model: torch.nn.Module) -> None:
        if not hasattr(model, "lora_target"):
            raise ValueError(f"LoRA adapters are not supported for {type(model).__name__}")
        self.model = model
        self.sites: dict[int, LoRASite] = {}  # id(projection) -> its site
        self.slot_sites: dict[int, list[LoRASite]] = {}
        self.scalings: dict[int, float] = {}
        self.current: StepAdapters | None = None  # the step running now, if it has rows with adapters
        model.lora = self

    @property
    def active(self) -> bool:
        """Whether the step running now has rows with adapters."""
        return self.current is not None

    def load(self, slot: int, adapter: AdapterWeights) -> None:
        """Put `adapter` in `slot` (replacing what was there); ValueError, with the slot left empty, for a module
        this model has no projection for or matrices of the wrong shape."""
        self.unload(slot)
        grouped: dict[int, tuple[torch.nn.Module, list[tuple[int, int, torch.Tensor, torch.Tensor]]]] = {}
        for name, (a, b) in sorted(adapter.modules.items()):
            target = self.model.lora_target(name)
            if target is None:
                raise ValueError(f"LoRA adapter {adapter.name!r} adapts {name!r}, which is not a projection "
                                 f"deepinfer applies adapters to in {type(self.model).__name__} (attention and MLP "
                                 "projections of the decoder layers)")
            linear, offset, size = target
            if a.shape[1] != linear.in_features or b.shape[0] != size:
                raise ValueError(f"LoRA adapter {adapter.name!r}: {name!r} maps {a.shape[1]} -> {b.shape[0]} "
                                 f"features, the model's projection {linear.in_features} -> {size} (an adapter "
                                 "for another base model?)")
            grouped.setdefault(id(linear), (linear, []))[1].append((offset, size, a, b))
        sites = []
        for key, (linear, parts) in grouped.items():
            parts.sort(key=lambda p: p[0])
            rank = sum(p[2].shape[0] for p in parts)
            b_all = parts[0][3].new_zeros((linear.out_features, rank))
            col = 0
            for offset, size, a, b in parts:
                b_all[offset:offset + size, col:col + a.shape[0]] = b
                col += a.shape[0]
            site = self.sites.get(key)
            if site is None:
                site = self.sites[key] = LoRASite(self)
                linear.lora = site
            site.set_slot(slot, _SlotWeights(torch.cat([p[2] for p in parts]), b_all, adapter.scaling))
            sites.append(site)
        self.slot_sites[slot] = sites
        self.scalings[slot] = adapter.scaling

    def unload(self, slot: int) -> None:
        for site in self.slot_sites.pop(slot, []):
            site.set_slot(slot, None)
        self.scalings.pop(slot, None)

    @contextlib.contextmanager
    def step(self, row_slots: list[int] | None, dtype: torch.dtype, device: torch.device) -> Iterator[None]:
        """Within it, the model's forward applies each row's adapter (`row_slots`: a slot per row of the step,
        -1 for the base model; None or all -1: no adapter)."""
        slots = tuple(sorted({s for s in row_slots or () if s >= 0}))
        if slots:
            rows = torch.tensor(row_slots, dtype=torch.long, device=device)
            scale = torch.tensor([self.scalings[s] if s >= 0 else 0.0 for s in row_slots], dtype=dtype,
                                 device=device).unsqueeze(1)
            self.current = StepAdapters(rows, scale, slots)
        try:
            yield
        finally:
            self.current = None
