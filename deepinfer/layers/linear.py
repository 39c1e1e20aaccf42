"""nn.Linear that can multiply small batches straight from GGUF quantized blocks (see gguf_kernels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.gguf_kernels import QuantizedWeight, max_rows


class Linear(nn.Linear):
    """Float weights always present (large batches, reference path); `quantized`, when attached,
    serves CPU float32 inputs of at most `max_rows()` rows."""

    quantized: QuantizedWeight | None = None
    _rows: int = 0

    def attach(self, weight: QuantizedWeight) -> None:
        if (weight.n, weight.k) != tuple(self.weight.shape):
            raise ValueError(f"quantized weight {weight.n}x{weight.k} != {tuple(self.weight.shape)}")
        self.quantized = weight
        self._rows = max_rows()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quantized
        if q is not None and x.dim() == 2 and x.shape[0] <= self._rows and x.dtype == torch.float32 \
                and x.device.type == "cpu":
            y = q.matmul(x)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)
