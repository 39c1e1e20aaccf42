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


def bad_word_sequences(tokenizer, words: list[str]) -> list[list[int]]:
    """The token sequences that spell `words` in generated text: each word as it starts a text and after a
    space (BPE tokenizers give the two different tokens), duplicates removed."""
    out: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return out


# generation_config.json keys -> SamplingParams fields: what vLLM and SGLang take from a model's generation config
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(spec: str, model_dir: Path) -> dict[str, float | int]:
    """The sampling parameters a model's creator recommends, for requests that leave them unset (`--generation-config`):
    `auto` reads the model directory's generation_config.json, `vllm` none (OpenAI's defaults), anything else is a
    directory holding a generation_config.json."""
    if spec == "vllm":
        return {}
    path = (model_dir if spec == "auto" else Path(spec).expanduser()) / "generation_config.json"
    if not path.is_file():
        if spec != "auto":
            raise FileNotFoundError(f"--generation-config {spec}: no generation_config.json there")
        return {}
    config = json.loads(path.read_text())
    return {field: config[key] for key, field in _GENERATION_DEFAULTS.items()
            if isinstance(config.get(key), int | float) and not isinstance(config.get(key), bool)}


class NoChatTemplate(ValueError):
    """A chat request for a model without a chat template (base models, e.g. a Gemma 3 GGUF)."""

    def __init__(self) -> None:
        super().__init__("this model has no chat template: start the server with --chat-template FILE (a Jinja "
                         "chat template for this model), or send a completion prompt (/v1/completions)")


def read_chat_template(spec: str) -> str:
    """`--chat-template`: a file holding a Jinja chat template, or the template text itself (as in vLLM)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in spec or "{%" in spec:
        return spec
    raise FileNotFoundError(f"chat template {spec!r} is neither a file nor a Jinja template")


def use_chat_template(tokenizer, spec: str | None) -> None:
    """Install `--chat-template` on a tokenizer (replacing the model's own, if it has one): every chat
    rendering, tool-support and reasoning detection then reads it from `tokenizer.chat_template`."""
    if spec is None:
        return
    if tokenizer is None:
        raise ValueError("--chat-template needs a model with a tokenizer")
    tokenizer.chat_template = read_chat_template(spec)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, chat_template: str | None = None,
                continue_final_message: bool = False, **template_kwargs: Any) -> list[int]:
    """Apply the chat template (`chat_template`, else the tokenizer's) and return prompt token ids;
    `NoChatTemplate` (a ValueError) when there is none. `continue_final_message`: the last message is
    left open (no end-of-turn after it), so generation continues it: an assistant prefill. It excludes
    `add_generation_prompt` (ValueError)."""
    out = _apply_template(tokenizer, messages, add_generation_prompt, tools, chat_template, continue_final_message,
                          True, template_kwargs)
    if isinstance(out, dict) or hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


def render_chat_text(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                     tools: list[dict] | None = None, chat_template: str | None = None,
                     continue_final_message: bool = False, **template_kwargs: Any) -> str:
    """`render_chat`'s prompt as text (a vision-language model's processor tokenizes it with its images)."""
    return _apply_template(tokenizer, messages, add_generation_prompt, tools, chat_template, continue_final_message,
                           False, template_kwargs)


def _apply_template(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None,
                    chat_template: str | None, continue_final_message: bool, tokenize: bool,
                    template_kwargs: dict[str, Any]) -> Any:
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise NoChatTemplate()
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, tokenize=tokenize,
                                         chat_template=template, **template_kwargs)
