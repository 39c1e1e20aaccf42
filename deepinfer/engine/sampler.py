"""Batched sampling: penalties, logit bias, allowed tokens, bad words, min_tokens, grammar masks,
temperature, top-k / top-p / min-p, seeds, logprobs.

All rows are processed as one [B, vocab] tensor; per-row parameters become
column vectors. Random rows sample by inverse CDF with one uniform per row: a seeded request
draws its uniform from its own generator, unseeded rows share one draw, so neighbours in the
batch never change a seeded request's tokens. Rows without top-k / top-p / min-p are drawn
straight from their logits by one C kernel; filtered rows get their probabilities filtered
first; top-k / top-p work on the 256 most likely tokens when those hold every row's nucleus.
Logprobs come from the raw model distribution, before any processing. Structured-output rows get their grammar's token bitmask
(filled for all of them in one batched call, applied in one call) after the logit bias, so a bias
can never re-allow a token the grammar forbids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.engine.request import Request
from deepinfer.layers.cpu_kernels import argmax_rows, sample_rows


@dataclass
class TokenLogprobs:
    logprob: float  # of the sampled token
    rank: int  # 1 = most likely
    top: list[tuple[int, float]]  # the k most likely tokens, best first


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        """logits: [len(reqs), vocab], float32 or the model's dtype (widened here unless every row is plain
        greedy: an argmax over bfloat16 values is the argmax of their exact float32 copy)."""
        if all(plain_greedy(r) for r in reqs):  # each row's argmax and nothing else (most steps of most batches)
            return SamplerOutput(argmax_rows(logits).tolist(), [None] * len(reqs))
        if logits.dtype != torch.float32:
            logits = logits.float()
        lp_rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None
        token_ids = self._choose(self.process(logits, reqs), reqs)
        tokens = torch.tensor(token_ids, dtype=torch.long)
        logprobs: list[TokenLogprobs | None] = [None] * len(reqs)
        if raw_logprobs is not None:
            k = max(1, max(reqs[i].params.logprobs for i in lp_rows))
            top_vals, top_ids = raw_logprobs.topk(k, dim=-1)
            chosen = raw_logprobs.gather(1, tokens[lp_rows].unsqueeze(1))
            ranks = (raw_logprobs > chosen).sum(dim=-1) + 1
            for j, i in enumerate(lp_rows):
                kk = reqs[i].params.logprobs
                logprobs[i] = TokenLogprobs(float(chosen[j, 0]), int(ranks[j]),
                                            list(zip(top_ids[j, :kk].tolist(), top_vals[j, :kk].tolist(),
                                                     strict=True)))
        return SamplerOutput(token_ids, logprobs)

    def process(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Penalties, logit bias, min_tokens and grammar masks: the logits the tokens are chosen from
        (float32; may be `logits` itself, changed in place by the grammar mask)."""
        logits = self._apply_penalties(logits, reqs)
        logits = self._apply_logit_bias(logits, reqs)
        logits = self._apply_allowed_tokens(logits, reqs)
        logits = self._apply_bad_words(logits, reqs)
        logits = self._apply_min_tokens(logits, reqs)
        self._apply_grammar(logits, reqs)
        return logits

    def greedy(self, logits: torch.Tensor) -> list[int]:
        """Each row's argmax (the kernel `_choose` uses, so ties break the same way)."""
        return argmax_rows(logits).tolist()

    def target_probs(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """The distribution `_choose` samples random rows from, over the whole vocabulary: softmax at the
        row's temperature, then min-p / top-k / top-p, renormalised. (For speculative verification.)"""
        temp = torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32).unsqueeze(1)
        probs = torch.softmax(logits / temp, dim=-1)
        if any(_needs_filter(r) for r in reqs):
            weights, ids = self._filter(probs, reqs)
            probs = torch.zeros_like(probs).scatter_(1, ids, weights) if ids is not None else weights
        return probs / probs.sum(dim=-1, keepdim=True)

    def uniforms(self, reqs: list[Request]) -> torch.Tensor:
        """One uniform in [0, 1) per request (seeded requests from their own generator)."""
        return self._uniforms(reqs)

    # ------------------------------------------------------------------ steps

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(reqs) if r.params.needs_penalties]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        sub = logits[rows]
        # generated-token counts per row, from one padded scatter (padding points at an extra column)
        ids = _padded([reqs[i].output_token_ids for i in rows], vocab)
        counts = torch.zeros(len(rows), vocab + 1).scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float))
        counts = counts[:, :vocab]
        rep = torch.tensor([reqs[i].params.repetition_penalty for i in rows]).unsqueeze(1)
        if (rep != 1.0).any():
            # HF semantics: every token seen in prompt or output; positive logits divided, negative multiplied
            pids = _padded([reqs[i].prompt_token_ids for i in rows], vocab)
            seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool).scatter_(1, pids, True)[:, :vocab]
            seen |= counts > 0
            penalized = torch.where(sub > 0, sub / rep, sub * rep)
            sub = torch.where(seen, penalized, sub)
        # then OpenAI's additive penalties on generated tokens (vLLM's order)
        freq = torch.tensor([reqs[i].params.frequency_penalty for i in rows]).unsqueeze(1)
        presence = torch.tensor([reqs[i].params.presence_penalty for i in rows]).unsqueeze(1)
        sub = sub - freq * counts - presence * (counts > 0).float()
        logits[rows] = sub
        return logits

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        vocab = logits.shape[1]
        for i, r in enumerate(reqs):
            for tid, value in (r.params.logit_bias or {}).items():
                if tid < vocab:  # the engine rejects larger ids; padding columns never get a bias
                    rows.append(i)
                    cols.append(tid)
                    vals.append(float(value))
        if not rows:
            return logits
        logits = logits.clone()
        logits.index_put_((torch.tensor(rows), torch.tensor(cols)), torch.tensor(vals), accumulate=True)
        return logits

    @staticmethod
    def _apply_grammar(logits: torch.Tensor, reqs: list[Request]) -> None:
        """Mask, in place, every structured row whose grammar still constrains the next token. Runs
        after the previous step's tokens were accepted (the runner waits for that under overlap).
        Rows of finished requests are left alone: their token is discarded."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.finished and r.grammar.live]
        if not rows:
            return
        backend = reqs[rows[0]].grammar.backend
        bitmask = backend.allocate_bitmask(len(reqs))
        backend.fill_bitmask([reqs[i].grammar.matcher for i in rows], bitmask, rows)
        backend.apply_bitmask(logits, bitmask, rows)

    @staticmethod
    def _apply_allowed_tokens(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(reqs) if r.params.allowed_token_ids]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in rows:
            keep = torch.tensor([t for t in reqs[i].params.allowed_token_ids if t < vocab], dtype=torch.long)
            row = torch.full((vocab,), float("-inf"))
            row[keep] = logits[i, keep]
            logits[i] = row
        return logits

    @staticmethod
    def _apply_bad_words(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Ban each bad word's last token where the output so far ends with the tokens before it (always,
        for one-token words)."""
        rows: list[int] = []
        cols: list[int] = []
        vocab = logits.shape[1]
        for i, r in enumerate(reqs):
            words = r.params.bad_words_token_ids
            if not words:
                continue
            out = r.output_token_ids
            for seq in words:
                head = len(seq) - 1
                if seq[-1] < vocab and (head == 0 or (len(out) >= head and out[len(out) - head:] == seq[:-1])):
                    rows.append(i)
                    cols.append(seq[-1])
        if not rows:
            return logits
        logits = logits.clone()
        logits[rows, cols] = float("-inf")
        return logits

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        cloned = False
        for i, r in enumerate(reqs):
            p = r.params
            # a grammar decides when a structured output ends; banning its only stop would leave no token
            if r.num_output_tokens < p.min_tokens and r.grammar is None:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
                if banned:
                    if not cloned:
                        logits, cloned = logits.clone(), True
                    logits[i, list(banned)] = float("-inf")
        return logits

    @staticmethod
    def _filter(probs: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """min-p, then top-k / top-p: (weights, ids) as `_top_k_top_p` returns them."""
        min_p = [r.params.min_p for r in reqs]
        if any(min_p):
            thresh = torch.tensor(min_p).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < thresh, 0.0)
        top_k = [r.params.top_k for r in reqs]
        top_p = [r.params.top_p for r in reqs]
        if any(top_k) or any(p < 1.0 for p in top_p):
            return _top_k_top_p(probs, top_k, top_p)
        return probs, None

    def _choose(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        """Greedy rows take their argmax; random rows draw by inverse CDF (see the module doc)."""
        greedy = [i for i, r in enumerate(reqs) if r.params.temperature <= 0]
        random_rows = [i for i, r in enumerate(reqs) if r.params.temperature > 0]
        token_ids = [0] * len(reqs)
        if greedy:
            picked = argmax_rows(logits if len(greedy) == len(reqs) else logits[greedy])
            for i, t in zip(greedy, picked.tolist(), strict=True):
                token_ids[i] = t
        if not random_rows:
            return token_ids
        uniforms = self._uniforms([reqs[i] for i in random_rows])
        plain = [j for j, i in enumerate(random_rows) if not _needs_filter(reqs[i])]
        filtered = [j for j, i in enumerate(random_rows) if _needs_filter(reqs[i])]
        if plain:
            rows = [random_rows[j] for j in plain]
            inv_temp = torch.tensor([1.0 / reqs[i].params.temperature for i in rows], dtype=torch.float32)
            for i, t in zip(rows, sample_rows(logits, rows, uniforms[plain], inv_temp).tolist(), strict=True):
                token_ids[i] = t
        if filtered:
            rows = [random_rows[j] for j in filtered]
            temp = torch.tensor([reqs[i].params.temperature for i in rows], dtype=torch.float32).unsqueeze(1)
            weights, ids = self._filter(torch.softmax(logits[rows] / temp, dim=-1), [reqs[i] for i in rows])
            picked = sample_rows(weights, list(range(len(rows))), uniforms[filtered])
            if ids is not None:
                picked = ids.gather(1, picked.unsqueeze(1)).squeeze(1)
            for i, t in zip(rows, picked.tolist(), strict=True):
                token_ids[i] = t
        return token_ids

    def _uniforms(self, reqs: list[Request]) -> torch.Tensor:
        """One uniform in [0, 1) per request: seeded requests from their own generator."""
        u = torch.rand(len(reqs), dtype=torch.float64, generator=self.generator)
        for j, r in enumerate(reqs):
            if r.generator is not None:
                u[j] = torch.rand(1, dtype=torch.float64, generator=r.generator)[0]
        return u


# top-k / top-p look at this many most likely tokens first (a partial sort, 3 ms for 32 x 49152
# where a full sort took 62 ms); only rows whose nucleus is wider get the full sort
_TOP_CANDIDATES = 256


def _top_k_top_p(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Zero every token outside each row's top-k and outside its nucleus (the most likely tokens
    whose mass before them is under top_p of the row's mass); the most likely token always stays.

    Returns (weights, ids): when every row's kept tokens lie among its candidates, weights is
    [rows, candidates] and ids[r, j] the token of weights[r, j] (the kernel then draws from 256
    columns, not the vocabulary); otherwise weights is over the whole vocabulary and ids is None."""
    n = probs.shape[1]
    k = torch.tensor([kk if kk > 0 else n for kk in top_k]).unsqueeze(1)
    p = torch.tensor(top_p, dtype=probs.dtype).unsqueeze(1)
    total = probs.sum(dim=-1, keepdim=True)
    width = min(n, _TOP_CANDIDATES)
    sorted_p, order = probs.topk(width, dim=-1)
    mass = sorted_p.cumsum(dim=-1)
    # every token past the candidates is dropped when top-k stops inside them or they hold the nucleus
    decided = ((k <= width) | (mass[:, -1:] >= p * total)).squeeze(1)
    kept = _keep(sorted_p, mass, k, p * total)
    if width == n or decided.all():
        return kept, order
    # some rows keep more: give every row the whole vocabulary; rows with neither top-k nor top-p (min-p
    # only, in a batch with filtered rows) keep everything; sort just the rows whose nucleus is wider
    out = torch.zeros_like(probs).scatter_(1, order, kept)
    keep_all = ((k >= n) & (p >= 1.0)).squeeze(1) & ~decided
    out[keep_all] = probs[keep_all]
    wide = (~decided & ~keep_all).nonzero().flatten()
    if len(wide) == 0:
        return out, None
    sorted_p, order = probs[wide].sort(dim=-1, descending=True)
    out[wide] = torch.zeros_like(sorted_p).scatter_(
        1, order, _keep(sorted_p, sorted_p.cumsum(dim=-1), k[wide], p[wide] * total[wide]))
    return out, None


def _keep(sorted_p: torch.Tensor, mass: torch.Tensor, k: torch.Tensor, nucleus: torch.Tensor) -> torch.Tensor:
    """Descending probabilities with those past rank k, or past `nucleus` mass before them, zeroed."""
    rank = torch.arange(sorted_p.shape[1]).unsqueeze(0)
    drop = (rank >= k) | (mass - sorted_p >= nucleus)
    drop[:, 0] = False
    return sorted_p.masked_fill(drop, 0.0)


def plain_greedy(r: Request) -> bool:
    """A row `process` leaves alone and `_choose` takes the argmax of, with no logprobs to compute."""
    p = r.params
    return (p.temperature <= 0 and p.logprobs is None and not p.needs_penalties and not p.logit_bias
            and not p.allowed_token_ids and not p.bad_words_token_ids and r.grammar is None
            and r.num_output_tokens >= p.min_tokens)


def _needs_filter(r: Request) -> bool:
    p = r.params
    return bool(p.min_p) or bool(p.top_k) or p.top_p < 1.0


def _padded(rows: list[list[int]], fill: int) -> torch.Tensor:
    """Token-id lists as one [len(rows), longest] tensor, padded with `fill` (at least one column)."""
    out = torch.full((len(rows), max(1, max(len(r) for r in rows))), fill, dtype=torch.long)
    for j, r in enumerate(rows):
        out[j, :len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def target_logprobs(logits: torch.Tensor, targets: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Prompt logprobs: row i's log-probability of `targets[i]` (from the raw distribution, as sampled
    tokens' logprobs are), its rank and the `ks[i]` most likely tokens."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(targets, dtype=torch.long, device=raw.device).unsqueeze(1)
    chosen = raw.gather(1, ids)
    ranks = (raw > chosen).sum(dim=-1) + 1
    top_vals, top_ids = raw.topk(max(1, max(ks)), dim=-1)
    chosen_l, ranks_l, vals_l, ids_l = chosen[:, 0].tolist(), ranks.tolist(), top_vals.tolist(), top_ids.tolist()
    return [TokenLogprobs(chosen_l[i], int(ranks_l[i]), list(zip(ids_l[i][:k], vals_l[i][:k], strict=True)))
            for i, k in enumerate(ks)]

