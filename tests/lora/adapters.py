"""Random LoRA adapters written by peft itself (`save_pretrained`), and peft's model of a base model with one:
the reference the LoRA tests compare against."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _load(base: Path, vision: bool):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_pretrained(str(base),
                                                                                             dtype=torch.float32)


def write_adapter(base: Path, out: Path, targets: list[str] | str, rank: int, alpha: float, seed: int,
                  rslora: bool = False, std: float = 0.15, vision: bool = False) -> Path:
    """A LoRA adapter of `base` (a vision-language model with `vision`) on the `targets` projections (names, or
    peft's regex form) with random A and B (peft starts B at zero, which changes nothing), saved by peft to `out`."""
    from peft import LoraConfig, get_peft_model

    model = _load(base, vision)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, use_rslora=rslora)
    peft = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    peft.save_pretrained(str(out))
    return out


def peft_model(base: Path, adapter: Path, stop_at_eos: bool = False, vision: bool = False):
    """peft's model of `base` with `adapter` (not merged: peft's own LoRA forward), float32; EOS stops its
    generation only with `stop_at_eos`."""
    from peft import PeftModel

    model = _load(base, vision)
    if not stop_at_eos:
        model.generation_config.eos_token_id = None
    return PeftModel.from_pretrained(model, str(adapter)).eval()
