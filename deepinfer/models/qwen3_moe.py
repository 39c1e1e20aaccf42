"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with mixture-of-experts layers.

A layer is sparse unless it is in `mlp_only_layers` or (layer + 1) is not a multiple of
`decoder_sparse_step`; dense layers use `intermediate_size`, experts `moe_intermediate_size`. The router is
a softmax over all experts (float32), top `num_experts_per_tok`, renormalised when `norm_topk_prob`, the
weights cast back to the model dtype (transformers' `Qwen3MoeTopKRouter`). No shared expert.
"""

from deepinfer.models.sparse_moe import SparseMoeForCausalLM


class Qwen3MoeForCausalLM(SparseMoeForCausalLM):
    qk_norm = True
    float32_weights = False

    def num_experts(self, cfg) -> int:
        return cfg.num_experts

    def is_sparse(self, cfg, layer: int) -> bool:
        return (layer not in (getattr(cfg, "mlp_only_layers", None) or []) and cfg.num_experts > 0
                and (layer + 1) % cfg.decoder_sparse_step == 0)

    def renormalize(self, cfg) -> bool:
        return bool(cfg.norm_topk_prob)

    def expert_intermediate(self, cfg) -> int:
        return cfg.moe_intermediate_size
