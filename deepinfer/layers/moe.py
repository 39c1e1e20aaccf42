"""Mixture-of-experts building blocks: a softmax top-k router with its numerics spelled out, and the
routed experts' SwiGLU MLPs computed grouped by expert.

Routing (`SoftmaxTopKRouter`), what transformers' Qwen3-MoE and Mixtral routers compute, step by step:
  1. router logits = x @ gate^T in the model dtype (F.linear, as transformers);
  2. probabilities = softmax over all experts, in float32;
  3. the k largest probabilities, in descending order, by `torch.topk` as transformers picks them: exact
     ties (frequent with bf16 logits) are broken the same way as the reference. That order is not "lower id
     first" (it depends on the row's length and values) but it is a function of the row alone: the same
     row picks the same experts in any batch, at any thread count (tests/layers/test_moe.py pins this);
  4. when `renormalize`, the k probabilities are divided by their sum, in float32 (Mixtral always: its
     "softmax over the top-k logits" is computed this way by transformers; Qwen3-MoE when `norm_topk_prob`);
  5. the weights are returned in `weight_dtype`'s choice: the model dtype (Qwen3-MoE casts them back to
     the logits' dtype) or float32 (Mixtral keeps them), which is the dtype the expert outputs are scaled in.

Experts (`RoutedExperts`): weights stacked per projection, `w13` [n_local, 2I, H] (gate rows, then up rows)
and `w2` [n_local, H, I]. The (token, expert) pairs are sorted by expert id (stably: each expert's tokens
stay in token order), each active expert multiplies all its tokens in one matmul pair, the outputs are
scaled by the routing weights and added back into the tokens' rows (`index_add_`) expert by expert in
ascending id: the same matmuls (same rows, same order) and the same order of additions as transformers'
per-expert loop; SiLU * up goes through the CPU kernel the dense MLP uses (`silu_and_mul`: bf16 identical to
torch's, fp32 within 1 ulp). No Python loop runs per token; one runs per active expert.

GGUF blocks (`attach_quantized`): a slot may carry its expert's Q4_1 / Q8_0 blocks (gate and up rows
concatenated as `w13`, and `w2`); an active expert with at most `max_rows()` tokens multiplies them with the
GGUF kernels (the rule `Linear.forward` follows), more tokens the dense weights. The contract is the dense
projections' (`gguf_kernels`): the kernels multiply with the values the dense slot holds in the model dtype,
so only the summation order changes. Whoever changes a slot's dense weights must hand the slot its new
blocks (EPLB's re-placement moves them with the weights, `ep_moe.py`) or drop them (`attach_quantized(slot,
None, None)`): blocks never outlive the dense weights they mirror. `--deterministic` (`make_row_invariant`):
every expert through the kernel whatever its token count, blocks or dense kind.

Expert parallelism (`layers/ep_moe.py`): an expert module holds the experts `local_experts` (global ids)
and its `forward` takes (tokens, global expert ids, weights), skipping pairs whose expert it does not hold;
`ExpertParallelExperts` subclasses it with physical slot ids as its "experts" and wraps the compute in an
all-to-all dispatch and combine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.activation import silu_and_mul
from deepinfer.layers.gguf_kernels import QuantizedWeight, max_rows

PROJECTIONS = ("gate", "up", "down")


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool,
                 weight_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (expert ids [T, k] int64, weights [T, k] in `weight_dtype`); see the module
    docstring for the numerics."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(weight_dtype)


class SoftmaxTopKRouter(nn.Module):
    """`weight` [E, H] (transformers' `mlp.gate.weight`); forward(x [T, H]) -> (ids [T, k], weights [T, k]).
    `float32_weights`: return the weights in float32 (Mixtral) instead of the model dtype (Qwen3-MoE)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool,
                 float32_weights: bool) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} with {num_experts} experts")
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.top_k = top_k
        self.renormalize = renormalize
        self.float32_weights = float32_weights
        self.row_invariant: QuantizedWeight | None = None  # --deterministic: the logits through the kernel

    def make_row_invariant(self) -> None:
        """Compute the logits with the row-invariant kernel (a row's logits never depend on the batch).
        ValueError where the kernel cannot take the weight (hidden size not a multiple of 32)."""
        self.row_invariant = QuantizedWeight.dense(self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.row_invariant
        logits = k.matmul(x) if k is not None and x.dim() == 2 and x.dtype == k.qs.dtype else F.linear(x, self.weight)
        return softmax_topk(logits, self.top_k, self.renormalize,
                            torch.float32 if self.float32_weights else logits.dtype)


@dataclass
class ExpertGroups:
    """The (token, expert) pairs a module holds, sorted by expert: `tokens[i]` is pair i's row of x,
    `weights[i]` its routing weight; `counts[s]` pairs belong to local slot s, in slot order."""

    tokens: torch.Tensor
    weights: torch.Tensor
    counts: list[int]


class RoutedExperts(nn.Module):
    """The routed experts' SwiGLU MLPs (silu(gate) * up, then down), stacked per projection.

    `local_experts`: the global ids of the experts held here, ascending (default: all `num_experts`);
    slot s of `w13` / `w2` is expert `local_experts[s]`. `swiglu_limit` (DeepSeek-V4): the gate is clamped
    above and the up projection both ways at that value before the product."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 local_experts: Sequence[int] | None = None, swiglu_limit: float | None = None) -> None:
        super().__init__()
        local = list(range(num_experts) if local_experts is None else local_experts)
        if local != sorted(set(local)) or (local and not 0 <= local[0] <= local[-1] < num_experts):
            raise ValueError(f"local_experts must be distinct ascending ids below {num_experts}, got {local}")
        self.num_experts = num_experts
        self.local_experts = tuple(local)
        self.hidden = hidden
        self.intermediate = intermediate
        self.swiglu_limit = swiglu_limit
        self.w13 = nn.Parameter(torch.zeros(len(local), 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.zeros(len(local), hidden, intermediate))
        slot = torch.full((num_experts,), -1, dtype=torch.long)
        slot[list(local)] = torch.arange(len(local))
        self.register_buffer("slot_of", slot, persistent=False)  # global id -> local slot, -1: held elsewhere
        # per local slot: GGUF blocks of (w13, w2) or None (dense); see the module docstring
        self.quantized: list[tuple[QuantizedWeight, QuantizedWeight] | None] = [None] * len(local)
        self._rows = 0  # max_rows() once blocks are attached
        self.block_kinds: tuple[str, str] | None = None  # (w13, w2) block types once a GGUF file's are attached
        self.quantized_calls = 0  # expert matmul pairs served from blocks (tests and benchmarks read it)
        # --deterministic: per slot, the kernel weights serving every token count (its blocks, or its dense
        # weights as the kernel's dense kind); None: off
        self.row_invariant: list[tuple[QuantizedWeight, QuantizedWeight]] | None = None

    # ------------------------------------------------------------------ weights

    @property
    def held_experts(self) -> tuple[int, ...]:
        """The global ids of the experts whose weights load here (`ExpertParallelExperts`: its slots' experts)."""
        return self.local_experts

    def expert_weight(self, expert: int, proj: str) -> torch.Tensor | None:
        """The view of global expert `expert`'s `proj` ("gate" [I, H], "up" [I, H], "down" [H, I]) to copy a
        checkpoint tensor into; None when the expert is held elsewhere."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range ({self.num_experts} experts)")
        s = int(self.slot_of[expert])
        if s < 0:
            return None
        if proj == "down":
            return self.w2[s]
        return self.w13[s].narrow(0, PROJECTIONS.index(proj) * self.intermediate, self.intermediate)

    def attach_quantized(self, slot: int, w13: QuantizedWeight | None, w2: QuantizedWeight | None) -> None:
        """Give local slot `slot` the GGUF blocks of its expert (`w13`: gate rows then up rows [2I, H];
        `w2` [H, I]), or, both None, drop its blocks (it multiplies its dense weights)."""
        if w13 is None or w2 is None:
            if w13 is not None or w2 is not None:
                raise ValueError("a slot's gate/up and down blocks are attached together")
            self.quantized[slot] = None
            return
        for q, dense, what in ((w13, self.w13, "gate/up"), (w2, self.w2, "down")):
            if (q.n, q.k) != tuple(dense.shape[1:]) or q.kind == "dense":
                raise ValueError(f"{what} blocks {q.kind} {q.n}x{q.k} for a slot of {tuple(dense.shape[1:])}")
        self.quantized[slot] = (w13, w2)
        self._rows = max_rows()

    def make_row_invariant(self) -> None:
        """--deterministic: every active expert multiplies through the GGUF kernel whatever its token count
        (its blocks where attached, else its dense weights as the kernel's dense kind), so a token's expert
        outputs do not depend on which other tokens share the expert; with the row-invariant router, the
        per-row activation and the per-token sum in ascending expert id, a row's MoE output depends on that
        row alone. ValueError where the kernel cannot take the weights (hidden or expert width not a
        multiple of 32, not CPU float32 / bfloat16). The dense kind reads the slot tensors in place: a
        re-placement that swaps them (EPLB) is not supported in this mode."""
        self.row_invariant = [q if q is not None else (QuantizedWeight.dense(self.w13[s]),
                                                       QuantizedWeight.dense(self.w2[s]))
                              for s, q in enumerate(self.quantized)]

    def slot_experts(self) -> list[int]:
        """The checkpoint (logical) expert whose weights each local slot holds."""
        return list(self.local_experts)

    def attach_expert_blocks(self, gate: list[QuantizedWeight], up: list[QuantizedWeight],
                             down: list[QuantizedWeight]) -> int:
        """Attach a GGUF file's per-expert blocks (indexed by logical expert: one 3-D tensor each, so one
        type for all experts) to the slots holding those experts; returns how many slots got blocks (none
        where gate and up differ in type)."""
        if not len(gate) == len(up) == len(down) == self.num_logical_experts:
            raise ValueError(f"expert blocks for {len(gate)} / {len(up)} / {len(down)} experts, "
                             f"the layer has {self.num_logical_experts}")
        if gate[0].kind != up[0].kind:
            return 0
        for s, e in enumerate(self.slot_experts()):
            self.attach_quantized(s, QuantizedWeight.concat([gate[e], up[e]]), down[e])
        self.block_kinds = (gate[0].kind, down[0].kind)
        return len(self.slot_experts())

    @property
    def num_logical_experts(self) -> int:
        """The experts of the checkpoint layer (`ExpertParallelExperts`: not its physical slots)."""
        return self.num_experts

    @property
    def num_quantized(self) -> int:
        """Slots carrying GGUF blocks."""
        return sum(q is not None for q in self.quantized)

    # ------------------------------------------------------------------ compute

    def group(self, expert_ids: torch.Tensor, weights: torch.Tensor) -> ExpertGroups:
        """Sort the pairs (token t, its j-th expert) by local slot; pairs of experts held elsewhere are dropped."""
        k = expert_ids.shape[-1]
        slots = self.slot_of[expert_ids.reshape(-1)]
        order = torch.argsort(slots, stable=True)  # slot -1 (held elsewhere) first, then slot by slot
        counts = torch.bincount(slots + 1, minlength=len(self.local_experts) + 1).tolist()
        order = order[counts[0]:]
        return ExpertGroups(order // k, weights.reshape(-1)[order], counts[1:])

    def compute(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """sum over pairs of weight * expert(x[token]) into [T, H] (x's dtype): one gate/up and one down
        matmul per active expert; the product with the weight is taken in the weights' and outputs'
        promoted dtype (float32 weights: float32), then rounded to x's dtype before it is added."""
        out = torch.zeros_like(x)
        blocks_ok = x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
        start = 0
        for s, n in enumerate(groups.counts):
            if not n:
                continue
            t = groups.tokens[start:start + n]
            q = self.quantized[s]
            if self.row_invariant is not None and blocks_ok:
                q = self.row_invariant[s]
                h = q[1].matmul(self._act(q[0].matmul(x[t])))
                self.quantized_calls += q[0].kind != "dense"
            elif q is not None and n <= self._rows and blocks_ok:
                h = q[1].matmul(self._act(q[0].matmul(x[t])))
                self.quantized_calls += 1
            else:
                h = F.linear(self._act(F.linear(x[t], self.w13[s])), self.w2[s])
            h = h * groups.weights[start:start + n, None]
            out.index_add_(0, t, h.to(out.dtype))
            start += n
        return out

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; expert_ids [T, k] global ids; weights [T, k] -> [T, H]: each token's weighted sum over
        its experts held here."""
        return self.compute(x, self.group(expert_ids, weights))

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.swiglu_limit is None:
            return silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        lim = self.swiglu_limit
        return F.silu(gate.clamp(max=lim)) * up.clamp(min=-lim, max=lim)

    def extra_repr(self) -> str:
        return (f"experts={len(self.local_experts)}/{self.num_experts}, hidden={self.hidden}, "
                f"intermediate={self.intermediate}, swiglu_limit={self.swiglu_limit}")


class SparseMoeBlock(nn.Module):
    """Router + routed experts, no shared expert (Qwen3-MoE's `mlp`, Mixtral's `block_sparse_moe`)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, renormalize: bool,
                 float32_weights: bool, local_experts: Sequence[int] | None = None) -> None:
        super().__init__()
        self.gate = SoftmaxTopKRouter(hidden, num_experts, top_k, renormalize, float32_weights)
        self.experts = RoutedExperts(num_experts, hidden, intermediate, local_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        return self.experts(x, ids, weights)
