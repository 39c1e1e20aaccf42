"""One request validator for every entry path.

    server handlers ─▶ EngineClient.generate ─┐
    offline LLM.generate ─────────────────────┤
    LLMEngine.add_request (direct callers) ───┼─▶ RequestValidator.validate ─▶ queued (never re-checked)
    cluster router (ClusterEngineClient) ─────┘

A request is checked once, where it enters, against the facts of the model that will serve it: the
prompt (non-empty, token ids in the vocabulary, room for at least one generated token within
`max_model_len`), the sampling parameters (logit_bias ids in the vocabulary, a tokenizer for structured
output), the KV retention class, and an `output_prefix` (tokens another worker generated). What passes is
handed on as validated: `LLMEngine.add_request(..., validated=True)`, which the engine process and the
server's engine thread use, does not check it again.

`max_tokens_for` is the API's context-length rule (prompt + max_tokens within `max_model_len`, the default
max_tokens filling the rest); the offline API keeps its own behaviour (a long max_tokens stops at the
context's end). Grammars are compiled once, on the cache of whoever runs the engine (`EngineClient.
compile_grammar`); the validator only checks that one can be compiled at all (a tokenizer).

Errors are `RequestError`, a ValueError carrying the request field (`param`) and OpenAI's error `code`,
so the HTTP layer answers them as 400 in its usual shape.
"""

from __future__ import annotations

from collections.abc import Callable

from deepinfer.engine.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request this model cannot serve (HTTP 400). `param`: the request field at fault, if known;
    `code`: OpenAI's error code (e.g. "context_length_exceeded")."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class RequestValidator:
    """Checks requests against one model's limits. `max_model_len` may be a callable (a router's
    context length is the smallest of its live workers'); `check_retention` resolves a KV retention class
    name to the class used (ValueError if unknown)."""

    def __init__(self, vocab_size: int, max_model_len: int | Callable[[], int], has_tokenizer: bool,
                 check_retention: Callable[[str | None], str] | None = None) -> None:
        self.vocab_size = vocab_size
        self._max_model_len = max_model_len
        self.has_tokenizer = has_tokenizer
        self._check_retention = check_retention

    @property
    def max_model_len(self) -> int:
        m = self._max_model_len
        return m() if callable(m) else m

    # ------------------------------------------------------------------ the checks

    def check_prompt(self, prompt_ids: list[int], param: str | None = None) -> None:
        """RequestError unless `prompt_ids` is a non-empty prompt of in-vocabulary ids that leaves room for
        at least one generated token."""
        if not prompt_ids:
            raise RequestError("the prompt is empty", param)
        vocab = self.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is out of range [0, {vocab})", param)
        max_len = self.max_model_len
        if len(prompt_ids) >= max_len:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens, but the maximum context length is "
                f"{max_len} tokens (prompt + at least one generated token)", param, "context_length_exceeded")

    def check_params(self, params: SamplingParams) -> None:
        """RequestError for sampling parameters this model cannot honour: logit_bias or allowed token ids
        outside its vocabulary, structured output without a tokenizer. (SamplingParams validates itself on
        construction: ranges, types.)"""
        for field, ids in (("logit_bias", params.logit_bias or {}),
                           ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise RequestError(f"{field} token id {bad} is out of range [0, {self.vocab_size})", field)
        if params.structured_output is not None and not self.has_tokenizer:
            raise RequestError("structured output needs a tokenizer; this model has none")
        if params.bad_words and params.bad_words_token_ids is None and not self.has_tokenizer:
            raise RequestError("bad_words needs a tokenizer; this model has none", "bad_words")

    def check_retention(self, retention_class: str | None) -> str | None:
        """The retention class a request naming `retention_class` gets (ValueError if unknown)."""
        if self._check_retention is None:
            return retention_class
        return self._check_retention(retention_class)

    def check_output_prefix(self, prompt_len: int, params: SamplingParams, output_prefix: list[int] | None,
                            prefix_logprobs: list | None, stream_kv: bool = False) -> None:
        """Tokens generated elsewhere that a request continues after (see `LLMEngine.add_request`)."""
        if (output_prefix or stream_kv) and params.n != 1:
            raise RequestError("output_prefix and stream_kv need n == 1")
        if not output_prefix:
            return
        if params.logprobs is not None and len(prefix_logprobs or ()) != len(output_prefix):
            raise RequestError("a request with logprobs needs prefix_logprobs for every output_prefix token")
        if prompt_len + len(output_prefix) >= self.max_model_len:
            raise RequestError("the prompt and output prefix fill the context", code="context_length_exceeded")

    def validate(self, prompt_ids: list[int], params: SamplingParams, retention_class: str | None = None,
                 output_prefix: list[int] | None = None, prefix_logprobs: list | None = None,
                 stream_kv: bool = False) -> str | None:
        """Every check a request must pass before it is queued; returns the resolved retention class."""
        self.check_prompt(prompt_ids)
        self.check_params(params)
        self.check_output_prefix(len(prompt_ids), params, output_prefix, prefix_logprobs, stream_kv)
        return self.check_retention(retention_class)

    def max_tokens_for(self, prompt_len: int, max_tokens: int | None, param: str) -> int:
        """The API's context rule for this model (see `context_max_tokens`)."""
        return context_max_tokens(prompt_len, max_tokens, self.max_model_len, param)


def context_max_tokens(prompt_len: int, max_tokens: int | None, max_model_len: int, param: str) -> int:
    """The API's rule: the effective max_tokens of a prompt of `prompt_len` tokens (the rest of the context
    when None); RequestError if the prompt, or prompt + max_tokens, does not fit in `max_model_len`.
    `param` names the prompt's request field (messages, prompt, input)."""
    max_len = max_model_len
    if prompt_len >= max_len:
        raise RequestError(f"This model's maximum context length is {max_len} tokens. However, your "
                           f"prompt has {prompt_len} tokens. Please reduce the length of the {param}.",
                           param, "context_length_exceeded")
    if max_tokens is None:
        return max_len - prompt_len
    if max_tokens < 1:
        raise RequestError(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if prompt_len + max_tokens > max_len:
        raise RequestError(f"This model's maximum context length is {max_len} tokens. However, you "
                           f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {param}, "
                           f"{max_tokens} in the completion). Please reduce the length of the {param} "
                           f"or completion.", "max_tokens", "context_length_exceeded")
    return max_tokens
