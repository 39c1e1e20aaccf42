"""The Llama layout with mixture-of-experts feed-forward layers (Qwen3-MoE, Mixtral): a softmax top-k
router and routed SwiGLU experts (`layers/moe.py`) in place of the dense MLP, on every layer or on some.

Subclasses say which layers are sparse (`is_sparse`), how the router weighs (`renormalize`, `float32_weights`)
and how checkpoint names map (`_rename`, `_EXPERT_PROJ`). Checkpoints store one tensor per expert and
projection (`...experts.E.gate_proj.weight`, Mixtral's `w1` / `w3` / `w2`); they are copied into the stacked
parameters of the experts this process holds (`held_experts`: all of them, or this rank's with expert
parallelism), and
transformers' own stacked names (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) load too.
From a GGUF file, `attach_gguf` also gives each expert slot its Q4_1 / Q8_0 blocks (llama.cpp's stacked
`blk.N.ffn_{gate,up,down}_exps`), which the GGUF kernels multiply for experts with few tokens in a step.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from deepinfer.layers.gguf_kernels import QuantizedWeight
from deepinfer.layers.moe import RoutedExperts, SparseMoeBlock
from deepinfer.models.llama import GatedMLP, LlamaForCausalLM

_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")
_STACKED = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


class SparseMoeForCausalLM(LlamaForCausalLM):
    # checkpoint expert projection name -> ours ("gate", "up", "down")
    _EXPERT_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    float32_weights = False  # route weights stay float32 (Mixtral) or are cast to the model dtype (Qwen3-MoE)

    def num_experts(self, cfg) -> int:
        raise NotImplementedError

    def is_sparse(self, cfg, layer: int) -> bool:
        return True

    def renormalize(self, cfg) -> bool:
        return True

    def expert_intermediate(self, cfg) -> int:
        return cfg.intermediate_size

    def make_mlp(self, cfg, layer: int, bias: bool) -> nn.Module:
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported activation {act!r}")
        if not self.is_sparse(cfg, layer):
            return GatedMLP(cfg, bias)
        if bias:
            raise ValueError("mlp_bias=True is not supported for mixture-of-experts layers")
        return SparseMoeBlock(cfg.hidden_size, self.num_experts(cfg), cfg.num_experts_per_tok,
                              self.expert_intermediate(cfg), self.renormalize(cfg), self.float32_weights)

    def enable_fused_decode(self) -> bool:
        """Off: the whole-layer C decode kernel computes a dense MLP; small decodes run the per-layer path."""
        self.fused = None
        return False

    # ------------------------------------------------------------------ weights

    def attach_gguf(self, tensors: dict[str, QuantizedWeight],
                    experts: dict[str, list[QuantizedWeight]] | None = None) -> int:
        """The dense projections' blocks (`LlamaForCausalLM.attach_gguf`) and each MoE layer's expert blocks
        (llama.cpp's stacked `blk.N.ffn_{gate,up,down}_exps`) on the slots holding those experts (all of
        them, or this rank's with expert parallelism); returns how many projections and expert slots."""
        attached = super().attach_gguf(tensors)
        for i, ex in self._experts().items():
            parts = [(experts or {}).get(f"blk.{i}.ffn_{p}_exps.weight") for p in ("gate", "up", "down")]
            if all(p is not None for p in parts):
                attached += ex.attach_expert_blocks(*parts)
        return attached

    def _rename(self, name: str) -> str:
        """A checkpoint name (without "model.") in Qwen3-MoE's naming."""
        return name

    def _experts(self) -> dict[int, RoutedExperts]:
        return {i: layer.mlp.experts for i, layer in enumerate(self.layers) if isinstance(layer.mlp, SparseMoeBlock)}

    def _params_loaded_elsewhere(self) -> set[str]:
        return {f"layers.{i}.mlp.experts.{p}" for i in self._experts() for p in ("w13", "w2")}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        experts = self._experts()
        loaded: set[tuple[int, int, str]] = set()

        def copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
            if tuple(dst.shape) != tuple(src.shape):
                raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
            with torch.no_grad():
                dst.copy_(src)

        def rest() -> Iterator[tuple[str, torch.Tensor]]:
            for hf_name, tensor in weights:
                name = self._rename(hf_name.removeprefix("model."))
                m, s = _EXPERT.match(name), _STACKED.match(name)
                if m is None and s is None:
                    yield name, tensor
                    continue
                layer = int((m or s).group(1))
                if layer not in experts:
                    raise ValueError(f"checkpoint tensor {hf_name!r}: layer {layer} has no routed experts")
                ex = experts[layer]
                if m is not None:
                    proj = self._EXPERT_PROJ.get(m.group(3))
                    if proj is None:
                        raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter")
                    pairs = [(int(m.group(2)), proj, tensor)]
                elif s.group(2) == "gate_up_proj":  # transformers' stacked [E, 2I, H]
                    pairs = [(e, p, half) for e in range(tensor.shape[0])
                             for p, half in zip(("gate", "up"), tensor[e].chunk(2, dim=0), strict=True)]
                else:
                    pairs = [(e, "down", tensor[e]) for e in range(tensor.shape[0])]
                for e, proj, t in pairs:
                    dst = ex.expert_weight(e, proj)
                    if dst is not None:
                        copy(dst, t, f"{hf_name} (expert {e} {proj})")
                    loaded.add((layer, e, proj))

        super().load_weights(rest())
        for layer, ex in experts.items():
            missing = [(e, p) for e in ex.held_experts for p in ("gate", "up", "down") if (layer, e, p) not in loaded]
            if missing:
                raise ValueError(f"checkpoint is missing layer {layer}'s expert tensors, e.g. {missing[:3]}")
