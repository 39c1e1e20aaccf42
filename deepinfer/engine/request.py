"""One sequence's state through the engine.

    WAITING ──schedule──▶ RUNNING ──stop / length──▶ FINISHED_*
       ▲                     │
       └──── PREEMPTED ◀─────┘  (blocks freed; recomputed from its tokens later)
    any state ──abort──▶ FINISHED_ABORTED
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from deepinfer.engine.grammar import RequestGrammar
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.multimodal.inputs import EncodedTiles, MultiModalInputs

if TYPE_CHECKING:
    from deepinfer.engine.spec.policy import AcceptanceStats
    from deepinfer.lora import LoadedAdapter


class PendingLoad(NamedTuple):
    """Tier hits a request was admitted with, not yet in its device blocks (see `KVCacheManager`)."""

    first_block: int  # block-table index (= chain position) of the first block to load
    num_blocks: int
    first_admission: bool  # whether what loads counts as the request's cached prompt tokens
    # block hash -> (payload, tier) staged in host memory by a prefetch (`kvcache.prefetch`); None: read the tiers
    staged: dict[bytes, tuple[Any, str]] | None = None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


class Request:
    """Token state of one sequence. `token_ids` is prompt + generated so far."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: frozenset[int] = frozenset(), cache_salt: str | None = None,
                 max_tokens: int | None = None, arrival_time: float | None = None,
                 wait_for: Request | None = None, retention_class: str | None = None,
                 grammar: RequestGrammar | None = None, cache_tenant: str | None = None,
                 multi_modal: MultiModalInputs | None = None, lora: LoadedAdapter | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.cache_salt = cache_salt
        self.cache_tenant = cache_tenant  # the authenticated tenant's cache namespace (never client-chosen)
        self.retention_class = retention_class  # how long the store keeps its blocks; None: the default
        # limit on generated tokens; None: until EOS or the context is full
        self.max_tokens = params.max_tokens if max_tokens is None else max_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # tokens whose KV a *finished* step wrote (num_computed_tokens runs ahead while a step launched
        # ahead is still running); a preemption lowers num_computed_tokens below it again
        self.num_kv_done_tokens = 0
        # sampled by a launched step but not yet appended (the engine may schedule the next step first)
        self.num_pending_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served from the prefix cache; set at first schedule
        # ... of which found on the device, in the host tier, in the store (sum = num_cached_tokens)
        self.num_cached_device = 0
        self.num_cached_host = 0
        self.num_cached_store = 0
        # bounded replay (kvcache/manager.py): positions < replay_end recompute the sliding groups only
        # (the full groups hold them); sliding-window attention sees no key before kv_floor
        self.replay_end = 0
        self.kv_floor = 0
        self.num_replayed_tokens = 0
        self.pending_load: PendingLoad | None = None
        # (device blocks, lookup limit, host blocks, store blocks) of the last tier lookup while waiting
        self.tier_lookup: tuple[int, int, int, int] | None = None
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.stop_reason: int | str | None = None
        self.block_hashes: list[bytes] = []  # chained hashes of this request's full blocks
        # n > 1: siblings wait until the first sibling's prompt is in the prefix cache, then share it.
        self.wait_for = wait_for
        # structured output: compiled off the engine loop; the request waits (unscheduled) until it is
        self.grammar = grammar
        self.error: str | None = None  # why the engine ended it early (e.g. its grammar failed to compile)
        # params.prompt_logprobs: entry i is prompt token i's, written by the runner as its prefill computes
        # position i - 1 (a recompute after preemption writes the same entries again); entry 0 stays None
        self.prompt_logprobs: list | None = (
            [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None)
        self.spec: AcceptanceStats | None = None  # speculative decoding: acceptance estimate and totals
        # speculative decoding: the distributions this step's drafts were sampled from ([k, vocab]; None:
        # point masses), set by the Speculator, read by verification (engine/spec/verify.py)
        self.draft_probs: torch.Tensor | None = None
        # a vision-language prompt's images (multimodal/inputs.py): their tiles name the blocks their tokens
        # start in (`mm_block_keys`, set by the KV manager), and the runner encodes them as chunks reach them
        self.multi_modal = multi_modal
        self.mm_block_keys: dict[int, bytes] | None = None
        self.mm_encoded = EncodedTiles(multi_modal) if multi_modal is not None else None
        self.lora = lora  # the LoRA adapter it runs with (its slot, and its digest in the block hashes)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens plus the one a running step is sampling, if any."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.finished else None

    def ready_to_schedule(self) -> bool:
        """False while its grammar compiles, or while an n>1 sibling is still computing the shared prompt."""
        if self.grammar is not None and not self.grammar.poll():
            return False
        first = self.wait_for
        if first is None or first.finished or first.num_computed_tokens >= first.num_prompt_tokens:
            self.wait_for = None
            return True
        return False

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
