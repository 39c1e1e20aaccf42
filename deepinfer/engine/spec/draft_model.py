"""The draft-model proposer: a small model with the target's tokenizer guesses the next k tokens.

    propose_batch(requests, k_i) ─▶ sync: each request's draft KV is cut back to the tokens it shares with
                                    `req.token_ids` (the drafts the target rejected go), the rest fed again
                                 ─▶ forward 1: every request's unseen tokens (usually the target's last token,
                                    two after a fully accepted draft: the last draft and the bonus token; the
                                    whole prompt the first time) -> draft token 1 for every request
                                 ─▶ forward j = 2..k: draft j - 1 of every request still drafting, one row each
    on_verified(req, k, a)       ─▶ the draft KV past the kept drafts is released at once
    on_finished(req)             ─▶ its blocks are freed

The draft model runs through its own `ModelRunner` (deepinfer's model loading and attention backend) with
its own paged KV: a `KVCacheManager` (no prefix caching) over the runner's caches, and per target request a
shadow `Request` (same id) whose `num_computed_tokens` counts the positions the draft KV holds. Each of the
k forwards is one batched step over all drafting requests. Greedy requests draft the draft model's argmax
(a point mass: `verify.py`'s point rule); sampled requests draft from q, the draft model's distribution at
the request's temperature / top-k / top-p, and hand q over (`Draft.probs`) for the exact min(1, p/q) rule.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from deepinfer.config import CacheConfig, ModelConfig
from deepinfer.engine.request import Request
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import ScheduledRequest, SchedulerOutput
from deepinfer.engine.spec.draft_sampling import DraftTokenChooser, pack_drafts
from deepinfer.engine.spec.proposer import Draft, Proposer, ProposerStats
from deepinfer.kvcache.manager import KVCacheManager

logger = logging.getLogger(__name__)


@dataclass
class _Shadow:
    """The draft model's view of one target request."""

    req: Request  # a Request of the draft's own (same id): token_ids and num_computed_tokens for the runner
    base: int = 0  # len(target token_ids) when the last draft was proposed: positions below it agree


