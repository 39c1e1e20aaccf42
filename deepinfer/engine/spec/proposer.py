"""The proposer interface: who guesses the next tokens of a decoding request.

    Scheduler.schedule ─▶ Speculator.propose ─▶ Proposer.propose_batch(requests, max_tokens)
                                               (default: Proposer.propose per request)
    Scheduler.update   ─▶ Proposer.on_verified(request, drafted, accepted)
    Scheduler._finish  ─▶ Proposer.on_finished(request)

A proposer sees a request's token ids (prompt + output so far, `Request.token_ids`) and returns up to
`max_tokens` draft tokens that would follow them. The target model then scores the last token and the
drafts in one forward pass (verification, `verify.py`); the accepted prefix is appended, the rest is
rolled back. Proposals never change output: greedy requests keep the drafts that equal the target's
argmax, sampled ones go through rejection sampling that keeps the target distribution exactly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from deepinfer.engine.request import Request


@dataclass(frozen=True)
class Draft:
    """Proposed continuation of a request: `token_ids` (possibly empty) and, for proposers that have one,
    `confidence[j]`: the proposer's probability that token j is right given tokens < j were (same length),
    and, for a proposer that sampled its tokens, `probs[j]`: the distribution q token j was drawn from
    (a float tensor [len, vocab]; None: point masses at the tokens), which exact rejection sampling needs.
    `match`: for a proposer that copies (n-gram), how many of the request's last tokens the copied place
    matched (0: not known); a long match is what `tries.py` reads as a reason to try an untried request."""

    token_ids: tuple[int, ...] = ()
    confidence: tuple[float, ...] | None = None
    probs: torch.Tensor | None = None
    match: int = 0

    def __post_init__(self) -> None:
        if self.confidence is not None and len(self.confidence) != len(self.token_ids):
            raise ValueError("a draft's confidence needs one value per draft token")
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != len(self.token_ids)):
            raise ValueError("a draft's probs need one distribution (row) per draft token")

    def __len__(self) -> int:
        return len(self.token_ids)

    def truncated(self, n: int) -> Draft:
        if n >= len(self.token_ids):
            return self
        conf = self.confidence[:n] if self.confidence is not None else None
        return Draft(self.token_ids[:n], conf, self.probs[:n] if self.probs is not None else None, self.match)


@dataclass
class ProposerStats:
    """What a proposer did, for metrics (per proposer)."""

    num_proposals: int = 0
    num_proposed_tokens: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class Proposer(ABC):
    """Guesses draft tokens for decoding requests.

    Contract:
    - `propose(req, max_tokens)` returns a `Draft` of at most `max_tokens` tokens continuing
      `req.token_ids` (never the already known last token itself). It must not change `req`; it may keep
      per-request state keyed by `req.request_id` (e.g. an index that grows with the request's tokens),
      which `on_finished` drops. It is called on the engine thread between steps, while no step runs, so
      it may read `req.token_ids` freely; it must be cheap (it runs every step for every decode).
    - `propose_batch` is what the scheduler calls, once per step with all decoding requests that may
      speculate; a proposer that runs a model (a draft model, DeepSeek-V4's MTP layer) overrides it to run
      one batched forward, and owns that model's paged KV (its own `KVCacheManager` and block tables,
      keyed by request id): `on_verified(req, num_drafted, num_accepted)` tells it how many of its tokens
      the target kept, so it can roll its KV back to the kept prefix; it is called before the kept drafts
      and the target's own token are appended (`req.token_ids` is as it was when the drafts were proposed,
      and grows by `num_accepted + 1` after), and `on_finished` frees it.
    - A proposer that samples its drafts from a distribution q returns q as well (`Draft.probs`) and
      `verify.py` accepts with min(1, p/q), drawing rejections from max(0, p - q); deterministic drafts
      (n-gram, suffix, greedy draft models) leave it None: q is a point mass, the point-mass rule applies.
    """

    name: str = "proposer"
    # a pure function of the request's tokens (or an index it catches up lazily): the speculator may skip
    # it on any step, for a request whose drafts could not pay (model proposers keep per-step state)
    skippable: bool = False
    confident: bool = False  # its drafts carry `confidence`

    @abstractmethod
    def propose(self, req: Request, max_tokens: int) -> Draft:
        """Up to `max_tokens` tokens likely to follow `req.token_ids`."""

    def likely_to_propose(self, req: Request) -> bool:
        """Whether a lookup on `req`'s tokens as they are now would find a draft (a cheap check; default:
        True). False must mean that it finds none: `propose` then skips the request's lookup and leaves it
        out of the price's bound. The speculator also asks it for requests whose next token is still in
        flight, to decide whether the next step should wait for that token so they can draft: a proposer
        that copies from earlier tokens finds a draft after the next token mostly where it finds one now."""
        return True

    def propose_batch(self, reqs: list[Request], max_tokens: list[int]) -> list[Draft]:
        """One draft per request (`max_tokens[i]` at most); default: `propose` one by one."""
        return [self.propose(r, k) if k > 0 else Draft() for r, k in zip(reqs, max_tokens, strict=True)]

    def on_verified(self, req: Request, num_drafted: int, num_accepted: int) -> None:  # noqa: B027 - optional
        """The target kept `num_accepted` of the `num_drafted` tokens proposed for `req` this step."""

    def on_finished(self, req: Request) -> None:  # noqa: B027 - optional hook
        """`req` left the engine: drop any state kept for it."""
