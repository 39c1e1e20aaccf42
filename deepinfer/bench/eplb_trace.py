"""Routing traces for `deepinfer bench eplb`: the file format, and a recorder that runs a real MoE model.

Format (JSON lines, one object per line):
  line 1, the header: {"format": "deepinfer-routing-trace", "version": 1, "num_experts": E, "top_k": k,
                       "layers": [router module names, one per MoE layer], "source": {free-form: model, skew...}}
  then one line per engine step: {"step": i, "tokens": T, "counts": [[E ints] per layer]}
  where counts[l][e] is the number of the step's T tokens that layer l routed to expert e (each token picks
  k distinct experts, so every layer's counts sum to T * k).

Recording (`record_trace`): the model runs through `deepinfer.LLM` (greedy, EOS ignored, all prompts in
one batch so each decode step routes one token per prompt); forward hooks on the router modules, registered
on the loaded model without editing any model file, count each step's expert choices:
  - `SoftmaxTopKRouter` (Qwen3-MoE, Mixtral): a forward hook reads the (ids, weights) it returns;
  - DeepSeek-V4's `MoE` (hash and top-k layers): a forward pre-hook calls its pure `route(x, input_ids)`.
The top-level model's forward pre-hook opens a step, its forward hook closes it.

The skew (`skew` = s >= 0): a gate bias added to every top-k router's logits, b_e = -s * ln(1 + rank_e),
with rank_e a fixed random permutation of the experts (seeded): it multiplies expert e's softmax weight by
(1 + rank_e)^-s, a Zipf-like prior of exponent s on top of what the (random) gate computes. For
`SoftmaxTopKRouter` a forward hook recomputes the routing from logits + b (so the model really routes that
way); for V4's top-k layers b is added to the `gate_bias` buffer the router already adds. V4's hash layers
route by token id and keep their table (their skew is the token distribution's). Prompts are random token
ids (uniform over the vocabulary, seeded).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

FORMAT = "deepinfer-routing-trace"
VERSION = 1


@dataclass(frozen=True)
class RoutingTrace:
    num_experts: int
    top_k: int
    layers: tuple[str, ...]
    tokens: np.ndarray  # [steps] int64
    counts: np.ndarray  # [steps, layers, experts] int64
    source: dict

    def expert_shares(self) -> np.ndarray:
        """[layers, experts]: each expert's share of the layer's (token, expert) pairs over the whole trace."""
        total = self.counts.sum(axis=0).astype(np.float64)
        return total / np.maximum(total.sum(axis=1, keepdims=True), 1.0)


def write_trace(path: str | Path, trace: RoutingTrace) -> None:
    with open(path, "w") as f:
        f.write(json.dumps({"format": FORMAT, "version": VERSION, "num_experts": trace.num_experts,
                            "top_k": trace.top_k, "layers": list(trace.layers), "source": trace.source}) + "\n")
        for i, (t, c) in enumerate(zip(trace.tokens.tolist(), trace.counts.tolist(), strict=True)):
            f.write(json.dumps({"step": i, "tokens": t, "counts": c}) + "\n")


def load_trace(path: str | Path) -> RoutingTrace:
    """Read and check a routing trace (see the module docstring); a bad file raises ValueError naming the line."""
    tokens, counts = [], []
    with open(path) as f:
        try:
            head = json.loads(f.readline())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:1: not a routing trace header ({e})") from e
        if not isinstance(head, dict) or head.get("format") != FORMAT or head.get("version") != VERSION:
            raise ValueError(f"{path}:1: not a {FORMAT} v{VERSION} header")
        try:
            e, k, layers = int(head["num_experts"]), int(head["top_k"]), tuple(str(x) for x in head["layers"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}:1: header needs num_experts, top_k, layers ({err!r})") from err
        if e <= 0 or not 0 < k <= e or not layers:
            raise ValueError(f"{path}:1: need num_experts > 0, 0 < top_k <= num_experts and at least one layer")
        for n, line in enumerate(f, 2):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                t, c = int(d["tokens"]), np.asarray(d["counts"], dtype=np.int64)
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{n}: not a step record ({err!r})") from err
            if c.shape != (len(layers), e) or t < 0 or (c < 0).any() or (c.sum(axis=1) != t * k).any():
                raise ValueError(f"{path}:{n}: counts must be [{len(layers)} layers][{e} experts] of ints >= 0, "
                                 f"each layer summing to tokens * top_k")
            tokens.append(t)
            counts.append(c)
    if not counts:
        raise ValueError(f"{path}: no steps")
    return RoutingTrace(e, k, layers, np.asarray(tokens, dtype=np.int64), np.stack(counts), head.get("source", {}))


def skew_bias(num_experts: int, skew: float, seed: int) -> torch.Tensor:
    """b_e = -skew * ln(1 + rank_e), rank a seeded random permutation of the experts."""
    rank = torch.randperm(num_experts, generator=torch.Generator().manual_seed(seed))
    return -skew * torch.log1p(rank.to(torch.float32))


def record_trace(model: str, out: str | Path, *, skew: float = 1.0, prompts: int = 16, prompt_len: int = 32,
                 new_tokens: int = 32, seed: int = 0, dtype: str = "float32",
                 kv_cache_memory: str = "256MiB") -> RoutingTrace:
    """Run `model` (an HF directory of an MoE family) through `deepinfer.LLM` with a gate skew, record each
    step's expert counts per MoE layer, write them to `out` (see the module docstring) and return them."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.layers.moe import SoftmaxTopKRouter, softmax_topk
    from deepinfer.models.deepseek_v4.moe import MoE as V4MoE

    if skew < 0 or prompts <= 0 or prompt_len <= 0 or new_tokens <= 0:
        raise ValueError("need skew >= 0 and prompts, prompt_len, new_tokens > 0")
    with LLM(model, dtype=dtype, max_num_seqs=prompts, enable_prefix_caching=False,
             kv_cache_memory=kv_cache_memory) as llm:
        net = llm.engine.core.runner.model
        routers = [(name, m) for name, m in net.named_modules() if isinstance(m, SoftmaxTopKRouter | V4MoE)]
        if not routers:
            raise ValueError(f"{model} has no MoE router (SoftmaxTopKRouter or DeepSeek-V4 MoE) to record")
        num_experts = {m.weight.shape[0] if isinstance(m, SoftmaxTopKRouter) else m.num_experts for _, m in routers}
        top_k = {m.top_k for _, m in routers}
        if len(num_experts) != 1 or len(top_k) != 1:
            raise ValueError(f"{model}: MoE layers differ in experts or top-k ({num_experts}, {top_k})")
        e, k = num_experts.pop(), top_k.pop()
        bias = skew_bias(e, skew, seed)
        steps: list[tuple[int, np.ndarray]] = []
        hooks = []

        def count(layer: int, ids: torch.Tensor) -> None:
            # a forward's first MoE layer opens its step: the runner calls the model's `hidden_states` /
            # `compute_logits`, so hooks on the model's own forward never run
            if layer == 0:
                steps.append((ids.shape[0], np.zeros((len(routers), e), dtype=np.int64)))
            steps[-1][1][layer] += torch.bincount(ids.reshape(-1), minlength=e).numpy()

        def softmax_router_hook(layer: int):
            def hook(mod, args, output):
                logits = F.linear(args[0], mod.weight) + bias.to(args[0].dtype)
                ids, weights = softmax_topk(logits, mod.top_k, mod.renormalize,
                                            torch.float32 if mod.float32_weights else logits.dtype)
                count(layer, ids)
                return ids, weights  # the model routes with the skew too
            return hook

        def v4_hook(layer: int):
            def hook(mod, args):
                ids, _ = mod.route(args[0], args[1])
                count(layer, ids)
            return hook

        for layer, (_, m) in enumerate(routers):
            if isinstance(m, SoftmaxTopKRouter):
                hooks.append(m.register_forward_hook(softmax_router_hook(layer)))
            else:
                if not m.is_hash:
                    m.gate_bias.add_(bias)
                hooks.append(m.register_forward_pre_hook(v4_hook(layer)))

        try:
            vocab = llm.engine.core.hf_config.vocab_size
            g = torch.Generator().manual_seed(seed)
            batch = [{"prompt_token_ids": torch.randint(0, vocab, (prompt_len,), generator=g).tolist()}
                     for _ in range(prompts)]
            llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
        finally:
            for h in hooks:
                h.remove()
    steps = [(t, c) for t, c in steps if t > 0]
    trace = RoutingTrace(e, k, tuple(name for name, _ in routers), np.asarray([t for t, _ in steps], dtype=np.int64),
                         np.stack([c for _, c in steps]),
                         {"model": str(model), "skew": skew, "gate_bias": f"-{skew} * ln(1 + rank_e), seed {seed}",
                          "prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens,
                          "dtype": dtype})
    write_trace(out, trace)
    return trace


def max_over_mean(shares: np.ndarray) -> float:
    """max / mean of one layer's expert shares."""
    m = float(np.mean(shares))
    return 1.0 if m <= 0 or math.isnan(m) else float(np.max(shares)) / m
