"""What the engine returns, shaped like vLLM's outputs so users can switch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # set when the engine ended it early (finish_reason "abort"), e.g. a bad grammar

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (every tier)
    # the same split by where they were found: {"device": .., "host": .., "store": ..}
    num_cached_tokens_by_tier: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "store": 0})
    metrics: dict = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (vLLM's shape)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # requests added with `stream_kv`: (block hash, payload) of the prompt's full blocks whose KV was
    # computed since the previous output, in chain order (an output may carry only these, no new token)
    kv_blocks: list | None = None
