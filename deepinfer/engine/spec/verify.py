"""Verification: which draft tokens the target model keeps, and the token it adds after them.

The runner scores, for each speculating request, the last known token and its k drafts in one forward
pass: logits row j (j = 0..k) is the target's distribution of the token after draft j - 1. Rows are
processed in waves: wave j takes row j of every request whose drafts 0..j-1 were all kept, as if those
drafts had been appended (penalties count them, min_tokens sees them, the grammar matcher is advanced
over them, then rolled back at the end: the scheduler advances it for real when it appends tokens).

- Greedy (temperature 0): draft j is kept iff it is the argmax of row j (exactly the token a plain
  decode would have produced); the first mismatch's argmax, or row k's after all k are kept (the bonus
  token), ends the request's run. Output is token-identical to decoding without speculation.
- Sampling (temperature > 0), point proposals (n-gram, suffix: the draft distribution q is a point mass
  at the draft token t): with p the target distribution of the row (temperature, min-p / top-k / top-p,
  after penalties and masks), t is kept with probability min(1, p(t) / q(t)) = p(t); on rejection the
  token is drawn from the residual max(0, p - q) renormalised, i.e. p with t removed. So the emitted
  token is t with probability p(t) and any other s with probability (1 - p(t)) * p(s) / (1 - p(t)) =
  p(s): exactly the target distribution (Leviathan et al. 2023, Chen et al. 2023). After all k drafts
  are kept, the bonus token is drawn from row k's p.
- Sampling, sampled proposals (a draft model drawing token t from its distribution q, handed over as
  `Request.draft_probs`): t is kept with probability min(1, p(t) / q(t)); on rejection the token is
  drawn from max(0, p - q) renormalised. Same theorem: the emitted token has distribution p exactly.

Logprobs of each emitted token come from its row's raw logits, as for plain decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.engine.request import Request
from deepinfer.engine.sampler import Sampler, TokenLogprobs, plain_greedy, target_logprobs


class DraftView:
    """A request as the sampler sees it with `extra` tokens appended (penalties, min_tokens, seed)."""

    __slots__ = ("_req", "_extra")

    def __init__(self, req: Request, extra: list[int]) -> None:
        self._req, self._extra = req, extra

    @property
    def output_token_ids(self) -> list[int]:
        return self._req.output_token_ids + self._extra

    @property
    def num_output_tokens(self) -> int:
        return self._req.num_output_tokens + len(self._extra)

    def __getattr__(self, name: str):
        return getattr(self._req, name)


@dataclass
class Verdict:
    """One request's result: the drafts kept (a prefix of its drafts), then the target's next token."""

    accepted: list[int]
    token: int
    logprobs: list[TokenLogprobs] | None  # one per emitted token (accepted..., token), if requested


def verify(sampler: Sampler, logits: torch.Tensor, items: list[tuple[Request, int, list[int]]]) -> list[Verdict]:
    """`items[i] = (request, first logits row, drafts)`; rows first .. first + len(drafts) are its rows of
    `logits` (float32 or the model's dtype, CPU). Returns one Verdict per item, in order."""
    if all(plain_greedy(req) for req, _, _ in items):
        return _verify_argmax(sampler, logits, items)
    logits = logits.float()
    n = len(items)
    accepted: list[list[int]] = [[] for _ in range(n)]
    final: list[int | None] = [None] * n
    advanced = [0] * n  # grammar tokens accepted tentatively, rolled back below
    alive = list(range(n))
    try:
        for j in range(max((len(d) for _, _, d in items), default=0) + 1):
            if not alive:
                break
            if j > 0:
                for i in alive:
                    g = items[i][0].grammar
                    if g is not None and g.live:
                        if not g.accept(items[i][2][j - 1]):  # unreachable: a masked draft has p = 0
                            raise RuntimeError("a kept draft token was refused by the request's grammar")
                        advanced[i] += 1
            views = [DraftView(items[i][0], items[i][2][:j]) for i in alive]
            rows = sampler.process(logits[[items[i][1] + j for i in alive]], views)  # type: ignore[arg-type]
            chosen = _choose_wave(sampler, rows, views, [items[i][2][j] if j < len(items[i][2]) else None
                                                         for i in alive],
                                  [_draft_q(items[i][0], j, len(items[i][2])) for i in alive])
            still = []
            for i, (keep, token) in zip(alive, chosen, strict=True):
                if keep:
                    accepted[i].append(token)
                    if len(accepted[i]) < len(items[i][2]) + 1:
                        still.append(i)
                else:
                    final[i] = token
            alive = still
    finally:
        for i, k in enumerate(advanced):
            if k:
                items[i][0].grammar.matcher.rollback(k)  # type: ignore[union-attr]
    out = []
    for i, (req, first, _drafts) in enumerate(items):
        emitted = [*accepted[i], final[i]]
        lps = None
        if req.params.logprobs is not None:
            rows = logits[first:first + len(emitted)]
            lps = target_logprobs(rows, emitted, [req.params.logprobs] * len(emitted))  # type: ignore[arg-type]
        out.append(Verdict(accepted[i], final[i], lps))  # type: ignore[arg-type]
    return out


def _verify_argmax(sampler: Sampler, logits: torch.Tensor, items: list[tuple[Request, int, list[int]]]
                   ) -> list[Verdict]:
    """`verify` where every request is plain greedy (`plain_greedy`: no penalties, bias, grammar, logprobs or
    min_tokens left): each row's argmax, read from the logits as they are (an argmax over bfloat16 values is
    the argmax of their exact float32 copy). The float32 copy of the whole block was 38 MB a step at k = 5
    and batch 32 (192 rows of a 49k vocabulary), ~4.7 ms of it page faults."""
    top = sampler.greedy(logits)
    out = []
    for _, first, drafts in items:
        kept = []
        for j, draft in enumerate(drafts):
            if top[first + j] != draft:
                break
            kept.append(draft)
        out.append(Verdict(kept, top[first + len(kept)], None))
    return out


def _draft_q(req: Request, j: int, num_drafts: int) -> torch.Tensor | None:
    """The distribution draft j of `req` was sampled from (None: a point mass, or no draft j)."""
    probs = getattr(req, "draft_probs", None)
    if probs is None or j >= num_drafts or j >= probs.shape[0]:
        return None
    return probs[j]


def _choose_wave(sampler: Sampler, logits: torch.Tensor, views: list[DraftView],
                 drafts: list[int | None], qs: list[torch.Tensor | None]) -> list[tuple[bool, int]]:
    """Per row: (kept, token): (True, draft) if the draft is kept, else (False, the token emitted).
    `qs[r]`: the distribution row r's draft was sampled from (None: a point mass at the draft)."""
    out: list[tuple[bool, int]] = [(False, 0)] * len(views)
    greedy = [r for r, v in enumerate(views) if v.params.temperature <= 0]
    random_rows = [r for r, v in enumerate(views) if v.params.temperature > 0]
    if greedy:
        for r, t in zip(greedy, sampler.greedy(logits[greedy]), strict=True):
            out[r] = (True, t) if drafts[r] == t else (False, t)
    if random_rows:
        sub = [views[r] for r in random_rows]
        probs = sampler.target_probs(logits[random_rows], sub)  # type: ignore[arg-type]
        u_accept = sampler.uniforms(sub)  # type: ignore[arg-type]
        u_draw = sampler.uniforms(sub)  # type: ignore[arg-type]
        for j, r in enumerate(random_rows):
            p = probs[j].double()
            d = drafts[r]
            q = qs[r]
            if d is not None and q is not None:
                q = _aligned(q.double(), p.shape[0])
                if q[d] > 0 and u_accept[j] * q[d] < p[d]:  # kept with probability min(1, p(d) / q(d))
                    out[r] = (True, d)
                    continue
                residual = torch.clamp(p - q, min=0.0)  # the residual max(0, p - q)
                # all zero only when p == q up to rounding, where a rejection has probability ~0
                p = residual if float(residual.sum()) > 1e-12 else p
            elif d is not None:
                if u_accept[j] < p[d]:
                    out[r] = (True, d)
                    continue
                p = p.clone()
                p[d] = 0.0  # the residual max(0, p - q) for a point-mass q at d
            out[r] = (False, _draw(p, float(u_draw[j])))
    return out


def _aligned(q: torch.Tensor, size: int) -> torch.Tensor:
    """`q` over the target's vocabulary rows: a draft model's padded vocabulary may be wider or narrower
    (the proposer puts no mass past the shared tokenizer's ids)."""
    if q.shape[0] == size:
        return q
    out = torch.zeros(size, dtype=q.dtype)
    n = min(size, q.shape[0])
    out[:n] = q[:n]
    return out


def _draw(p: torch.Tensor, u: float) -> int:
    """Inverse CDF of the (unnormalised) weights `p` at uniform `u`."""
    cdf = torch.cumsum(p, 0)
    total = float(cdf[-1])
    if total <= 0:  # every token masked out (cannot happen for a valid target row): fall back to argmax
        return int(torch.argmax(p))
    idx = int(torch.searchsorted(cdf, torch.tensor([u * total], dtype=cdf.dtype), right=True)[0])
    idx = min(idx, len(p) - 1)
    while p[idx] <= 0 and idx > 0:  # a zero-weight token at the boundary: step back to one with mass
        idx -= 1
    return idx
