"""Prompt-lookup n-gram proposer: find the request's last n tokens earlier in its own tokens (prompt and
output so far) and propose what followed them there.

For n from `max_n` down to `min_n`, the most recent earlier occurrence of the last n tokens wins; the
draft is the tokens after it (up to k). Stateless and pure CPU: a few searches in C over the sequence's bytes per
request per step (`find_match`), so no index to keep in sync with preemption or rollback. No confidence: a
match says nothing about how likely the continuation is; the draft carries the match's length
(`Draft.match`), which the speculator reads as a reason to try a request it knows nothing about yet.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from deepinfer.engine.request import Request
from deepinfer.engine.spec.proposer import Draft, Proposer


@dataclass(frozen=True)
class LookupPlan:
    """Prompt lookup as a C call's steps do it (`FusedDecoder.spec_steps`): the n-gram sizes and lookback of
    `find_match`, and the draft length for each match length m (index 0..max_n). `explores`: some of those
    lengths are exploration's (`tries.py`), not the price's: the call stays short (`Speculator.EXPLORE_CALL_STEPS`)."""

    k_by_match: tuple[int, ...]
    min_n: int
    max_n: int
    lookback: int
    explores: bool = False


class NgramProposer(Proposer):
    name = "ngram"
    skippable = True

    def __init__(self, min_n: int = 2, max_n: int = 5, max_lookback: int = 8192) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.max_lookback = max_lookback  # scan at most this many recent tokens (bounded cost per step)

    def propose(self, req: Request, max_tokens: int) -> Draft:
        draft, match = find_match(req.token_ids[-self.max_lookback:], self.min_n, self.max_n, max_tokens)
        return Draft(tuple(draft), match=match)

    def likely_to_propose(self, req: Request) -> bool:
        """The request's last `min_n` tokens occur earlier (what `find_match` needs): a few µs of list
        search. Chat output finds a match at ~11% of positions, code edits at ~86% (spec.py's prompts)."""
        tokens = req.token_ids[-self.max_lookback:]
        return len(tokens) > self.min_n and _occurs_earlier(tokens, self.min_n)


def find_continuation(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The up to `k` tokens after the most recent earlier occurrence of the longest suffix of `tokens`
    (length `max_n` down to `min_n`) that occurs earlier; [] if none does."""
    return find_match(tokens, min_n, max_n, k)[0]


def find_match(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[list[int], int]:
    """`find_continuation`'s tokens and the length of the suffix matched (0 with no draft).

    The tokens as 4-byte integers in one bytes object, and for n from the longest down, `bytes.rfind` of
    the last n tokens' bytes before the final token (a hit at an offset that is not a whole token is skipped):
    a search in C instead of numpy arrays built and compared every step. It runs for every decode of every
    step, between model steps that have evicted its code and data from the caches: the numpy version
    took ~70 us a request there (code edits at batch 32 on the AVX2 machine: ~2 ms a step, 2% of it)."""
    n_tok = len(tokens)
    if k <= 0 or n_tok <= min_n or not _occurs_earlier(tokens, min_n):
        return [], 0
    buf = array("i", tokens).tobytes()
    end = n_tok - 1  # a match must end before the last token (something follows it)
    for n in range(min(max_n, end), min_n - 1, -1):
        pattern = buf[4 * (n_tok - n):]
        hi = 4 * end
        while (pos := buf.rfind(pattern, 0, hi)) >= 0:
            if pos % 4 == 0:
                start = pos // 4 + n
                return tokens[start:start + k], n
            hi = pos + len(pattern) - 1  # straddles tokens: look further back
    return [], 0


def _occurs_earlier(tokens: list[int], n: int) -> bool:
    """Whether the last `n` tokens occur earlier (a match `find_match` would need): list searches in C, no
    array built. Most steps of a workload that does not repeat itself (chat) end here, at a few µs where
    building the array cost tens."""
    end = len(tokens) - 1
    last, tail = tokens[end], tokens[end - n + 1:]
    i = n - 2
    while True:
        try:
            i = tokens.index(last, i + 1, end)
        except ValueError:
            return False
        if tokens[i - n + 1:i + 1] == tail:
            return True
