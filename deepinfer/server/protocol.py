"""Request bodies of the OpenAI-compatible API (pydantic), and the error type handlers raise.

Unknown fields are accepted and ignored, as OpenAI clients send fields servers may not
know. Values are range-checked by `SamplingParams`; problems become `APIError(400)`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class APIError(Exception):
    """An error with an HTTP status, rendered as {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class Lenient(BaseModel):
    """A request body: unknown fields are kept and ignored, and an optional field sent as `null` takes its
    default (OpenAI's schemas make optional fields nullable, and clients send `"n": null` for "not set")."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if not (v is None and k in fields and not fields[k].is_required())}


class StreamOptions(Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: earlier calls
    tool_call_id: str | None = None  # tool: the call this result answers


class SamplingFields(Lenient):
    """Fields shared by chat and completion requests."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None  # None: the model's default (--generation-config), else 1
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    # retention class of the KV blocks this request leaves in the store (else the x-cache-retention header,
    # else the server default)
    prompt_cache_retention: str | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured output and biases: mapped onto SamplingParams by server/structured_fields.py
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's extras: only these tokens may be generated; words never generated; the prompt's logprobs
    # (`prompt_logprobs` in the response); keep only the prompt's last N tokens
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # vLLM's: render the final message open, so the reply continues it (assistant prefill)
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: passed to the chat template, for templates that render retrieved documents (RAG)
    documents: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(Lenient):
    """vLLM's POST /v1/load_lora_adapter body."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(Lenient):
    """vLLM's POST /v1/unload_lora_adapter body (its `lora_int_id` is accepted and not used)."""

    lora_name: str = Field(min_length=1)
