"""Batched sampling: penalties, logit bias, min_tokens, grammar masks, temperature, top-k / top-p /
min-p, seeds, logprobs.

All rows are processed as one [B, vocab] tensor; per-row parameters become
column vectors. Random rows sample by the exponential race (argmax of p / E with
E ~ Exp(1)), which lets a seeded request draw its noise from its own generator
while unseeded rows share one draw. Logprobs come from the raw model
distribution, before any processing. Structured-output rows get their grammar's token bitmask
(filled for all of them in one batched call, applied in one call) after the logit bias, so a bias
can never re-allow a token the grammar forbids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.engine.request import Request
from deepinfer.layers.cpu_kernels import argmax_rows


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
        logits = logits.float()
        lp_rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None
        logits = self._apply_penalties(logits, reqs)
        logits = self._apply_logit_bias(logits, reqs)
        logits = self._apply_min_tokens(logits, reqs)
        self._apply_grammar(logits, reqs)
        temps = [r.params.temperature for r in reqs]
        tokens = argmax_rows(logits)
        if any(t > 0 for t in temps):
            temp = torch.tensor([t if t > 0 else 1.0 for t in temps], dtype=torch.float32).unsqueeze(1)
            probs = self._filter(torch.softmax(logits / temp, dim=-1), reqs)
            sampled = argmax_rows(probs / self._exponential_noise(probs.shape, reqs))
            tokens = torch.where(torch.tensor([t == 0 for t in temps]), tokens, sampled)
        token_ids = tokens.tolist()
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
    def _filter(probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        min_p = [r.params.min_p for r in reqs]
        if any(min_p):
            thresh = torch.tensor(min_p).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < thresh, 0.0)
        top_k = [r.params.top_k for r in reqs]
        top_p = [r.params.top_p for r in reqs]
        if any(top_k) or any(p < 1.0 for p in top_p):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            rank = torch.arange(probs.shape[1]).unsqueeze(0)
            k = torch.tensor([k if k > 0 else probs.shape[1] for k in top_k]).unsqueeze(1)
            drop = rank >= k
            mass_before = sorted_p.cumsum(dim=-1) - sorted_p
            drop |= mass_before >= torch.tensor(top_p).unsqueeze(1) * sorted_p.sum(dim=-1, keepdim=True)
            drop[:, 0] = False  # always keep the most likely token
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
        return probs

    def _exponential_noise(self, shape: torch.Size, reqs: list[Request]) -> torch.Tensor:
        noise = torch.empty(shape).exponential_(generator=self.generator)
        for i, r in enumerate(reqs):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        return noise


def _padded(rows: list[list[int]], fill: int) -> torch.Tensor:
    """Token-id lists as one [len(rows), longest] tensor, padded with `fill` (at least one column)."""
    out = torch.full((len(rows), max(1, max(len(r) for r in rows))), fill, dtype=torch.long)
    for j, r in enumerate(rows):
        out[j, :len(r)] = torch.tensor(r, dtype=torch.long)
    return out
