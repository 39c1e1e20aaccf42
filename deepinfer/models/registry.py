"""Maps HF architecture names to model classes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from deepinfer.layers.attention import AttentionBackend
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.models.gemma3 import Gemma3ForCausalLM
from deepinfer.models.gemma3_vlm import Gemma3ForConditionalGeneration
from deepinfer.models.idefics3 import Idefics3ForConditionalGeneration
from deepinfer.models.llama import LlamaForCausalLM
from deepinfer.models.mixtral import MixtralForCausalLM
from deepinfer.models.qwen2 import Qwen2ForCausalLM
from deepinfer.models.qwen3 import Qwen3ForCausalLM
from deepinfer.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[torch.nn.Module]] = {
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "SmolVLMForConditionalGeneration": Idefics3ForConditionalGeneration,
}


def _model_class(hf_config) -> type[torch.nn.Module] | None:
    archs = list(getattr(hf_config, "architectures", None) or [])
    return next((MODEL_REGISTRY[a] for a in archs if a in MODEL_REGISTRY), None)


def image_facts(hf_config) -> tuple[int, int] | None:
    """(image token id, placeholder tokens per image tile) of a vision-language checkpoint; None for a text model."""
    facts = getattr(_model_class(hf_config), "image_facts", None)
    return facts(hf_config) if facts is not None else None


def image_encoder_class(hf_config) -> type[torch.nn.Module]:
    """The vision half of a vision-language checkpoint's model, which builds and loads without the text model (an
    encode worker's); ValueError for a text model."""
    cls = getattr(_model_class(hf_config), "image_encoder_class", None)
    if cls is None:
        raise ValueError(f"{getattr(hf_config, 'architectures', None)} is not a vision-language model: it has no "
                         "vision tower to encode images with")
    return cls


def build_image_encoder(hf_config, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """`image_encoder_class(hf_config)`, built (its weights still to load: `load_weights`)."""
    cls = image_encoder_class(hf_config)
    with torch.device(device), no_random_init():
        return cls(hf_config).to(dtype=dtype).eval()


def text_config(hf_config):
    """The language model's config: a vision-language checkpoint's `text_config`, else the config itself."""
    return hf_config.get_text_config()


# the torch.nn.init functions modules' constructors draw random initial weights with
_RANDOM_INITS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                 "xavier_normal_", "orthogonal_")


@contextlib.contextmanager
def no_random_init() -> Iterator[None]:
    """Modules built inside keep their parameters as allocated, not drawn at random: a checkpoint overwrites every
    one (`load_weights` refuses one left out), and the draws cost 0.9-1.7 s of the default model's start-up. The
    idea of transformers' `no_init_weights`, written here because importing that one loads
    `transformers.modeling_utils`, torch._dynamo and triton into every engine process (~3.7 s here)."""
    saved = {name: getattr(torch.nn.init, name) for name in _RANDOM_INITS}
    try:
        for name in _RANDOM_INITS:
            setattr(torch.nn.init, name, _keep)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _keep(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def build_model(hf_config, backend: AttentionBackend, max_positions: int, dtype: torch.dtype,
                device: torch.device) -> torch.nn.Module:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            cls = MODEL_REGISTRY[arch]
            break
    else:
        raise ValueError(
            f"unsupported model architecture {archs or '(none in config.json)'}; "
            f"supported: {', '.join(supported_architectures())}"
        )
    with torch.device(device), no_random_init():
        model = cls(hf_config, backend, max_positions, dtype)
    return model.to(dtype=dtype)
