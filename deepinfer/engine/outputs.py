"""What the engine returns, shaped like vLLM's outputs so users can switch.

`RequestOutput` / `CompletionOutput` are API-facing (built by `output_processor.OutputProcessor`): the whole
text, token ids and logprobs so far, and what is new since the request's previous output (`delta_text`,
`delta_token_ids`), so that streaming handlers send deltas without diffing. `TokenDelta` is what the
engine's token side emits per step and sequence: token ids and raw logprobs, never text."""

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
    # what this output adds to the request's previous one: text (`text` ends with it) and token ids
    # (`token_ids` ends with them; their logprobs are the last len(delta_token_ids) entries of `logprobs`)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

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
    # cached prompt tokens whose sliding-window KV was recomputed (SWA bounded replay; config.swa_replay_tokens)
    num_replayed_tokens: int = 0
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (vLLM's shape)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # requests added with `stream_kv`: (block hash, payload) of the prompt's full blocks whose KV was
    # computed since the previous output, in chain order (an output may carry only these, no new token)
    kv_blocks: list | None = None


@dataclass(slots=True)
class TokenDelta:
    """One step's news about one sequence (a request's only sequence, or one of its n > 1 children), from
    the engine's token side to the output processor; small and plain, as it may cross a process pipe."""

    seq_id: str
    new_token_ids: list[int]
    new_logprobs: list | None = None  # sampler.TokenLogprobs per new token, when the request asked for logprobs
    finish_reason: str | None = None  # "stop" | "length" | "abort", once the engine finished the sequence
    stop_reason: int | str | None = None  # the stop token id that ended it
    error: str | None = None
    # prompt tokens served from the prefix cache: (total, device, host, store, of them replayed for the
    # sliding-window layers); None until scheduled
    num_cached: tuple[int, int, int, int, int] | None = None
    first_scheduled: float | None = None  # time.monotonic() of its first step
    prompt_logprobs: list | None = None  # TokenLogprobs per prompt token (None for the first), once, when complete
    kv_blocks: list | None = None  # stream_kv: (block hash, bytes) computed since the previous delta
    # speculative decoding, the sequence's totals so far: (verification steps, draft tokens, accepted tokens)
    spec: tuple[int, int, int] | None = None
