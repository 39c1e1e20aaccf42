"""Qwen2: the Llama layout with biases on the Q/K/V projections."""

from deepinfer.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    attn_bias_default = True

    def __init__(self, cfg, backend, max_positions, dtype) -> None:
        # Qwen2 configs carry no `attention_bias`; Q/K/V always have biases, O never does.
        cfg.attention_bias = True
        super().__init__(cfg, backend, max_positions, dtype)