class DraftModelProposer(Proposer):
    name = "draft_model"

    def __init__(self, runner, cache_config: CacheConfig, vocab_size: int, max_num_batched_tokens: int,
                 seed: int | None = None) -> None:
        """`runner`: the draft model's `ModelRunner` (its KV caches allocated); `vocab_size`: the ids the
        target's tokenizer knows (draft logits past it are never drawn)."""
        self.runner = runner
        self.kv = KVCacheManager(runner.group_num_blocks, cache_config.block_size, "draft", "draft", False,
                                 [g.spec for g in runner.kv_groups], 0)
        self.vocab_size = vocab_size
        self.chunk = max(1, max_num_batched_tokens)  # catch-up tokens per request per forward
        self.chooser = DraftTokenChooser(seed)
        self.shadows: dict[str, _Shadow] = {}
        self.stats = ProposerStats()
        self.num_forwards = 0

    # ------------------------------------------------------------------ interface

    def propose(self, req: Request, max_tokens: int) -> Draft:
        return self.propose_batch([req], [max_tokens])[0]

    @torch.inference_mode()
    def propose_batch(self, reqs: list[Request], max_tokens: list[int]) -> list[Draft]:
        out = [Draft() for _ in reqs]
        live = [i for i, k in enumerate(max_tokens) if k > 0 and self._sync(reqs[i])]
        if not live:
            return out
        tokens: dict[int, list[int]] = {i: [] for i in live}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        for j in range(max(max_tokens[i] for i in live)):
            live = [i for i in live if j < max_tokens[i]]
            fed = self._forward([self.shadows[reqs[i].request_id].req for i in live])
            if fed is None:
                break
            ok, logits = fed
            live = [i for i, good in zip(live, ok, strict=True) if good]
            logits = logits[[r for r, good in enumerate(ok) if good]]
            for i, row in zip(live, logits, strict=True):
                token, q = self._choose(reqs[i], row)
                tokens[i].append(token)
                if q is not None:
                    probs[i].append(q)
                self.shadows[reqs[i].request_id].req.token_ids.append(token)
        return pack_drafts(out, tokens, probs, self.stats)

    def on_verified(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        shadow = self.shadows.get(req.request_id)
        if shadow is None:
            return
        # the draft KV holds positions < base + num_drafted - 1; those past the kept drafts are wrong now
        self._cut(shadow, min(shadow.req.num_computed_tokens, shadow.base + num_accepted))

    def on_finished(self, req: Request) -> None:
        shadow = self.shadows.pop(req.request_id, None)
        if shadow is not None:
            self.kv.free(shadow.req)

    # ------------------------------------------------------------------ steps

    def _sync(self, req: Request) -> bool:
        """Make the shadow's tokens `req.token_ids` with the draft KV cut to the positions they share."""
        shadow = self.shadows.get(req.request_id)
        if shadow is None:
            shadow = _Shadow(Request(req.request_id, [], SamplingParams(max_tokens=None)))
            self.shadows[req.request_id] = shadow
        ours, theirs = shadow.req.token_ids, req.token_ids
        same = shadow.base
        while same < min(len(ours), len(theirs), shadow.req.num_computed_tokens) and ours[same] == theirs[same]:
            same += 1
        self._cut(shadow, min(same, len(theirs) - 1))  # the last token is always fed: its logits draft token 1
        shadow.req.token_ids = list(theirs)
        shadow.base = len(theirs)
        return True

    def _cut(self, shadow: _Shadow, num_tokens: int) -> None:
        if num_tokens < shadow.req.num_computed_tokens:
            shadow.req.num_computed_tokens = num_tokens
            self.kv.truncate(shadow.req, num_tokens)

    def _forward(self, shadows: list[Request]) -> tuple[list[bool], torch.Tensor] | None:
        """Feed every shadow's unseen tokens; returns which shadows got blocks for them (those that did not
        draft nothing this step) and the logits after the last token of those that did, in order."""
        ok, items = [], []
        for s in shadows:
            good = self._catch_up(s)
            n = s.num_tokens - s.num_computed_tokens
            good = good and self.kv.allocate(s, n)
            ok.append(good)
            if good:
                items.append((s, n))
        if not items:
            return None
        return ok, self._run(items)

    def _catch_up(self, s: Request) -> bool:
        """A long run of unseen tokens (the prompt, after a preemption of the draft's blocks) goes through in
        chunks of `chunk` tokens, this request alone, until at most one chunk is left for the batched step."""
        while s.num_tokens - s.num_computed_tokens > self.chunk:
            if not self.kv.allocate(s, self.chunk):
                return False
            self._run([(s, self.chunk)])
        return True

    def _run(self, items: list[tuple[Request, int]]) -> torch.Tensor:
        """One draft-model forward over `items` (shadow, tokens to feed; blocks allocated); returns the
        logits rows of the items that reach their shadow's last token, in `items` order."""
        order = sorted(items, key=lambda x: x[1] != 1)  # the attention backend wants one-token rows first
        step = SchedulerOutput([ScheduledRequest(s, n, s.num_computed_tokens) for s, n in order], committed=True)
        prepared = self.runner.prepare(step, self.kv.group_tables)
        logits = self.runner.model(prepared.input_ids, prepared.positions, self.runner.kv_caches, prepared.metas,
                                   prepared.logits_indices)
        self.num_forwards += 1
        for s, n in order:
            s.num_computed_tokens += n
        row_of = {s.request_id: r for r, s in enumerate(s for s, _ in order if s.num_computed_tokens == s.num_tokens)}
        return logits[[row_of[s.request_id] for s, _ in items if s.request_id in row_of]].float().cpu()

    def _choose(self, req: Request, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        return self.chooser.choose(req, logits[: self.vocab_size])  # the draft's padded vocab rows dropped


def load_draft_runner(path: str, model_config: ModelConfig, cache_config: CacheConfig, max_model_len: int,
                      max_num_seqs: int, max_num_batched_tokens: int):
    """The draft model at `path` (directory or GGUF file) loaded like a target, on the target's device and
    dtype; returns (runner, files, hf_config)."""
    from transformers import AutoConfig

    from deepinfer.engine.runner import ModelRunner
    from deepinfer.weights import resolve_model

    files = resolve_model(path)
    hf_config = AutoConfig.from_pretrained(str(files.directory))
    runner = ModelRunner(replace(model_config, model=path), replace(cache_config, enable_prefix_caching=False), files,
                         hf_config, max_model_len, max_num_seqs, max_num_batched_tokens)
    return runner, files, hf_config
