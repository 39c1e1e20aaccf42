"""DeepSeek-V4: hybrid sliding / compressed-sparse / heavily-compressed attention, mHC, hash and top-k MoE."""

from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM

__all__ = ["DeepseekV4ForCausalLM"]
