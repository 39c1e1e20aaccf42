"""Which requests propose at all, and which verify drafts the price alone would not give them: the
adaptive draft length's back-off and exploration rules (`Speculator.propose` applies them around the
price-driven choice of `policy.DraftLengthPolicy`).

Back-off: a request whose last `misses` verifications kept no draft stops proposing for `first_backoff`
steps (no proposer lookup, no candidate: a decode step of its own costs what it costs without
speculation), then proposes again; each further run of misses doubles the pause (up to `max_backoff`),
a kept draft resets it. Misses alone lower the request's estimate too, but the estimate drifts back to
the prior on idle steps (so the request is looked up every step and tried again soon); the back-off
bounds how often a request whose drafts keep missing (chat) costs a lookup and a wasted verification.

Exploration: the price decides from the request's estimates, which only verification teaches; at a
batch past the C decode path's 8 rows the first draft row costs a jump the prior's estimates do not
repay, so nothing is ever tried and nothing learned (code edits at batch 8 verified no drafts while a
fixed k = 5 gained 1.14x). A request tried fewer than `tries` times whose proposal copies a place that
matched at least `min_match` of its last tokens (an n-gram that long rarely repeats by chance) verifies
at least `tokens` drafts: a few steps per request, after which its estimates decide. Proposers that say
nothing about their match (`Draft.match == 0`) are never explored. Requests not eligible for the price's
choice are looked up for exploration every `lookup_every` steps only (a lookup costs tens of µs, and the
engine schedules that step fresh instead of ahead of the one in flight).

Exploration's budget (`ExploreLedger`): explored drafts cost the rows the price would not have bought, and
earn the tokens they keep. The ledger charges each exploring step its predicted extra seconds (the step
price at the explored row count less the price at the chosen one, plus, where the price chose no drafts,
a drafting step's extra host time: `StepPrice.draft_host_seconds` less `host_seconds`) and each exploration lookup a tenth of a
step (the overlap it gives up), refunds every kept explored token at the step's seconds per token, and
allows exploration while the net charge stays within `budget` of the decode steps' measured time (plus
one step's worth at start, so a fresh engine can try at once). Where explored drafts are kept (code
edits) the refunds pay for it and the estimates they teach soon make the price choose drafts itself;
where they are not (chat at batch 8, whose long n-gram matches are rarely kept, each try paying the
9th row's jump) exploration stops at `budget` of the time. It exists for a start-up price table measured
in a noisy moment: on the 2-core AVX2 machine one engine start priced a batch-1 draft row above what the
prior's estimate earns, so no draft was ever verified, nothing learned and the table never corrected
(code_edit b=1 0.74x of a fixed k = 5, session 21).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.engine.spec.policy import AcceptanceStats
from deepinfer.engine.spec.proposer import Draft


@dataclass(frozen=True)
class TryRules:
    """The back-off is off by default (`misses=0`): measured on the shared machine (BENCHMARKS.md,
    "adaptive draft length: the k = 0 step, back-off and exploration") it stopped json b=1 drafting where
    the prior's optimism pays (rows on the C path are cheap). Exploration is on within its budget (without
    one, at batch 8 it paid the row-count jump on chat and json requests whose long matches were not kept:
    chat b=8 0.86x of no speculation)."""

    misses: int = 0  # consecutive verifications that kept nothing before a back-off (0: never back off)
    first_backoff: int = 8  # steps
    max_backoff: int = 128
    tries: int = 2  # exploration: verifications a request gets on the strength of its match alone (0: none)
    min_match: int = 3  # tokens the proposal's match must span
    tokens: int = 4  # drafts an exploring request verifies
    lookup_every: int = 4  # steps between exploration lookups of requests the price would not draft
    budget: float = 0.02  # exploration's net cost as a share of the decode steps' time (`ExploreLedger`)

    def backed_off(self, state: AcceptanceStats, step: int) -> bool:
        return step < state.backoff_until

    def explorable(self, state: AcceptanceStats) -> bool:
        """Still owed exploration tries (whether its proposal earns one depends on the match)."""
        return self.tries > 0 and state.tried[0] < self.tries if state.tried else False

    def explore(self, state: AcceptanceStats, draft: Draft) -> int:
        """Drafts an untried request verifies on the strength of its proposal's match (0: none)."""
        if draft.match >= self.min_match and self.explorable(state):
            return min(len(draft), self.tokens)
        return 0

    def after_verify(self, state: AcceptanceStats, drafted: int, accepted: int, step: int) -> None:
        """Count a miss or reset; start a back-off after `misses` misses in a row."""
        if drafted <= 0:
            return
        if accepted:
            state.misses = 0
            state.backoff_steps = 0
            return
        if self.misses <= 0:
            return
        state.misses += 1
        if state.misses >= self.misses:
            state.misses = 0
            state.backoff_steps = min(self.max_backoff, 2 * state.backoff_steps or self.first_backoff)
            state.backoff_until = step + state.backoff_steps


@dataclass
class ExploreLedger:
    """Exploration's net cost against the time it may spend (module docstring). Seconds throughout."""

    spent: float = 0.0  # charges less refunds
    elapsed: float = 0.0  # measured decode-phase step time
    step: float = 0.0  # the latest such step's time: the start-up allowance
    LOOKUP_SHARE = 0.1  # of a step: an exploration lookup step run fresh instead of overlapped

    def allows(self, budget: float) -> bool:
        return budget > 0 and self.spent <= budget * self.elapsed + self.step

    def observe(self, seconds: float, steps: int = 1) -> None:
        """`steps` decode-phase steps took `seconds` (several in one call: `num_scheduler_steps`)."""
        self.elapsed += seconds
        self.step = seconds / steps

    def charge(self, seconds: float) -> None:
        self.spent += max(0.0, seconds)

    def refund(self, seconds: float) -> None:
        self.spent -= max(0.0, seconds)
