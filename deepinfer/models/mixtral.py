"""Mixtral: Mistral's attention (a sliding window on every layer when `sliding_window` is set: one
`SlidingWindow` KV group) with a mixture of experts on every layer (`block_sparse_moe`).

The router is transformers' `MixtralTopKRouter`: softmax over all `num_local_experts` in float32, top
`num_experts_per_tok`, always renormalised (the softmax over the top-k logits, computed this way), the
weights kept in float32: a bf16 model scales its expert outputs in float32 and rounds after.
Checkpoint names: `block_sparse_moe.gate`, `block_sparse_moe.experts.E.w1` (gate) / `w3` (up) / `w2` (down).
"""

from deepinfer.models.sparse_moe import SparseMoeForCausalLM


class MixtralForCausalLM(SparseMoeForCausalLM):
    float32_weights = True
    _EXPERT_PROJ = {"w1": "gate", "w3": "up", "w2": "down", **SparseMoeForCausalLM._EXPERT_PROJ}

    def num_experts(self, cfg) -> int:
        return cfg.num_local_experts

    def _rename(self, name: str) -> str:
        return name.replace(".block_sparse_moe.", ".mlp.")
