"""RMSNorm, computed in float32 like the reference implementations, optionally fused with
the residual add that precedes it (`x + residual` is stored back into `residual`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers import cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: rmsnorm(x). With it: (rmsnorm(x + residual), x + residual)."""
        kernels = cpu_kernels.kernels_for(x)
        if kernels is not None and x.dim() == 2 and x.shape[-1] % 8 == 0 and x.is_contiguous() \
                and self.weight.dtype == x.dtype:
            lib, code = kernels
            out = torch.empty_like(x)
            lib.rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), self.weight.data_ptr(),
                         out.data_ptr(), x.shape[0], x.shape[1], self.eps, code)
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; same formula as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the checkpoint stores w and the norm scales by (1 + w), computed in float32 and
    rounded to the input's dtype after the multiply (Llama's rounds before it)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)
