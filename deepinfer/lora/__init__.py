"""LoRA adapters served beside their base model: PEFT adapter directories read (`adapter`), applied to the
projections of every step's rows that run with them (`layers`), and named, loaded and evicted per engine
(`manager`)."""

from deepinfer.lora.adapter import AdapterWeights, LoRARequest, read_adapter
from deepinfer.lora.manager import LoadedAdapter, LoRAManager

__all__ = ["AdapterWeights", "LoRAManager", "LoRARequest", "LoadedAdapter", "read_adapter"]
