"""nn.Linear with two CPU fast paths: GGUF quantized blocks for a few rows (see gguf_kernels)
and oneDNN's pre-packed bf16 / fp32 weights for larger batches."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.gguf_kernels import QuantizedWeight, max_rows


def _can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear(nn.Linear):
    """Float weights always present (reference path); `quantized`, when attached, serves CPU
    float32 / bfloat16 inputs of at most `max_rows()` rows; `pack()` adds a oneDNN-blocked
    copy of the weight, which skips the per-call weight reorder. bf16: measured 25-40% faster
    at 64 rows on an AMX Xeon, bit-identical output. fp32: torch's MKL sgemm repacks the weight
    every call and is slow at mid-size batches (576->3072 on a 2-core AVX-512 Xeon: 2.05 ms at
    32 rows, slower than 1.67 ms at 64); packed, 0.69 ms at 32 rows and never slower at 8-200
    rows; the sums are reassociated (differences ~1e-6 relative)."""

    quantized: QuantizedWeight | None = None
    _rows: int = 0
    _packed: torch.Tensor | None = None

    def attach(self, weight: QuantizedWeight) -> None:
        if (weight.n, weight.k) != tuple(self.weight.shape):
            raise ValueError(f"quantized weight {weight.n}x{weight.k} != {tuple(self.weight.shape)}")
        self.quantized = weight
        self._rows = max_rows()

    def pack(self, batch_hint: int = 64) -> bool:
        """Pre-pack the weight for oneDNN (bf16 / fp32 on CPU only); call again after changing the weight."""
        self._packed = None
        if not _can_pack(self.weight):
            return False
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), batch_hint)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quantized
        if q is not None and x.dim() == 2 and x.shape[0] <= self._rows and x.device.type == "cpu" \
                and x.dtype in (torch.float32, torch.bfloat16):
            y = q.matmul(x)
            return y if self.bias is None else y + self.bias
        if self._packed is not None and x.dim() == 2 and x.dtype == self.weight.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
