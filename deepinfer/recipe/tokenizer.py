"""Tokenizer loading and chat-template rendering (transformers does the work)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deepinfer.weights import ModelFiles


def load_tokenizer(files: ModelFiles):
    if not files.has_tokenizer():
        raise FileNotFoundError(f"{files.directory} has no tokenizer files (tokenizer.json / tokenizer_config.json)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(files.directory))


def eos_token_ids(tokenizer, hf_config, directory: Path) -> frozenset[int]:
    """Every id that ends generation: config, generation_config.json and the tokenizer's EOS."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(hf_config, "eos_token_id", None))
    gen = directory / "generation_config.json"
    if gen.is_file():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return frozenset(ids)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, **template_kwargs: Any) -> list[int]:
    """Apply the model's chat template and return prompt token ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use a completion prompt instead")
    out = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        tokenize=True, **template_kwargs)
    if isinstance(out, dict) or hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)
