"""Loads the model, owns the KV cache tensors, and runs one scheduled step.

A step has two halves so that the engine can overlap them with other work:
`prepare(step)` (host side: reads token ids and block tables, builds the input and
attention-metadata tensors) and `run(prepared)` (the model forward and sampling; it
touches no scheduler state, so it can run on its own thread while the host schedules
and post-processes). A step may be prepared before the previous one has produced its
tokens: those inputs are placeholders that `run` fills from the previous run's samples.
`execute` is both halves, in order.

Speculative decoding: a scheduled request with draft tokens runs its last token and the drafts; for
attention each of those rows is a decode of its own (same block table, context one longer per row: the
step writes every row's K/V before attending, so row j sees rows < j), which keeps verification on the
batched decode kernels (per-request prefill attention measured ~10x slower at batch 8); a model that builds
its own KV metadata (DeepSeek-V4, `custom_kv`) gets them as one chunk per request instead. All its rows'
logits are kept (after the plainly sampled rows) and `spec.verify` decides per
request which drafts the target keeps and which token follows them (`StepResult.accepted`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.config import CacheConfig, ModelConfig, resolve_size
from deepinfer.engine.cpu_threads import ThreadGovernor
from deepinfer.engine.expert_parallel import ExpertParallel
from deepinfer.engine.request import Request
from deepinfer.engine.sampler import Sampler, TokenLogprobs, target_logprobs
from deepinfer.engine.scheduler import SchedulerOutput
from deepinfer.engine.spec.ngram import LookupPlan
from deepinfer.engine.spec.verify import verify
from deepinfer.kvcache.blocks import TierBlocks, layout_of
from deepinfer.kvcache.manager import whole_sequence
from deepinfer.kvcache.spec import FullAttention, KVSpec, SlidingWindow
from deepinfer.layers.attention import AttentionBatch
from deepinfer.layers.fused_decode import SpecSeq
from deepinfer.layers.linear import Linear
from deepinfer.layers.moe import RoutedExperts, SoftmaxTopKRouter
from deepinfer.layers.torch_attention import TorchAttentionBackend
from deepinfer.models import build_model
from deepinfer.multimodal.encoder import TileEncoder
from deepinfer.multimodal.inputs import MultiModalInputs
from deepinfer.weights import ModelFiles

logger = logging.getLogger(__name__)


def _attention_rows(item) -> int:
    """Attention sequences a scheduled item is: one, or one per token when it verifies drafts."""
    return item.num_new_tokens if item.draft_token_ids else 1


def _run_horizons(mm: MultiModalInputs, start: int, end: int, row0: int) -> list[tuple[int, int, int]]:
    """(first row, end row, run's last position) of each placeholder run a chunk of positions [start, end)
    covers (rows: row0 + position); RuntimeError if the chunk ends inside one (the scheduler keeps them whole:
    the run's later keys would not be there to attend to)."""
    if mm.run_cut(start, end) is not None:
        raise RuntimeError(f"a prefill chunk [{start}, {end}) ends inside a run of image placeholders")
    return [(row0 + max(first, start), row0 + last + 1, last) for first, last in mm.runs
            if first < end and last >= start]


def _window(spec: KVSpec) -> int | None:
    return spec.window if isinstance(spec, SlidingWindow) else None

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# prompt logprobs are computed this many prompt rows at a time: a chunk's full-vocabulary logits and their
# log-softmax are the big tensors (256 rows x 49,152 tokens x 4 bytes = 48 MiB each), whatever the prompt
PROMPT_LOGPROBS_CHUNK = 256


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return torch.device(name)


def cpu_has_fast_bf16() -> bool:
    """True where the CPU multiplies bf16 natively (AVX-512 BF16 or AMX); elsewhere bf16 matmuls are
    emulated and measured ~8x slower than fp32 (AVX2 EPYC: 17 vs 133 GFLOP/s at 512x576x1536)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda" or cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    return _DTYPES[name]


@dataclass
class StepResult:
    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    num_tokens: int
    seconds: float  # prepare + run
    run_started: float = 0.0  # time.perf_counter() at the start and end of `run`
    run_ended: float = 0.0
    # speculative decoding: per request that verified drafts, the drafts kept (before `sampled`'s token)
    # and their logprobs (when the request asked for logprobs)
    accepted: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # CPU time of prepare + run on the threads that ran them (`time.thread_time`): at one torch thread the
    # step's own work, which other processes on a shared machine barely move (speculative decoding prices
    # verification rows with it; wall time moved 2-3x between steps under load)
    cpu_seconds: float = 0.0
    # a speculating call (`PreparedStep.spec_call`): per step (rows, seconds), and per request, per step it was
    # in, (match length, drafts, drafts kept)
    spec_steps: list[tuple[int, float]] | None = None
    spec_verdicts: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    # of `seconds`, the vision tower's (image tiles encoded in this step): the cost model prices text work only
    encode_seconds: float = 0.0


@dataclass
class PreparedStep:
    """A step's inputs, built on the host; `run` needs nothing else."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metas: list[Any]  # the attention metadata of each KV layer group
    logits_indices: torch.Tensor
    sample_reqs: list[Request]
    num_tokens: int
    prepare_seconds: float
    # (row in input_ids, request id) of tokens the previous step samples: filled in by `run`
    pending_tokens: list[tuple[int, str]] = field(default_factory=list)
    # set by the engine once the previous step's tokens are appended; sampling (penalties read the
    # generated tokens, grammar masks need the matchers advanced past them) waits for it. None:
    # nothing to wait for.
    ready: threading.Event | None = None
    # prompt logprobs: (request, prompt index, prompt token) per logits row after the sampled rows; the
    # row is the position before that index, whose logits predict the token there
    prompt_rows: list[tuple[Request, int, int]] = field(default_factory=list)
    # speculative decoding: (request, its first row among the verify rows, drafts); its 1 + len(drafts)
    # logits rows follow the sampled rows
    verify_items: list[tuple[Request, int, list[int]]] = field(default_factory=list)
    num_verify_rows: int = 0
    # (request id, first position, rows) per scheduled request, in row order (for `stream_sink`)
    row_requests: list[tuple[str, int, int]] = field(default_factory=list)
    prepare_cpu_seconds: float = 0.0  # thread CPU time of `prepare`
    num_steps: int = 1  # greedy decode steps of every row in one call (the scheduler's `num_steps`)
    # those steps speculate in C: per request (request, its block table, prompt lookup plan, most tokens appended)
    spec_call: list[tuple[Request, list[int], LookupPlan, int]] | None = None
    # image placeholders in the step: (request, placeholder ordinals [a, b), their rows in input_ids)
    image_rows: list[tuple[Request, int, int, list[int]]] = field(default_factory=list)
    # LoRA: each row's adapter slot (-1: none; lora.layers); None: no row has one
    lora_rows: list[int] | None = None


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, files: ModelFiles, hf_config,
                 max_model_len: int, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 expert_parallel: ExpertParallel | None = None) -> None:
        """`max_num_seqs` and `max_num_batched_tokens` (the scheduler's limits) bound what a sliding-window
        group can hold at once, so its layers get fewer blocks than the full-attention ones.
        `expert_parallel`: this rank's share of the routed experts (swapped in before the weights load)."""
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        if model_config.num_threads:
            torch.set_num_threads(model_config.num_threads)
        self.block_size = cache_config.block_size
        self.deterministic = model_config.deterministic
        # the forward's thread count follows the cores other processes leave free (cpu_threads.py)
        self.threads = ThreadGovernor(enabled=self.device.type == "cpu" and not model_config.num_threads
                                      and not self.deterministic)
        if self.deterministic and (self.device.type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16)):
            raise ValueError("deterministic mode runs on CPU in float32 or bfloat16")
        self.backend = TorchAttentionBackend(self.device, row_invariant=self.deterministic)
        started = time.perf_counter()
        self.model = build_model(hf_config, self.backend, max_model_len, self.dtype, self.device)
        unsupported = getattr(self.model, "deterministic_unsupported", None)
        if self.deterministic and unsupported:
            raise ValueError(f"deterministic mode cannot serve {type(self.model).__name__}: {unsupported}")
        if expert_parallel is not None:
            if self.deterministic:
                raise ValueError("deterministic mode does not serve expert parallelism or EPLB (their expert "
                                 "weights move between slots)")
            expert_parallel.attach(self.model)
        self.model.load_weights(files.iter_weights(self.dtype))
        if expert_parallel is not None:
            expert_parallel.after_load()
        self.model.eval()
        # a model that keeps its own kinds of KV state (DeepSeek-V4) allocates its caches and builds its
        # step metadata itself (`allocate_kv_caches`, `prepare_kv`); the backend serves the others
        self.custom_kv = hasattr(self.model, "allocate_kv_caches")
        if self.deterministic and self.custom_kv:
            raise ValueError(f"deterministic mode does not serve {type(self.model).__name__}: its attention (sinks, "
                             "compressed entries, indexer top-k) and MoE have no row-invariant kernels")
        self.gguf_kernels = self._attach_gguf(model_config.gguf_kernels, files)
        if self.deterministic:
            self._make_row_invariant()
        packed = sum(m.pack() for m in self.model.modules() if isinstance(m, Linear))
        if packed:
            released = self._release_packed_dense()
            logger.info("packed %d projections (panels for panel_gemm.c, or oneDNN); freed %d dense copies "
                        "(%.0f MB)", packed, *released)
        if hasattr(self.model, "enable_batched_decode") and self.model.enable_batched_decode():
            logger.info("decode steps run norms, rotary, KV writes and SiLU*mul as C calls between the matmuls")
        logger.info("loaded weights (%s, %s) in %.1fs", self.dtype, self.device, time.perf_counter() - started)
        self.kv_groups = self.model.kv_groups
        if self.deterministic and any(not isinstance(g.spec, FullAttention) for g in self.kv_groups):
            raise ValueError("deterministic mode does not serve sliding-window layers yet")
        if self.custom_kv:
            self.group_num_blocks, capacity = self.model.kv_group_blocks(
                self._budget_bytes(cache_config), self.block_size, self.dtype, max_num_seqs, max_num_batched_tokens)
            self.num_blocks = max(1, capacity // self.block_size)
            self.kv_caches = self.model.allocate_kv_caches(self.group_num_blocks, self.block_size, self.dtype,
                                                           self.device)
        else:
            self._allocate_backend_caches(cache_config, hf_config, max_num_seqs, max_num_batched_tokens)
        self.tier_blocks = self._tier_blocks()
        self.sampler = Sampler(model_config.seed)
        self.prompt_logprobs_chunk = PROMPT_LOGPROBS_CHUNK
        self._last_sampled: dict[str, int] = {}  # the previous `run`'s tokens (fills pending inputs)
        # speculative decoding with DeepSeek-V4's MTP layer: called after each forward with the step's
        # `row_requests` and the model's last residual streams of every row (engine/spec/mtp.py)
        self.stream_sink: Callable[[list[tuple[str, int, int]], torch.Tensor], None] | None = None
        # a vision-language model's tower: timed per tile, through the encoded-tile cache
        self.tiles = TileEncoder(self.model, cache_config.image_cache_memory) \
            if hasattr(self.model, "encode_tiles") else None
        # Gemma 3: a run of image placeholders attends to itself both ways (AttentionBatch.horizons)
        self.bidirectional_images = bool(getattr(self.model, "bidirectional_image_tokens", False))

    def _allocate_backend_caches(self, cache_config: CacheConfig, hf_config, max_num_seqs: int,
                                 max_num_batched_tokens: int) -> None:
        self.group_num_blocks = self._group_blocks(self._num_blocks(cache_config, hf_config), max_num_seqs,
                                                   max_num_batched_tokens)
        # what one sequence can hold: the blocks of a full-attention group (a sliding one needs its window)
        self.num_blocks = min((n for g, n in zip(self.kv_groups, self.group_num_blocks, strict=True)
                               if isinstance(g.spec, FullAttention)), default=self.group_num_blocks[0])
        # each group's layers get that group's block count; the group numbers its blocks itself. With
        # sliding groups beside full ones (bounded replay), a full group's caches get one block more that
        # no table names: the slots of replayed positions, whose KV the full group already holds
        self.replay_slot_base: list[int | None] = [None] * len(self.kv_groups)
        hybrid = any(isinstance(g.spec, SlidingWindow) for g in self.kv_groups)
        self.kv_caches: list[Any] = [None] * self.model.config.num_hidden_layers
        for i, (group, n) in enumerate(zip(self.kv_groups, self.group_num_blocks, strict=True)):
            if hybrid and isinstance(group.spec, FullAttention):
                self.replay_slot_base[i] = n * self.block_size
                n += 1
            caches = self.backend.allocate_cache(len(group.layers), n, self.block_size, self.model.num_kv_heads,
                                                 self.model.head_dim, self.dtype, self.device)
            for layer, cache in zip(group.layers, caches, strict=True):
                self.kv_caches[layer] = cache

    def _attach_gguf(self, mode: str, files: ModelFiles) -> bool:
        is_gguf = files.source.suffix == ".gguf"
        if mode == "off" or not is_gguf:
            if mode == "on" and not is_gguf:
                raise ValueError("gguf_kernels=on needs a .gguf model file")
            return False
        usable = self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)
        from deepinfer.layers.cpu_kernels import load_library
        from deepinfer.layers.gguf_kernels import read_quantized

        if not usable or load_library() is None:
            if mode == "on":
                raise ValueError("gguf_kernels=on needs float32 or bfloat16 on an x86-64 CPU with AVX2 and gcc")
            return False
        # files.directory is the GGUF's conversion, named by its content digest (weights/loader.py)
        blocks = files.directory / "gguf_blocks" / "blocks.bin"
        attached = self.model.attach_gguf(*read_quantized(files.source, blocks))
        logger.info("GGUF kernels: %d projections (and expert slots) multiply from quantized blocks for small "
                    "batches", attached)
        if attached and hasattr(self.model, "enable_fused_decode") and self.model.enable_fused_decode():
            logger.info("small decode steps run each decoder layer as one C call")
        return attached > 0

    def _release_packed_dense(self) -> tuple[int, float]:
        """Free the dense copy of every packed projection whose weight no other module holds (a tied LM head
        keeps the embedding's); returns how many and their MB."""
        shared = {id(p) for m in self.model.modules() if not isinstance(m, Linear) for p in m.parameters(False)}
        count, freed = 0, 0
        for m in self.model.modules():
            if isinstance(m, Linear) and id(m.weight) not in shared:
                nbytes = m.weight.numel() * m.weight.element_size()
                if m.release_dense():
                    count, freed = count + 1, freed + nbytes
        return count, freed / 1e6

    def _make_row_invariant(self) -> None:
        """Deterministic mode: every projection through the row-invariant kernel, and (Llama layout)
        every step through the whole-layer C path, which then takes any number of rows."""
        for name, module in self.model.named_modules():
            # Linear projections, and a mixture of experts' router and routed experts (layers/moe.py)
            if isinstance(module, (Linear, SoftmaxTopKRouter, RoutedExperts)):
                try:
                    module.make_row_invariant()
                except ValueError as e:
                    raise ValueError(f"deterministic mode cannot serve {name}: {e}") from None
        if hasattr(self.model, "enable_fused_decode") and self.model.enable_fused_decode():
            self.model.fused.row_invariant = True
        logger.info("deterministic mode: row-invariant kernels for every step")

    def group_caches(self, index: int) -> list[Any]:
        """The caches of KV group `index`'s layers, in layer order."""
        return [self.kv_caches[i] for i in self.kv_groups[index].layers]

    @property
    def tier_caches(self) -> list[Any]:
        """The caches of KV group 0's layers (all layers for a dense model): what a block's payload in the
        host tier and store holds (a sliding group's blocks come back by replay instead)."""
        return self.group_caches(0)

    def _tier_blocks(self) -> TierBlocks | None:
        """What a chain position's payload in the host tier and store holds: the blocks of the groups kept
        for the whole sequence (`kvcache/blocks.py`); None for a model with none (sliding layers only)."""
        groups = [i for i, g in enumerate(self.kv_groups) if whole_sequence(g.spec)]
        if not groups:
            return None
        windows = [i for i, g in enumerate(self.kv_groups) if not whole_sequence(g.spec)]
        if not self.custom_kv:
            if groups != [0]:
                raise ValueError("the KV tiers expect one full-attention group, first")
            return TierBlocks.dense(0, self.tier_caches).with_windows(
                windows, [[t for i in self.kv_groups[w].layers for t in self.kv_caches[i]] for w in windows])
        bs = self.block_size
        return TierBlocks.positional(groups, [self.kv_groups[i].spec.tokens_per_block(bs) // bs for i in groups],
                                     [self.model.group_tensors(self.kv_caches, i) for i in groups], bs).with_windows(
            windows, [self.model.group_tensors(self.kv_caches, w) for w in windows])

    @property
    def kv_cache_bytes(self) -> int:
        if self.custom_kv:
            return sum(t.numel() * t.element_size() for c in self.kv_caches for t in c.values())
        return sum(t.numel() * t.element_size() for k, v in self.kv_caches for t in (k, v))

    def kv_layout_key(self) -> str:
        """What seeds every block hash: the KV layout (blocks of another layout can never match)."""
        if self.tier_blocks is not None:
            return self.tier_blocks.layout.key
        if self.custom_kv:  # its own kinds of state, none kept whole (DeepSeek-V4 of sliding layers only)
            return TierBlocks.positional([0], [1], [self.model.group_tensors(self.kv_caches, 0)],
                                         self.block_size).layout.key
        return layout_of(self.tier_caches).key

    @property
    def kv_bytes_per_block(self) -> int:
        cfg = self.model.config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * cfg.num_hidden_layers * self.block_size * self.model.num_kv_heads * self.model.head_dim * elem

    def _num_blocks(self, cache_config: CacheConfig, hf_config) -> int:
        return max(1, self._budget_bytes(cache_config) // self.kv_bytes_per_block)

    def _budget_bytes(self, cache_config: CacheConfig) -> int:
        size = cache_config.kv_cache_memory  # None = auto: decided here, from the hardware
        if self.device.type == "cuda":
            available = torch.cuda.mem_get_info(self.device)[0]
            budget = int(0.8 * available) if size is None else resolve_size(size, available)
        else:
            import psutil

            available = psutil.virtual_memory().available
            budget = min(available // 4, 4 * 2**30) if size is None else resolve_size(size, available)
        return budget

    def _group_blocks(self, equal_share: int, max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
        """Blocks per KV group from a budget of `equal_share` blocks in every layer. A sliding-window group
        needs at most its window (+1 block) per running sequence plus one step's new tokens; it gets twice
        that (the rest keeps cached windows), capped at the equal share; full groups get what is left."""
        specs = [g.spec for g in self.kv_groups]
        if all(isinstance(s, FullAttention) for s in specs) or not any(isinstance(s, FullAttention) for s in specs):
            return [equal_share] * len(specs)
        bs = self.block_size
        layers = [len(g.layers) for g in self.kv_groups]
        counts = [0] * len(specs)
        spare = 0
        for i, spec in enumerate(specs):
            if isinstance(spec, SlidingWindow):
                need = max_num_seqs * (-(-spec.window // bs) + 1) + -(-max_num_batched_tokens // bs)
                counts[i] = min(equal_share, 2 * need)
                spare += (equal_share - counts[i]) * layers[i]
        full_layers = sum(n for s, n in zip(specs, layers, strict=True) if isinstance(s, FullAttention))
        for i, spec in enumerate(specs):
            if isinstance(spec, FullAttention):
                counts[i] = equal_share + spare // full_layers
        return counts

    def execute(self, step: SchedulerOutput, group_tables: list[dict[str, list[int]]]) -> StepResult:
        return self.run(self.prepare(step, group_tables))

    def prepare(self, step: SchedulerOutput, group_tables: list[dict[str, list[int]]]) -> PreparedStep:
        """Build a step's inputs; `group_tables`: per KV layer group, request id -> block table."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        query_lens, context_lens = [], []
        logits_rows, sample_reqs = [], []
        prompt_rows: list[tuple[Request, int, int]] = []
        prompt_logits_rows: list[int] = []
        pending: list[tuple[int, str]] = []
        verify_rows: list[int] = []
        verify_items: list[tuple[Request, int, list[int]]] = []
        image_rows: list[tuple[Request, int, int, list[int]]] = []
        horizon_runs: list[tuple[int, int, int]] = []  # (first row, end row, last key position) of a run
        lora_spans: list[tuple[int, int, int]] = []  # (adapter slot, first row, end row)
        num_decodes = 0
        num_steps = max((item.num_steps for item in step.scheduled), default=1)
        for item in step.scheduled:
            req, start, n = item.request, item.start, item.num_new_tokens
            end = start + n
            known = req.token_ids[start:end]
            if item.draft_token_ids:  # the last known token, then the drafts to verify
                known = req.token_ids[start:start + 1] + item.draft_token_ids
            if req.prompt_logprobs is not None:
                # positions start .. end-1 predict tokens start+1 .. end: those still inside the prompt
                for pos in range(start, min(end, req.num_prompt_tokens - 1)):
                    prompt_logits_rows.append(len(tokens) + pos - start)
                    prompt_rows.append((req, pos + 1, req.prompt_token_ids[pos + 1]))
            if req.multi_modal is not None and start < req.num_prompt_tokens:
                a, b = req.multi_modal.span(start, end)
                if a < b:
                    row0 = len(tokens) - start
                    image_rows.append((req, a, b, [row0 + p for p in req.multi_modal.positions[a:b]]))
                    if self.bidirectional_images:
                        horizon_runs.extend(_run_horizons(req.multi_modal, start, end, row0))
            first_row = len(tokens)
            tokens.extend(known)
            if len(known) < n:  # the last token is still being sampled by the step before this one
                pending.append((len(tokens), req.request_id))
                tokens.append(0)
            if req.lora is not None:
                lora_spans.append((req.lora.slot, first_row, len(tokens)))
            positions.extend(range(start, end))
            if item.draft_token_ids and not self.custom_kv:  # one decode row per token (module docstring)
                num_decodes += n
                query_lens.extend([1] * n)
                context_lens.extend(range(start + 1, end + 1))
            else:
                num_decodes += n == 1
                query_lens.append(n)
                context_lens.append(end)
            if item.draft_token_ids:
                verify_items.append((req, len(verify_rows), item.draft_token_ids))
                verify_rows.extend(range(len(tokens) - n, len(tokens)))
            elif end == req.num_tokens:
                logits_rows.append(len(tokens) - 1)
                sample_reqs.append(req)
        horizons = None
        if horizon_runs:
            horizons = list(positions)
            for lo, hi, last in horizon_runs:
                horizons[lo:hi] = [last] * (hi - lo)
        metas = []
        if self.custom_kv:  # the model computes its own slots from each group's tables
            no_slots = torch.zeros(0, dtype=torch.long)
            floors = [item.request.kv_floor for item in step.scheduled]
            replay = [item.request.replay_end for item in step.scheduled] if any(floors) or any(
                item.request.replay_end for item in step.scheduled) else None
            batches = [AttentionBatch(query_lens, context_lens,
                                      [by_request[item.request.request_id] for item in step.scheduled],
                                      num_decodes, no_slots, bs, key_floors=floors if replay else None,
                                      replay_ends=replay) for by_request in group_tables]
            metas = self.model.prepare_kv(batches)
        else:
            for group, by_request, replay_base in zip(self.kv_groups, group_tables, self.replay_slot_base,
                                                      strict=True):
                tables, slot_mapping = self._slots(step, by_request, replay_base)
                window = _window(group.spec)
                floors = [item.request.kv_floor for item in step.scheduled
                          for _ in range(_attention_rows(item))] if window is not None else None
                metas.append(self.backend.prepare(AttentionBatch(query_lens, context_lens, tables, num_decodes,
                                                                 slot_mapping, bs, window, floors,
                                                                 lookahead=num_steps - 1, horizons=horizons)))
        dev = self.device
        first = step.scheduled[0]
        spec_call = None
        if first.in_call_drafts is not None:
            spec_call = [(item.request, list(group_tables[0][item.request.request_id]), item.in_call_drafts,
                          item.max_new_tokens) for item in step.scheduled]
        return PreparedStep(
            torch.tensor(tokens, dtype=torch.long, device=dev), torch.tensor(positions, dtype=torch.long, device=dev),
            metas, torch.tensor(logits_rows + verify_rows + prompt_logits_rows, dtype=torch.long, device=dev),
            sample_reqs, len(tokens), time.perf_counter() - started, pending, prompt_rows=prompt_rows,
            verify_items=verify_items, num_verify_rows=len(verify_rows),
            row_requests=[(i.request.request_id, i.start, i.num_new_tokens) for i in step.scheduled],
            prepare_cpu_seconds=time.thread_time() - cpu_started,
            num_steps=num_steps, spec_call=spec_call, image_rows=image_rows,
            lora_rows=_row_slots(lora_spans, len(tokens)) if lora_spans else None)

    def _slots(self, step: SchedulerOutput, by_request: dict[str, list[int]],
               replay_base: int | None = None) -> tuple[list[list[int]], torch.Tensor]:
        """One KV group's block tables for the step's rows, and the flat cache slot of every new token.
        `replay_base` (a full group beside sliding ones): replayed positions write to the spare block
        from there, so the KV the group holds for them stays as it is (and is what their queries read)."""
        bs = self.block_size
        tables: list[list[int]] = []
        # runs of decodes' slots as plain ints, one tensor per run: a tensor per decode cost ~10 us each
        # hot, several times that between model steps
        parts: list[torch.Tensor | list[int]] = []
        for item in step.scheduled:
            req = item.request
            table = by_request[req.request_id]
            start = item.start
            replay_end = req.replay_end if replay_base is not None else 0
            if item.num_new_tokens == 1:
                slot = (replay_base if start < replay_end else table[start // bs] * bs) + start % bs
                if parts and isinstance(parts[-1], list):
                    parts[-1].append(slot)
                else:
                    parts.append([slot])
            else:
                pos = torch.arange(start, start + item.num_new_tokens)
                block_starts = torch.tensor(table, dtype=torch.long)[pos // bs] * bs
                if start < replay_end:
                    block_starts = torch.where(pos < replay_end, replay_base, block_starts)
                parts.append(block_starts + pos % bs)
            tables.extend([table] * _attention_rows(item))
        tensors = [p if isinstance(p, torch.Tensor) else torch.tensor(p, dtype=torch.long) for p in parts]
        slot_mapping = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
        return tables, slot_mapping.to(self.device)

    @torch.inference_mode()
    def run(self, step: PreparedStep) -> StepResult:
        """Forward + sampling. Reads only `step` and the sampled requests' params and token ids
        (which the engine does not change while a step runs)."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        self.threads.tick()
        for row, request_id in step.pending_tokens:
            step.input_ids[row] = self._last_sampled[request_id]
        if step.spec_call is not None:
            return self._run_spec_call(step, started, cpu_started)
        if step.num_steps > 1 and not step.pending_tokens and self.model.fused.accepts(step.input_ids, step.metas[0]):
            return self._run_steps(step, started, cpu_started)
        num_sampled = len(step.sample_reqs)
        num_scored = num_sampled + step.num_verify_rows
        hidden = None
        images, encode_started = {}, time.perf_counter()
        if step.image_rows:
            images["input_embeds"] = self._image_embeds(step.image_rows)
        encode_seconds = time.perf_counter() - encode_started
        with self.model.lora.step(step.lora_rows, self.dtype, self.device) if step.lora_rows \
                else contextlib.nullcontext():
            final = self.model.hidden_states(step.input_ids, step.positions, self.kv_caches, step.metas,
                                             step.logits_indices, **images)
        # in the head's dtype: the sampler and verifier widen them to float32 where they need to (a
        # greedy-only step takes each row's argmax from them as they are: no 64 x vocab float32 copy)
        logits = self.model.compute_logits(final[:num_scored] if step.prompt_rows else final, float32=False)
        if step.prompt_rows:  # the sampled rows' logits now, the prompt rows' chunk by chunk below
            hidden = final
        if self.stream_sink is not None:
            self.stream_sink(step.row_requests, self.model.step_streams)
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        if step.ready is not None:
            step.ready.wait()
        if hidden is not None:
            self._prompt_logprobs(hidden[num_scored:], step.prompt_rows)
        if step.sample_reqs:
            out = self.sampler(logits[:num_sampled].cpu(), step.sample_reqs)
            for req, tok, lp in zip(step.sample_reqs, out.token_ids, out.logprobs, strict=True):
                sampled[req.request_id] = tok
                if lp is not None:
                    logprobs[req.request_id] = lp
        accepted: dict[str, list[int]] = {}
        accepted_logprobs: dict[str, list[TokenLogprobs]] = {}
        if step.verify_items:
            verdicts = verify(self.sampler, logits[num_sampled:num_scored].cpu(), step.verify_items)
            for (req, _, _), v in zip(step.verify_items, verdicts, strict=True):
                sampled[req.request_id] = v.token
                accepted[req.request_id] = v.accepted
                if v.logprobs is not None:
                    logprobs[req.request_id] = v.logprobs[-1]
                    accepted_logprobs[req.request_id] = v.logprobs[:-1]
        ended = time.perf_counter()
        self._last_sampled = sampled
        return StepResult(sampled, logprobs, step.num_tokens, step.prepare_seconds + ended - started, started, ended,
                          accepted, accepted_logprobs, step.prepare_cpu_seconds + time.thread_time() - cpu_started,
                          encode_seconds=encode_seconds)

    def _image_embeds(self, image_rows: list[tuple[Request, int, int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, embeddings) of the step's image placeholders, their tiles encoded as first reached."""
        rows = torch.tensor([r for *_, req_rows in image_rows for r in req_rows], dtype=torch.long, device=self.device)
        vectors = [req.mm_encoded.rows(a, b, self.tiles, self.tiles.cache) for req, a, b, _ in image_rows]
        return rows, torch.cat(vectors) if len(vectors) > 1 else vectors[0]

    def _run_steps(self, step: PreparedStep, started: float, cpu_started: float) -> StepResult:
        """`step.num_steps` greedy steps of its decode rows in one C call (`FusedDecoder.decode_steps`): each
        request's last token is `sampled`, the ones before it `accepted` (as kept drafts are). The call stops
        after a step that produced a stop token of any row (EOS unless ignored, stop_token_ids); a stop string
        is matched later, on the text, as after any step."""
        reqs = step.sample_reqs
        tokens = self.model.fused.decode_steps(step.input_ids, step.positions, self.kv_caches, step.metas[0],
                                               self.model.lm_head, step.num_steps, _stop_ids(reqs))
        columns = tokens.t().tolist()  # one per row: the rows are the requests, in order
        sampled = {r.request_id: col[-1] for r, col in zip(reqs, columns, strict=True)}
        accepted = {r.request_id: col[:-1] for r, col in zip(reqs, columns, strict=True)}
        ended = time.perf_counter()
        self._last_sampled = sampled
        return StepResult(sampled, {}, step.num_tokens, step.prepare_seconds + ended - started, started, ended,
                          accepted, {}, step.prepare_cpu_seconds + time.thread_time() - cpu_started)

    def _run_spec_call(self, step: PreparedStep, started: float, cpu_started: float) -> StepResult:
        """`step.num_steps` greedy steps of its requests with n-gram speculation in one C call
        (`FusedDecoder.spec_steps`): the tokens each request appended are `accepted` but the last, which is
        `sampled`, as after `_run_steps`; `spec_steps` and `spec_verdicts` say what each step drafted and kept."""
        calls = step.spec_call
        plan = calls[0][2]
        out = self.model.fused.spec_steps(
            [SpecSeq(req.token_ids, table, max_new, tuple(p.k_by_match)) for req, table, p, max_new in calls],
            self.kv_caches, self.model.lm_head, step.num_steps, plan.min_n, plan.max_n, plan.lookback,
            _stop_ids([req for req, *_ in calls]))
        sampled = {req.request_id: new[-1] for (req, *_), new in zip(calls, out.tokens, strict=True)}
        accepted = {req.request_id: new[:-1] for (req, *_), new in zip(calls, out.tokens, strict=True)}
        ended = time.perf_counter()
        self._last_sampled = sampled
        return StepResult(sampled, {}, step.num_tokens, step.prepare_seconds + ended - started, started, ended,
                          accepted, {}, step.prepare_cpu_seconds + time.thread_time() - cpu_started,
                          spec_steps=out.steps,
                          spec_verdicts={req.request_id: v for (req, *_), v in zip(calls, out.verdicts, strict=True)})

    def decode_steps_rows(self) -> int:
        """The most decode rows `run` can take several greedy steps of in one call: the whole-layer C path's
        row limit where the model has it and its logits are the LM head's plain product (0: none)."""
        fused = getattr(self.model, "fused", None)
        head = getattr(self.model, "lm_head", None)
        if fused is None or head is None or not getattr(self.model, "plain_logits", lambda: False)():
            return 0
        q = head.quantized
        return fused.max_rows if q is not None and q.kind != "dense" and head.bias is None else 0

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: list[tuple[Request, int, int]]) -> None:
        """The prompt logprobs of `rows` from their final hidden states, `prompt_logprobs_chunk` rows at a
        time: only one chunk's logits exist at once, so the memory they take does not grow with the prompt.
        Written into the requests here: the engine reads them only in outputs made after the request's
        first token, i.e. after every prefill step of its prompt has finished."""
        size = max(1, self.prompt_logprobs_chunk)
        for lo in range(0, len(rows), size):
            chunk = rows[lo:lo + size]
            lps = target_logprobs(self.model.compute_logits(hidden[lo:lo + size]).cpu(), [t for _, _, t in chunk],
                                  [r.params.prompt_logprobs for r, _, _ in chunk])
            for (req, index, _), lp in zip(chunk, lps, strict=True):
                req.prompt_logprobs[index] = lp


def _row_slots(spans: list[tuple[int, int, int]], rows: int) -> list[int]:
    """Each row's LoRA slot from the (slot, first row, end row) of the requests with one; -1 elsewhere."""
    out = [-1] * rows
    for slot, lo, hi in spans:
        out[lo:hi] = [slot] * (hi - lo)
    return out


def _stop_ids(reqs: list[Request]) -> list[int]:
    """The tokens that end any of `reqs` (stop_token_ids, and EOS unless ignored): where a C call of several
    greedy steps stops (the stop condition itself is checked again when the tokens are appended)."""
    stops = {t for r in reqs for t in r.params.stop_token_ids}
    stops.update(t for r in reqs if not r.params.ignore_eos for t in r.eos_token_ids)
    return sorted(stops)
