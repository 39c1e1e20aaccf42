"""DeepSeek-V4's MoE block: routed experts (hash or learned top-k routing) plus a shared expert.

- Hash routing (`hash_moe` layers): a frozen token id -> experts table (`tid2eid`) picks the experts;
  the learned gate only weighs them.
- Top-k routing (`moe` layers): scores = score_fn(gate logits) (sqrtsoftplus, softmax or sigmoid);
  the top k of scores + `bias` (the load-balancing correction) are picked.
Either way the picked scores are normalised to sum to one and multiplied by `routed_scaling_factor`
(the reference normalises whatever `norm_topk_prob` says). Expert MLPs are SwiGLU with the gate
clamped above and the up projection clamped both ways at `swiglu_limit`.

Experts run grouped (`layers/moe.py`'s `RoutedExperts`, shared with Qwen3-MoE and Mixtral): the (token,
expert) pairs are sorted by expert and each expert multiplies all its tokens in one matmul, so the cost is
one pair of matmuls per active expert, not per token. The routing weights are cast to the model dtype
before they scale the expert outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.linear import Linear
from deepinfer.layers.moe import RoutedExperts


def _score(logits: torch.Tensor, func: str) -> torch.Tensor:
    if func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if func == "softmax":
        return logits.softmax(dim=-1)
    if func == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"unsupported scoring_func {func!r}")


def _swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, intermediate: int, limit: float | None) -> None:
        super().__init__()
        self.w1 = Linear(hidden, intermediate, bias=False)  # gate
        self.w3 = Linear(hidden, intermediate, bias=False)  # up
        self.w2 = Linear(intermediate, hidden, bias=False)  # down
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(_swiglu(self.w1(x), self.w3(x), self.limit))


class MoE(nn.Module):
    def __init__(self, cfg, is_hash: bool) -> None:
        super().__init__()
        e, d, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.is_hash = is_hash
        self.top_k = cfg.num_experts_per_tok
        self.score_func = cfg.scoring_func
        self.scaling = cfg.routed_scaling_factor
        self.limit = getattr(cfg, "swiglu_limit", None)
        self.gate_weight = nn.Parameter(torch.zeros(e, d))
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("gate_bias", torch.zeros(e, dtype=torch.float32))
        self.experts = RoutedExperts(e, d, inter, swiglu_limit=self.limit)  # w13 [e, 2I, d] (gate; up), w2 [e, d, I]
        self.shared = SharedExpert(d, inter, self.limit)
        self.num_experts = e

    def route(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], weights [T, k])."""
        scores = _score(F.linear(x, self.gate_weight), self.score_func)
        if self.is_hash:
            idx = self.tid2eid[input_ids].long()
        else:
            idx = torch.topk(scores + self.gate_bias.to(scores.dtype), self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        return idx, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        idx, weights = self.route(x, input_ids)
        return self.experts(x, idx, weights.to(x.dtype)) + self.shared(x)
