"""Reading a PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`), the format
`peft`'s `save_pretrained` writes and that vLLM and SGLang serve.

What an adapter is here: for each projection it adapts, A [r, in] and B [out, r], and one scaling
(`lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA); the projection computes `W x + (B (A x)) * scaling`,
in that order, as peft's `Linear.forward` does in eval mode. Kinds of adapter this does not apply are refused by
name (DoRA, biases, `modules_to_save`, embedding or LM-head adapters, per-module rank or alpha patterns), never
served half applied.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PREFIX = "base_model.model."  # what peft puts before the base model's own module names


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with, in vLLM's shape (`LoRARequest(lora_name, lora_int_id, lora_path)`):
    `lora_name` names it (the API's `model`), `lora_path` is its directory. `lora_int_id` is accepted for
    vLLM's callers and not used: adapters are told apart by name, and their KV by their content."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


@dataclass
class AdapterWeights:
    """One adapter as read from disk: module name (the base model's, e.g. `model.layers.0.self_attn.q_proj`)
    -> (A [r, in], B [out, r]); `digest` names its content (config and weights), so the KV it computes is
    told apart from every other adapter's in every cache tier, and two names for one directory share it."""

    name: str
    path: str
    rank: int
    scaling: float
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    digest: str

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.modules.values())


def _refuse(path: Path, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {str(path)!r}: {why}")


def read_adapter(name: str, path: str | Path, max_rank: int, dtype: torch.dtype) -> AdapterWeights:
    """The adapter in directory `path`, its tensors in `dtype`; ValueError for a directory that is not a PEFT LoRA
    adapter, a kind this module does not apply (see the module docstring), or a rank above `max_rank`."""
    from safetensors import safe_open

    root = Path(path)
    config_path, weights_path = root / CONFIG_NAME, root / WEIGHTS_NAME
    if not config_path.is_file():
        raise _refuse(root, f"no {CONFIG_NAME} (a PEFT LoRA adapter directory holds it and {WEIGHTS_NAME})")
    if not weights_path.is_file():
        raise _refuse(root, f"no {WEIGHTS_NAME} (adapters saved as .bin are not read: re-save with "
                            "safe_serialization=True)")
    config_bytes = config_path.read_bytes()
    try:
        config = json.loads(config_bytes)
    except json.JSONDecodeError as e:
        raise _refuse(root, f"{CONFIG_NAME} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise _refuse(root, f"{CONFIG_NAME} is not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise _refuse(root, f"peft_type {config.get('peft_type')!r} is not LORA")
    for key, why in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (fully trained copies of modules)"),
                     ("rank_pattern", "per-module ranks (rank_pattern)"),
                     ("alpha_pattern", "per-module alphas (alpha_pattern)"), ("fan_in_fan_out", "fan_in_fan_out")):
        if config.get(key):
            raise _refuse(root, f"{why} is not supported")
    if config.get("bias", "none") != "none":
        raise _refuse(root, f"bias={config['bias']!r} is not supported (only 'none')")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank <= 0 or not isinstance(alpha, int | float):
        raise _refuse(root, f"r must be a positive integer and lora_alpha a number, got r={rank!r}, "
                            f"lora_alpha={alpha!r}")
    if rank > max_rank:
        raise _refuse(root, f"rank {rank} is above --max-lora-rank {max_rank}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    parts: dict[str, dict[str, torch.Tensor]] = {}
    digest = hashlib.blake2b(config_bytes, digest_size=16)
    with safe_open(str(weights_path), framework="pt") as f:
        for key in sorted(f.keys()):
            tensor = f.get_tensor(key)
            digest.update(key.encode() + b"\0")
            digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
            module, dot, kind = key.removeprefix(_PREFIX).rpartition(".lora_")
            if not dot or kind not in ("A.weight", "B.weight"):
                raise _refuse(root, f"tensor {key!r} is not a LoRA A or B matrix (embedding adapters, biases and "
                                    "magnitude vectors are not supported)")
            parts.setdefault(module, {})[kind[0]] = tensor
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise _refuse(root, f"module {module!r} has lora_{'A' if 'A' in ab else 'B'} but not the other")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise _refuse(root, f"module {module!r}: A {tuple(a.shape)} and B {tuple(b.shape)} are not rank {rank}")
        modules[module] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    if not modules:
        raise _refuse(root, "no LoRA weights")
    return AdapterWeights(name, str(root), rank, float(scaling), modules, digest.hexdigest())
