"""Model families, registered by the HF `architectures` name in config.json."""

from deepinfer.models.registry import MODEL_REGISTRY, build_model, supported_architectures

__all__ = ["MODEL_REGISTRY", "build_model", "supported_architectures"]
