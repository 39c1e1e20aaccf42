"""Prompt-lookup n-gram proposer: find the request's last n tokens earlier in its own tokens (prompt and
output so far) and propose what followed them there.

For n from `max_n` down to `min_n`, the most recent earlier occurrence of the last n tokens wins; the
draft is the tokens after it (up to k). Pure CPU: a few searches in C over the sequence's bytes per request
per step (`find_match`), so no index to keep in sync with preemption or rollback. No confidence: a
match says nothing about how likely the continuation is; the draft carries the match's length
(`Draft.match`), which the speculator reads as a reason to try a request it knows nothing about yet.

Copying past an edit. Output that copies earlier text with changes (a renamed identifier, an edited
line) diverges from its source at the changed token: the target rejects the copied token and emits its
own, and the last tokens then occur nowhere earlier, so a plain lookup drafts nothing until the copy has
gone on for `min_n` tokens. After such a rejection the proposer remembers where the copy stood and, if
the lookup finds nothing at the next step, drafts from the source token after the rejected one (the
edit taken as one token for one token). The only state: one position per request, valid only while the
request has exactly the tokens it had when it was recorded.
"""

from __future__ import annotations

from array import array

from deepinfer.engine.request import Request
from deepinfer.engine.spec.proposer import Draft, Proposer


class NgramProposer(Proposer):
    name = "ngram"
    skippable = True

    def __init__(self, min_n: int = 2, max_n: int = 5, max_lookback: int = 8192) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.max_lookback = max_lookback  # scan at most this many recent tokens (bounded cost per step)
        # request id -> (where its last draft was copied from, the request's length then), for `on_verified`
        self._copied: dict[str, tuple[int, int]] = {}
        # request id -> (the source position to copy from next, the request's length it is valid at)
        self._resume: dict[str, tuple[int, int]] = {}

    def propose(self, req: Request, max_tokens: int) -> Draft:
        tokens = req.token_ids
        window = len(tokens) - len(tokens[-self.max_lookback:])  # where the searched tokens start
        draft, match, at = find_source(tokens[-self.max_lookback:], self.min_n, self.max_n, max_tokens)
        rid = req.request_id
        resume = self._resume.pop(rid, None)
        if not draft and resume is not None and resume[1] == len(tokens):
            at = resume[0]
            draft, match, window = tokens[at:at + max_tokens], 1, 0
        if draft:
            self._copied[rid] = (window + at, len(tokens))
        else:
            self._copied.pop(rid, None)
        return Draft(tuple(draft), match=match)

    def on_verified(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        """A rejected copy: the next lookup may resume the copy past the token the target replaced."""
        copied = self._copied.pop(req.request_id, None)
        if copied is None or num_accepted >= num_drafted:
            return
        source, length = copied
        # called before the kept drafts and the target's own token (in place of the rejected draft) are
        # appended: the resume point is good once they are
        if len(req.token_ids) == length and source + num_accepted + 1 < length:
            self._resume[req.request_id] = (source + num_accepted + 1, length + num_accepted + 1)

    def on_finished(self, req: Request) -> None:
        self._copied.pop(req.request_id, None)
        self._resume.pop(req.request_id, None)

    def likely_to_propose(self, req: Request) -> bool:
        """The request's last `min_n` tokens occur earlier (what `find_match` needs), or a copy resumes: a
        few µs of list search. Chat output finds a match at ~11% of positions, code edits at ~86% (spec.py's
        prompts)."""
        resume = self._resume.get(req.request_id)
        if resume is not None and resume[1] == len(req.token_ids):
            return True
        tokens = req.token_ids[-self.max_lookback:]
        return len(tokens) > self.min_n and _occurs_earlier(tokens, self.min_n)


def find_continuation(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The up to `k` tokens after the most recent earlier occurrence of the longest suffix of `tokens`
    (length `max_n` down to `min_n`) that occurs earlier; [] if none does."""
    return find_match(tokens, min_n, max_n, k)[0]


def find_match(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[list[int], int]:
    """`find_continuation`'s tokens and the length of the suffix matched (0 with no draft)."""
    return find_source(tokens, min_n, max_n, k)[:2]


def find_source(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[list[int], int, int]:
    """`find_match`'s tokens and match length, and the position in `tokens` the tokens start at (0 with no
    draft).

    The tokens as 4-byte integers in one bytes object, and for n from the longest down, `bytes.rfind` of
    the last n tokens' bytes before the final token (a hit at an offset that is not a whole token is skipped):
    a search in C instead of numpy arrays built and compared every step. It runs for every decode of every
    step, between model steps that have evicted its code and data from the caches: the numpy version
    took ~70 us a request there (code edits at batch 32 on the AVX2 machine: ~2 ms a step, 2% of it)."""
    n_tok = len(tokens)
    if k <= 0 or n_tok <= min_n or not _occurs_earlier(tokens, min_n):
        return [], 0, 0
    buf = array("i", tokens).tobytes()
    end = n_tok - 1  # a match must end before the last token (something follows it)
    for n in range(min(max_n, end), min_n - 1, -1):
        pattern = buf[4 * (n_tok - n):]
        hi = 4 * end
        while (pos := buf.rfind(pattern, 0, hi)) >= 0:
            if pos % 4 == 0:
                start = pos // 4 + n
                return tokens[start:start + k], n, start
            hi = pos + len(pattern) - 1  # straddles tokens: look further back
    return [], 0, 0


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
