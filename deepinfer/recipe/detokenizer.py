"""Incremental detokenization with stop strings.

Text grows one token at a time through `tokenizers`' DecodeStream, which holds
back incomplete UTF-8 sequences, so a multi-byte character is never split.
Stop strings are matched against the accumulated text, across token boundaries;
while generation continues, the last (longest stop string - 1) characters are held
back so a stop string's beginning is never emitted before it is known to match.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

_CONTEXT_TOKENS = 6  # prompt tokens fed first so the first output token gets its leading space right


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], skip_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False) -> None:
        self._backend = tokenizer.backend_tokenizer if tokenizer is not None else None
        self._stream = None
        if self._backend is not None:
            self._stream = DecodeStream(ids=prompt_token_ids[-_CONTEXT_TOKENS:],
                                        skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._text = ""  # everything decoded so far
        self.stopped_by: str | None = None

    def add_token(self, token_id: int) -> str | None:
        """Feed one generated token; returns the stop string if one now matches."""
        if self._stream is None or self.stopped_by is not None:
            return self.stopped_by
        piece = self._stream.step(self._backend, token_id)
        if not piece:
            return None
        search_from = max(0, len(self._text) - self._holdback)
        self._text += piece
        hits = [(i, s) for s in self.stop if (i := self._text.find(s, search_from)) != -1]
        if not hits:
            return None
        i, s = min(hits)
        self._text = self._text[: i + len(s)] if self.include_stop else self._text[:i]
        self.stopped_by = s
        return s

    def text(self, finished: bool) -> str:
        """The text safe to show: all of it once finished, else without the held-back tail."""
        if finished or self.stopped_by is not None or not self._holdback:
            return self._text
        return self._text[: max(0, len(self._text) - self._holdback)]
