"""The offline API: `LLM(model).generate(prompts, params)` and `.chat(messages, params)`, like vLLM's."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from deepinfer.config import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.ep_engine import ExpertParallelEngine
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.lora import LoRARequest
from deepinfer.multimodal.inputs import MultiModalInputs
from deepinfer.multimodal.processor import MultiModalProcessor, split_images
from deepinfer.recipe.tokenizer import render_chat, render_chat_text
from deepinfer.vllm_cli import split_vllm_kwargs

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """Load a model and run batches of prompts to completion.

    `model` is None (the default SmolLM2-135M-Instruct GGUF), an HF directory or a .gguf
    file; other keyword arguments are engine settings (see `deepinfer.config`), e.g.
    `dtype`, `max_model_len`, `max_num_seqs`, `max_num_batched_tokens`, `kv_cache_memory`,
    `enable_prefix_caching`, `block_size`, `seed`. vLLM's engine arguments without a setting here
    (`tensor_parallel_size=1`, `gpu_memory_utilization`, `enforce_eager`, `trust_remote_code`, ...) are
    accepted where they change nothing and refused where they would (`deepinfer/vllm_cli.py`).

    KV tiers: `host_cache_memory` (e.g. "2GiB") adds a host-memory tier; `kv_store` (a directory)
    persists KV blocks across runs and processes. Unlike `deepinfer serve`, the offline API keeps
    no store unless given one (`kv_store="auto"` for the default directory): a library call should
    not write gigabytes under the user's cache directory as a side effect. Store writes happen in
    the background; `close()` (or leaving a `with LLM(...)` block) waits for them.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("kv_store", "none")
        kwargs, notes = split_vllm_kwargs(kwargs)
        for note in notes:
            logger.warning(note)
        config = EngineConfig.from_kwargs(model=model, **kwargs)
        # expert_parallel_size > 1: the ranks are processes behind one client (`ExpertParallelEngine`)
        self.ranks: ExpertParallelEngine | None = None
        if config.parallel.expert_parallel_size > 1:
            self.ranks = ExpertParallelEngine(config)
            self.engine = None
        else:
            self.engine = LLMEngine(config)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Finish pending KV store writes and release the KV tiers."""
        if self.ranks is not None:
            self.ranks.shutdown()
        else:
            self.engine.close()

    def get_tokenizer(self):
        return (self.ranks or self.engine).tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no SamplingParams: the model's generation_config.json
        defaults (`generation_config`, as vLLM's method of this name returns them), else SamplingParams'."""
        defaults = (self.ranks or self.engine).sampling_defaults
        return SamplingParams(**defaults)

    def stats(self) -> dict:
        """The engine's (or the merged ranks') stats snapshot, as /metrics reads it."""
        return (self.ranks or self.engine).stats()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 cache_salt: str | None = None, retention_class: str | None = None, *, use_tqdm: bool = False,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Prompts are strings, token-id lists, or `{"prompt_token_ids": [...]}` / `{"prompt": "..."}`; a
        vision-language model takes vLLM's `{"prompt": "... <image> ...", "multi_modal_data": {"image": img}}`
        (a PIL image, a data: / http(s) URL, or a list of them: one per image marker, in order).
        `retention_class` names how long the KV store keeps the blocks (default: `default_retention_class`).
        vLLM's keywords: `use_tqdm` shows a progress bar of finished prompts; `lora_request` (one for every
        prompt, or one per prompt, None for the base model; `LLM(enable_lora=True)`) runs them with a LoRA adapter;
        a non-zero `priority` is refused (first-come-first-served scheduling)."""
        _refuse_unsupported(priority)
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params or self.get_default_sampling_params()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, Sequence) and not isinstance(lora_request, str) \
            else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        if self.ranks is not None:
            if any(lr is not None for lr in loras):
                raise ValueError("lora_request: LoRA adapters do not combine with expert parallelism yet")
            return self._generate_on_ranks(prompts, params_list, cache_salt, retention_class)
        # validate everything before starting anything, so a bad prompt fails the call cleanly
        validator = self.engine.validator
        with_images = [self._with_images(p) for p in prompts]
        tokenized = [t if t is not None else self.engine.tokenize(self._prompt_of(p))
                     for p, (t, _) in zip(prompts, with_images, strict=True)]
        for t, sp in zip(tokenized, params_list, strict=True):
            validator.check_prompt(t)
            validator.check_params(sp)
        retention_class = validator.check_retention(retention_class)
        # compile every grammar first (in parallel, cached for the engine): a bad one fails the call here
        compiling = [self.engine.compile_grammar(sp.structured_output) for sp in params_list
                     if sp.structured_output is not None]
        for future in compiling:
            future.result()
        for lr in {id(lr): lr for lr in loras if lr is not None}.values():  # an unknown adapter fails here too
            self.engine.resolve_adapter(lr)
        ids = [self.engine.add_request(self._prompt_of(p), sp, cache_salt=cache_salt, prompt_token_ids=t,
                                       retention_class=retention_class, validated=True, stream=False,
                                       multi_modal=mm, lora_request=lr)
               for p, t, sp, (_, mm), lr in zip(prompts, tokenized, params_list, with_images, loras, strict=True)]
        return self._run(ids, use_tqdm)

    def _with_images(self, p: PromptType) -> tuple[list[int] | None, MultiModalInputs | None]:
        """(token ids, images) of a prompt dict with `multi_modal_data` (or made by `chat`); (None, None) else."""
        if not isinstance(p, dict):
            return None, None
        if "multi_modal" in p:  # `chat`'s prompts: already through the processor
            return list(p["prompt_token_ids"]), p["multi_modal"]
        data = p.get("multi_modal_data")
        if not data:
            return None, None
        if set(data) != {"image"}:
            raise ValueError(f"multi_modal_data takes 'image' only, got {sorted(data)}")
        if not isinstance(p.get("prompt"), str):
            raise ValueError("a prompt with multi_modal_data needs its text as 'prompt' (with an image marker "
                             "per image)")
        processor = self._multimodal_processor()
        images = data["image"] if isinstance(data["image"], list) else [data["image"]]
        return processor(p["prompt"], images, add_special_tokens=True)

    def _multimodal_processor(self) -> MultiModalProcessor:
        processor = self.engine.multimodal_processor
        if processor is None:
            raise ValueError(f"{type(self.engine.core.runner.model).__name__} takes no images")
        return processor

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
             chat_template: str | None = None, continue_final_message: bool = False, *, use_tqdm: bool = False,
             lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """`chat_template`: Jinja text used instead of the model's (needed for models without one).
        `continue_final_message` (with `add_generation_prompt=False`): the output continues the last
        message, e.g. an assistant prefill, as in vLLM. `use_tqdm`, `lora_request`: as in `generate`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conv in conversations:
            conv, images = split_images(conv)
            if not images:
                prompts.append(render_chat(tok, conv, add_generation_prompt, tools, chat_template,
                                           continue_final_message=continue_final_message,
                                           **(chat_template_kwargs or {})))
                continue
            text = render_chat_text(tok, conv, add_generation_prompt, tools, chat_template,
                                    continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
            ids, mm = self._multimodal_processor()(text, images)
            prompts.append({"prompt_token_ids": ids, "multi_modal": mm})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _generate_on_ranks(self, prompts: list[PromptType], params_list: list[SamplingParams],
                           cache_salt: str | None, retention_class: str | None) -> list[RequestOutput]:
        """Expert parallelism: every prompt through the ranks' client at once; the final outputs in order."""
        client = self.ranks
        tok = client.tokenizer
        tokenized = []
        for p in prompts:
            prompt = self._prompt_of(p)
            if isinstance(prompt, str):
                if tok is None:
                    raise ValueError("this model has no tokenizer; pass token ids")
                prompt = list(tok.encode(prompt, add_special_tokens=True))
            client.validator.check_prompt(prompt)
            tokenized.append(prompt)
        for sp in params_list:
            client.validator.check_params(sp)

        async def one(ids: list[int], sp: SamplingParams, text: str | None) -> RequestOutput:
            last = None
            async for out in client.generate(ids, sp, prompt=text, cache_salt=cache_salt,
                                             retention_class=retention_class):
                last = out
            return last

        async def run_all() -> list[RequestOutput]:
            return list(await asyncio.gather(*(
                one(ids, sp, p if isinstance(p, str) else None)
                for ids, sp, p in zip(tokenized, params_list, (self._prompt_of(p) for p in prompts), strict=True))))

        return asyncio.run(run_all())

    def _run(self, ids: list[str], use_tqdm: bool = False) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="prompt")
        try:
            with self.engine.closed_batch():
                while len(final) < len(ids):
                    for out in self.engine.step():
                        if out.finished:
                            final[out.request_id] = out
                            if bar is not None:
                                bar.update(1)
                    if not self.engine.core.has_unfinished() and len(final) < len(ids):
                        raise RuntimeError("engine stopped with unfinished requests")
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[rid] for rid in ids]

    @staticmethod
    def _prompt_of(p: PromptType) -> str | list[int]:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                return list(p["prompt_token_ids"])
            if "prompt" in p:
                return p["prompt"]
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return p


def _refuse_unsupported(priority: Sequence[int] | None) -> None:
    """vLLM's `generate` keywords that would change the result and that deepinfer does not implement."""
    if priority is not None and any(p != 0 for p in priority):
        raise ValueError("priority: requests are scheduled first come, first served; only 0 is accepted")
