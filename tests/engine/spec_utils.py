"""Helpers for the speculative decoding tests: engines with and without speculation, and a test proposer
that drafts a known reference continuation with some tokens corrupted (so every acceptance length and
rollback across block boundaries happens, which a real proposer on a random model rarely does)."""

from __future__ import annotations

import random

from deepinfer import LLM, SamplingParams
from deepinfer.engine.request import Request
from deepinfer.engine.spec.policy import AcceptanceStats
from deepinfer.engine.spec.proposer import Draft, Proposer


def spec_config(method: str, k: int = 5, adaptive: bool = False, **kw) -> dict:
    return {"method": method, "num_speculative_tokens": k, "adaptive": adaptive, **kw}


class CorruptedOracle(Proposer):
    """Drafts `reference[prompt]`'s next tokens, each replaced by a random token with probability `noise`."""

    name = "oracle"

    def __init__(self, reference: dict[tuple[int, ...], list[int]], vocab: int, noise: float = 0.3,
                 seed: int = 0) -> None:
        self.reference, self.vocab, self.noise = reference, vocab, noise
        self.rng = random.Random(seed)

    def propose(self, req: Request, max_tokens: int) -> Draft:
        ref = self.reference.get(tuple(req.prompt_token_ids), [])
        done = req.num_output_tokens
        out = [t if self.rng.random() > self.noise else self.rng.randrange(self.vocab)
               for t in ref[done:done + max_tokens]]
        return Draft(tuple(out))


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def assert_all_free(llm: LLM) -> None:
    kv = llm.engine.core.kv
    for g in kv.groups:
        assert g.pool.num_used == 0, "a KV block leaked"
        assert not g.tables


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def random_acceptance_stats(rng, n: int, rates: list[float] | None = None,
                            relax_weight: float = 0.0) -> list[AcceptanceStats]:
    """`n` requests' acceptance estimates (k_max 16, starting from `rates` or the prior 0.6) after a random
    history: up to 3 verifications of up to 16 drafts, then up to 29 idle steps (some with nothing found)."""
    stats = [AcceptanceStats.new(0.6, 16, relax_weight, rates) for _ in range(n)]
    for s in stats:
        for _ in range(int(rng.integers(0, 4))):
            d = int(rng.integers(1, 17))
            s.observe(d, int(rng.integers(0, d + 1)), 0.3)
        for _ in range(int(rng.integers(0, 30))):
            s.relax(unmatched=bool(rng.integers(0, 2)))
    return stats
