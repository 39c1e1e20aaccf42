"""Which adapters an engine knows by name, which are loaded, and in which slot.

Names come from `--lora-modules` (read and checked at start-up, so a bad directory fails then, not at the first
request), from `POST /v1/load_lora_adapter`, or from an offline `LoRARequest` that carries its path. A request
names one (`acquire`); an adapter not loaded is read from disk into a free slot, or into the slot of the least
recently used adapter no unfinished request runs with. `max_slots` (`--max-cpu-loras`) adapters stay loaded; when
every slot holds an adapter that unfinished requests run with, one more slot is opened rather than the request
refused (adapters are small beside the model, and a waiting request holds its adapter as it holds its place in
the queue); slots past `max_slots` are given up as their adapters fall idle. All in host memory: a CPU engine's
"device" memory is the same RAM.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.lora.adapter import LoRARequest, read_adapter
from deepinfer.lora.layers import LoRALayers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedAdapter:
    """What a request holds of its adapter: its slot for the forward, its name, and its content digest for the
    KV block hashes."""

    name: str
    slot: int
    digest: str


class LoRAManager:
    """`modules`: name -> adapter directory, registered now; `in_use()`: the slots unfinished requests hold
    (their adapters are never evicted)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, max_slots: int, max_rank: int,
                 modules: dict[str, str], in_use: Callable[[], set[int]]) -> None:
        self.layers = LoRALayers(model)
        self.dtype = dtype
        self.max_slots = max_slots
        self.max_rank = max_rank
        self.in_use = in_use
        self.paths: dict[str, str] = {}  # the names requests may use -> their directories
        # where adapters are loaded: by name, and (after `unregister` while requests still ran with one) under a
        # key no request can name, until evicted
        self._slots: dict[str, LoadedAdapter] = {}
        self._used: dict[str, float] = {}  # key in _slots -> when a request last acquired it
        self.digests: dict[str, str] = {}  # name -> its adapter's content digest (names its KV blocks)
        for name, path in modules.items():
            self.register(name, path)

    def names(self) -> list[str]:
        return sorted(self.paths)

    @property
    def num_loaded(self) -> int:
        """Adapters in slots now (named or kept for the requests running with an unloaded one)."""
        return len(self._slots)

    def register(self, name: str, path: str) -> None:
        """Make `name` an adapter requests may name, reading it now (ValueError if it cannot be served)."""
        if not name or not name.strip():
            raise ValueError("a LoRA adapter needs a non-empty name")
        if name in self.paths:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded (from {self.paths[name]!r}); "
                             "unload it first")
        self.paths[name] = path
        try:
            self._load(name)
        except (ValueError, OSError):
            del self.paths[name]
            self.digests.pop(name, None)
            raise

    def unregister(self, name: str) -> None:
        """Forget `name` (requests already running with it finish with it); ValueError if unknown."""
        if name not in self.paths:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        del self.paths[name]
        self.digests.pop(name, None)
        loaded = self._slots.get(name)
        if loaded is None:
            return
        if loaded.slot in self.in_use():
            key = f"\0unloaded:{loaded.slot}"
            self._slots[key] = self._slots.pop(name)
            self._used[key] = self._used.pop(name, 0.0)
        else:
            self._evict(name)

    def acquire(self, request: LoRARequest | str) -> LoadedAdapter:
        """The adapter a request names, loaded. A `LoRARequest` with a path registers its name if new;
        ValueError for an unknown name or a name already registered with another path."""
        if isinstance(request, str):
            name, path = request, ""
        else:
            name, path = request.lora_name, request.lora_path
        if name not in self.paths:
            if not path:
                raise ValueError(f"no LoRA adapter named {name!r} (loaded: {', '.join(self.names()) or 'none'})")
            self.register(name, path)
        elif path and path != self.paths[name]:
            raise ValueError(f"LoRA adapter {name!r} is loaded from {self.paths[name]!r}, not {path!r}")
        loaded = self._load(name)
        self._used[name] = time.monotonic()
        return loaded

    def _load(self, name: str) -> LoadedAdapter:
        if name in self._slots:
            return self._slots[name]
        weights = read_adapter(name, self.paths[name], self.max_rank, self.dtype)
        slot = self._free_slot()
        self.layers.load(slot, weights)  # a ValueError leaves the slot empty
        loaded = self._slots[name] = LoadedAdapter(name, slot, weights.digest)
        self.digests[name] = weights.digest
        self._used[name] = time.monotonic()
        logger.info("LoRA adapter %r (rank %d, %d modules, %.1f MB) in slot %d", name, weights.rank,
                    len(weights.modules), weights.num_bytes / 1e6, slot)
        return loaded

    def _free_slot(self) -> int:
        busy = self.in_use()
        # slots opened past max_slots whose adapters fell idle are given up first
        for key in [k for k, a in self._slots.items() if a.slot >= self.max_slots and a.slot not in busy]:
            self._evict(key)
        taken = {a.slot for a in self._slots.values()}
        free = [s for s in range(self.max_slots) if s not in taken]
        if free:
            return free[0]
        idle = [k for k, a in self._slots.items() if a.slot not in busy]
        if idle:
            victim = min(idle, key=lambda k: self._used.get(k, 0.0))
            slot = self._slots[victim].slot
            self._evict(victim)
            return slot
        slot = next(s for s in itertools.count(self.max_slots) if s not in taken)
        logger.info("all %d LoRA slots hold adapters of unfinished requests: opening slot %d", self.max_slots, slot)
        return slot

    def _evict(self, key: str) -> None:
        self.layers.unload(self._slots.pop(key).slot)
        self._used.pop(key, None)
