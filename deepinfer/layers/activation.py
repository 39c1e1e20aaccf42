"""Gated activations over a fused [.., 2 * I] gate/up projection output: SiLU(gate) * up (Llama),
GELU-tanh(gate) * up (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.layers import cpu_kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] -> [T, I]; one fused pass with the CPU kernel, three torch ops otherwise."""
    inter = gate_up.shape[-1] // 2
    kernels = cpu_kernels.kernels_for(gate_up)
    if kernels is not None and gate_up.dim() == 2 and inter % 8 == 0 and gate_up.is_contiguous():
        lib, code = kernels
        out = gate_up.new_empty((gate_up.shape[0], inter))
        lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter, code)
        return out
    gate, up = gate_up.split(inter, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] -> GELU(gate, tanh approximation) * up, [T, I]."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
