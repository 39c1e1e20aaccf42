"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4 paper section 2.2) and the hyper head.

The residual stream is `hc_mult` parallel streams ([T, n, D]). Around each attention or MoE block a
`HyperConnection` computes, from the normalised streams, three mixings: `pre` (collapse the streams
into the block's input), `post` (spread the block's output over the streams) and `comb` (mix the
streams into each other), `comb` projected towards a doubly-stochastic matrix by Sinkhorn-Knopp
iterations so the residual does not grow through depth. `HyperHead` collapses the streams once more
before the final norm. All of it runs in float32, as the reference keeps these modules in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        n = hc_mult
        self.n, self.iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, D] -> (post [T, n], comb [T, n, n] (float32), collapsed block input [T, D])."""
        n = self.n
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        base = self.base.float()
        scale = self.scale.float()
        pre = torch.sigmoid(pre_w * scale[0] + base[:n]) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * scale[1] + base[n:2 * n])
        comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + base[2 * n:].view(n, n), dim=-1) + self.hc_eps
        # Sinkhorn-Knopp: columns first, then (rows, columns) for the remaining iterations
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """New streams: post_i * out + sum_j comb[j, i] * stream_j (comb is applied transposed)."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                     streams)


class HyperHead(nn.Module):
    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
