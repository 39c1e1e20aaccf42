"""A tiny random DeepSeek-V4 checkpoint with an MTP layer (`mtp.0.*`, named as the published checkpoints
name them): sliding-window layers by default (tests add compressed ones through `overrides`), layer 1 a
sliding top-k MoE layer whose tensors the MTP block copies, the MTP's own tensors random."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.models.v4_tiny import SWA, build_v4

SPEC = dict(layer_types=[SWA, SWA], mlp_layer_types=["hash_moe", "moe"], num_hidden_layers=2,
            num_nextn_predict_layers=1, sliding_window=6)


def build_v4_with_mtp(path: Path, seed: int = 3, **overrides):
    """Saves the checkpoint to `path` (with `mtp.safetensors` beside the model's file); returns
    (transformers model, the mtp.* tensors)."""
    hf = build_v4(path, seed=seed, **{**SPEC, **overrides})
    tensors = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed + 100)
    d, hc = hf.config.hidden_size, hf.config.hc_mult
    mtp = {"mtp.0." + n.removeprefix("model.").removeprefix("layers.1."): t.clone()
           for n, t in tensors.items() if n.removeprefix("model.").startswith("layers.1.")}
    mtp.update({"mtp.0.e_proj.weight": torch.randn(d, d, generator=g) * 0.3,
                "mtp.0.h_proj.weight": torch.randn(d, d, generator=g) * 0.3,
                "mtp.0.enorm.weight": 1 + 0.2 * torch.randn(d, generator=g),
                "mtp.0.hnorm.weight": 1 + 0.2 * torch.randn(d, generator=g),
                "mtp.0.norm.weight": 1 + 0.2 * torch.randn(d, generator=g),
                "mtp.0.hc_head_fn": torch.randn(hc, hc * d, generator=g) * 0.3,
                "mtp.0.hc_head_base": torch.randn(hc, generator=g) * 0.3,
                "mtp.0.hc_head_scale": torch.ones(1) + 0.1 * torch.randn(1, generator=g)})
    save_file(mtp, str(path / "mtp.safetensors"))
    return hf, mtp
