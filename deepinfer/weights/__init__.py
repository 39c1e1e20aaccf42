"""Model resolution and weight loading: HF safetensors directories and GGUF files."""

from deepinfer.weights.loader import ModelFiles, default_model_path, resolve_model

__all__ = ["ModelFiles", "default_model_path", "resolve_model"]
