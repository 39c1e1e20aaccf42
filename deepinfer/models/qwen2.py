"""Qwen2: the Llama layout with biases on the Q/K/V projections (its configs carry no `attention_bias`)."""

from deepinfer.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    attn_bias_default = True
