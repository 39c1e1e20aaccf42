"""What the model-based proposers (draft model, MTP) share: choosing each draft token from their own
logits, and packing the per-request chains into `Draft`s."""

from __future__ import annotations

import torch

from deepinfer.engine.request import Request
from deepinfer.engine.sampler import Sampler
from deepinfer.engine.spec.proposer import Draft, ProposerStats


class DraftTokenChooser:
    """A greedy request drafts the argmax; a sampled one draws from q (the request's own temperature /
    top-k / top-p applied by a `Sampler`), and q is returned for the exact min(1, p/q) rule."""

    def __init__(self, seed: int | None) -> None:
        self.sampler = Sampler(seed)
        self.generator = torch.Generator().manual_seed(0 if seed is None else seed)

    def choose(self, req: Request, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The draft token for `req` from one logits row [V], and q if it was sampled."""
        if req.params.temperature <= 0:
            return int(self.sampler.greedy(logits.unsqueeze(0))[0]), None
        q = self.sampler.target_probs(logits.unsqueeze(0), [req])[0]
        return int(torch.multinomial(q, 1, generator=self.generator)[0]), q


def pack_drafts(out: list[Draft], tokens: dict[int, list[int]], probs: dict[int, list[torch.Tensor]],
                stats: ProposerStats) -> list[Draft]:
    """`out[i]` = request i's chain of draft tokens (with its q rows when sampled); empty chains stay
    empty drafts. Counts the proposals in `stats`."""
    for i, ts in tokens.items():
        if ts:
            out[i] = Draft(tuple(ts), probs=torch.stack(probs[i]) if probs[i] else None)
            stats.num_proposals += 1
            stats.num_proposed_tokens += len(ts)
    return out
