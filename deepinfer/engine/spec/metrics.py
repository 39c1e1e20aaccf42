"""Speculative decoding counters, per proposer: verification steps, draft tokens, accepted tokens, and
histograms of the draft length chosen (k) and of the tokens each verification emitted, and the proposals
checked in hindsight (not drafted: compared with the tokens decoded after them). Read by
`LLMEngine.stats()` (and so `/metrics`); per request, `Request.spec` carries its own totals. A router
merges its workers' counters per proposer (`merge_spec_stats`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    proposer: str
    max_k: int
    num_verifications: int = 0  # request-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted + the target's token, over verifications
    k_chosen: list[int] = field(default_factory=list)  # count per k = 0..max_k, over decode request-steps
    # proposals not drafted, checked in hindsight against the tokens decoded after them (`Speculator`)
    num_hindsight_checks: int = 0
    num_hindsight_tried: int = 0  # their tokens up to and including the first mismatch
    num_hindsight_kept: int = 0  # their tokens a verification would have kept

    def __post_init__(self) -> None:
        if not self.k_chosen:
            self.k_chosen = [0] * (self.max_k + 1)

    def chose(self, k: int, times: int = 1) -> None:
        self.k_chosen[min(k, self.max_k)] += times

    def verified(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.num_verifications += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.num_emitted_tokens += accepted + 1

    def hindsight(self, tried: int, kept: int) -> None:
        self.num_hindsight_checks += 1
        self.num_hindsight_tried += tried
        self.num_hindsight_kept += kept

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Mean tokens emitted per verification (accepted drafts + 1)."""
        return self.num_emitted_tokens / self.num_verifications if self.num_verifications else 0.0

    def stats(self) -> dict[str, float | str]:
        return {
            "spec_proposer": self.proposer,
            "spec_verifications": self.num_verifications,
            "spec_draft_tokens": self.num_draft_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "spec_emitted_tokens": self.num_emitted_tokens,
            "spec_acceptance_rate": self.acceptance_rate,
            "spec_mean_accepted_length": self.mean_accepted_length,
            "spec_hindsight_checks": self.num_hindsight_checks,
            "spec_hindsight_tried_tokens": self.num_hindsight_tried,
            "spec_hindsight_kept_tokens": self.num_hindsight_kept,
            **{f"spec_k_chosen_{k}": n for k, n in enumerate(self.k_chosen)},
        }


def _ratios(d: dict[str, float]) -> dict[str, float]:
    d["spec_acceptance_rate"] = d["spec_accepted_tokens"] / d["spec_draft_tokens"] if d["spec_draft_tokens"] else 0.0
    d["spec_mean_accepted_length"] = (d["spec_emitted_tokens"] / d["spec_verifications"]
                                      if d["spec_verifications"] else 0.0)
    return d


def merge_spec_stats(stats: Iterable[Mapping[str, object]]) -> dict[str, dict[str, float]]:
    """Several engines' stats (a router's workers) -> per proposer name, their speculative counters and
    k histograms summed and the acceptance rate / mean accepted length recomputed from the sums (a sum or
    mean of per-worker ratios would weigh an idle worker like a busy one). Engines without speculation
    are skipped."""
    out: dict[str, dict[str, float]] = {}
    for s in stats:
        name = s.get("spec_proposer")
        if not isinstance(name, str):
            continue
        d = out.setdefault(name, {"spec_verifications": 0.0, "spec_draft_tokens": 0.0, "spec_accepted_tokens": 0.0,
                                  "spec_emitted_tokens": 0.0})
        for k, v in s.items():
            if k.startswith("spec_") and isinstance(v, int | float) and k not in (
                    "spec_acceptance_rate", "spec_mean_accepted_length"):
                d[k] = d.get(k, 0.0) + v
    return {name: _ratios(d) for name, d in out.items()}
