"""Qwen3 (dense): the Llama layout with per-head RMSNorm on queries and keys, explicit head_dim."""

from deepinfer.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
