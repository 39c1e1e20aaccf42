"""Suffix proposer: an index over each request's own tokens (prompt and output so far) and, optionally,
over the last few finished requests, proposing the continuation of the longest matching suffix.

`SuffixIndex` maps every context of 1..`max_depth` tokens seen in a sequence to the tokens that followed
it (count and latest position). To draft, the proposer takes the longest suffix of the request's tokens
(drafts included, token by token) that the index knows, with at least `min_match` tokens, and proposes
its most frequent continuation (the latest on ties); the draft's confidence at each token is that
continuation's share of the context's continuations, and drafting stops when the product of those
falls under `min_confidence`. The per-request index grows as tokens are appended (indexed lazily, at
proposal time, from where it stopped); tokens never change once appended (preemption keeps them), so it
never needs a rollback. With `recent_requests` > 0 a shared index also holds the whole token sequences
of that many recently finished requests (repeated prompts, agent loops); a context known to both is
answered by the longer match, the request's own on a tie.
"""

from __future__ import annotations

from collections import deque

from deepinfer.engine.request import Request
from deepinfer.engine.spec.proposer import Draft, Proposer


class SuffixIndex:
    """context (tuple of 1..max_depth tokens) -> {next token: [count, latest position]}."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.table: dict[tuple[int, ...], dict[int, list[int]]] = {}
        self.num_indexed = 0

    def extend(self, tokens: list[int]) -> None:
        """Index the positions of `tokens` from `num_indexed` on (`tokens` extends what was indexed)."""
        table, depth = self.table, self.max_depth
        for p in range(max(1, self.num_indexed), len(tokens)):
            nxt = tokens[p]
            for d in range(1, min(depth, p) + 1):
                entry = table.setdefault(tuple(tokens[p - d:p]), {}).setdefault(nxt, [0, p])
                entry[0] += 1
                entry[1] = p
        self.num_indexed = len(tokens)

    def remove(self, tokens: list[int]) -> None:
        """Undo `extend(tokens)` of a whole sequence (for the bounded index of recent requests)."""
        table, depth = self.table, self.max_depth
        for p in range(1, len(tokens)):
            for d in range(1, min(depth, p) + 1):
                ctx = tuple(tokens[p - d:p])
                nexts = table.get(ctx)
                if nexts is None or tokens[p] not in nexts:
                    continue
                nexts[tokens[p]][0] -= 1
                if nexts[tokens[p]][0] <= 0:
                    del nexts[tokens[p]]
                if not nexts:
                    del table[ctx]

    def longest(self, tokens: list[int]) -> tuple[int, dict[int, list[int]] | None]:
        """(length, continuations) of the longest suffix of `tokens` the index knows; (0, None) if none."""
        for d in range(min(self.max_depth, len(tokens)), 0, -1):
            nexts = self.table.get(tuple(tokens[-d:]))
            if nexts:
                return d, nexts
        return 0, None


class SuffixProposer(Proposer):
    name = "suffix"
    skippable = True
    confident = True

    def __init__(self, max_depth: int = 8, min_match: int = 2, min_confidence: float = 0.1,
                 recent_requests: int = 0) -> None:
        if not 1 <= min_match <= max_depth:
            raise ValueError(f"suffix proposer: need 1 <= min_match <= max_depth, got {min_match}, {max_depth}")
        if not 0 <= min_confidence <= 1:
            raise ValueError(f"suffix proposer: min_confidence must be in [0, 1], got {min_confidence}")
        if recent_requests < 0:
            raise ValueError(f"suffix proposer: recent_requests must be >= 0, got {recent_requests}")
        self.max_depth, self.min_match, self.min_confidence = max_depth, min_match, min_confidence
        self.indexes: dict[str, SuffixIndex] = {}
        self.recent_limit = recent_requests
        self.recent = SuffixIndex(max_depth)
        self._recent_seqs: deque[list[int]] = deque()

    def propose(self, req: Request, max_tokens: int) -> Draft:
        index = self.indexes.get(req.request_id)
        if index is None:
            index = self.indexes[req.request_id] = SuffixIndex(self.max_depth)
        index.extend(req.token_ids)
        context = req.token_ids[-self.max_depth:]
        draft: list[int] = []
        conf: list[float] = []
        joint = 1.0
        while len(draft) < max_tokens:
            d, nexts = index.longest(context)
            if self.recent_limit:
                rd, rnexts = self.recent.longest(context)
                if rd > d:
                    d, nexts = rd, rnexts
            if d < self.min_match or nexts is None:
                break
            token, (count, _) = max(nexts.items(), key=lambda kv: (kv[1][0], kv[1][1]))
            share = count / sum(c for c, _ in nexts.values())
            joint *= share
            if joint < self.min_confidence:
                break
            draft.append(token)
            conf.append(share)
            context = (context + [token])[-self.max_depth:]
        return Draft(tuple(draft), tuple(conf))

    def on_finished(self, req: Request) -> None:
        self.indexes.pop(req.request_id, None)
        if self.recent_limit:
            seq = list(req.token_ids)
            self.recent.num_indexed = 0
            self.recent.extend(seq)
            self._recent_seqs.append(seq)
            while len(self._recent_seqs) > self.recent_limit:
                self.recent.remove(self._recent_seqs.popleft())
