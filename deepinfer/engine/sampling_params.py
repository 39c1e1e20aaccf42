"""Per-request sampling parameters, validated on construction (vLLM-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.engine.structured import StructuredOutputParams


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature == 0` is greedy. Penalties follow OpenAI (presence / frequency, on
    generated tokens) and HF (repetition, on prompt and generated tokens). `logprobs=k`
    returns the sampled token's log-probability and the k most likely alternatives, from
    the model's raw distribution (before penalties and temperature); `prompt_logprobs=k` the
    same for each prompt token after the first.

    `structured_output` constrains the output to a JSON schema, JSON object, regex or EBNF
    grammar (see `StructuredOutputParams`). `logit_bias` maps token ids to values in [-100, 100]
    added to their logits before sampling (OpenAI semantics; -100 effectively bans, 100 forces).
    `allowed_token_ids` (vLLM's): only these tokens may be generated (with a grammar, only those of
    them it allows). `bad_words` (vLLM's): words that are never generated; a word of several tokens is
    stopped at its last one (that token is banned after the others).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # log-probabilities of the prompt's tokens (each given the tokens before it) and the k most likely
    # alternatives at each position; the first prompt token has none. Such a request does not reuse
    # cached prefix blocks: their positions' logits would never be computed.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_output: StructuredOutputParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # bad_words as token sequences, both spellings of each word (with and without a leading space); the engine
    # fills it from its tokenizer (`recipe.tokenizer.bad_word_sequences`) when a request arrives
    bad_words_token_ids: list[list[int]] | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"invalid sampling parameter: {msg}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad(f"top_k must be 0 or -1 (disabled) or a positive integer, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop strings must be non-empty strings")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutputParams):
            raise bad("structured_output must be a StructuredOutputParams")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias must map token ids to numbers")
            for tid, value in self.logit_bias.items():
                if not isinstance(tid, int) or isinstance(tid, bool) or tid < 0:
                    raise bad(f"logit_bias keys must be token ids (integers >= 0), got {tid!r}")
                if not isinstance(value, int | float) or isinstance(value, bool) or not -100 <= value <= 100:
                    raise bad(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {tid}")

        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list | tuple) or not ids or any(
                    not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
                raise bad("allowed_token_ids must be a non-empty list of token ids (integers >= 0)")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not isinstance(self.bad_words, list | tuple) or any(
                    not isinstance(w, str) or not w.strip() for w in self.bad_words):
                raise bad("bad_words must be a list of non-blank strings")
            self.bad_words = list(self.bad_words)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
