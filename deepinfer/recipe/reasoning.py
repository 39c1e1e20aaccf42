"""Reasoning parsers: split a thinking model's output into reasoning and the answer.

    <think> reasoning ... </think> answer          DeepSeek-R1, Qwen3, QwQ (the `think` parser)

Some templates open `<think>` in the generation prompt (DeepSeek-R1, thinking Qwen3 variants): the
output then starts inside the reasoning, and everything before `</think>` is reasoning. Otherwise
the reply is reasoning only if it starts with `<think>`. A reply that ends while still thinking is
all reasoning. The tags must be kept in the decoded text (in these models they are added tokens
that are not special). Fed text deltas, the parser returns ("reasoning" | "content", text) pieces,
holding back a partial tag; leading whitespace of each section is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.recipe.tool_parsers import _partial_suffix


@dataclass
class ThinkReasoningParser:
    start_tag: str = "<think>"
    end_tag: str = "</think>"
    in_reasoning: bool = False  # the prompt opened the thinking section
    reasoning: str = ""
    content: str = ""

    def __post_init__(self) -> None:
        self._state = "reasoning" if self.in_reasoning else "detect"
        self._buf = ""
        self._section_start = True

    def feed(self, delta: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._buf += delta
        while self._buf:
            if self._state == "detect":
                stripped = self._buf.lstrip()
                if not stripped:
                    break
                if stripped.startswith(self.start_tag):
                    self._buf = stripped[len(self.start_tag):]
                    self._state, self._section_start = "reasoning", True
                    continue
                if self.start_tag.startswith(stripped):
                    break  # maybe the tag
                self._state = "content"
                continue
            if self._state == "reasoning":
                i = self._buf.find(self.end_tag)
                if i < 0:
                    keep = _partial_suffix(self._buf, self.end_tag)
                    self._put(out, "reasoning", self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                self._put(out, "reasoning", self._buf[:i])
                self._buf = self._buf[i + len(self.end_tag):]
                self._state, self._section_start = "content", True
                continue
            self._put(out, "content", self._buf)
            self._buf = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self._buf:
            self._put(out, "content" if self._state != "reasoning" else "reasoning", self._buf)
            self._buf = ""
        return out

    def _put(self, out: list[tuple[str, str]], kind: str, text: str) -> None:
        if self._section_start:
            text = text.lstrip()
            if not text:
                return
            self._section_start = False
        if not text:
            return
        if kind == "reasoning":
            self.reasoning += text
        else:
            self.content += text
        out.append((kind, text))


REASONING_PARSERS = {"think": ThinkReasoningParser, "deepseek_r1": ThinkReasoningParser,
                     "qwen3": ThinkReasoningParser}


def resolve_reasoning_parser(name: str, chat_template: str | None) -> str | None:
    """The parser a server uses: `name`, or for "auto" the `think` parser when the template mentions
    <think>; None when off. ValueError for an unknown name."""
    if name == "none":
        return None
    if name == "auto":
        return "think" if isinstance(chat_template, str) and "<think>" in chat_template else None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: auto, none, {', '.join(REASONING_PARSERS)}")
    return name


def prompt_opens_thinking(tokenizer, prompt_ids: list[int], start_tag: str = "<think>",
                          end_tag: str = "</think>") -> bool:
    """True when the rendered prompt ends inside an open thinking section (the template opened it)."""
    tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
    return tail.rfind(start_tag) > tail.rfind(end_tag)


def reasoning_token_count(tokenizer, token_ids: list[int], reasoning: str, end_tag: str = "</think>") -> int:
    """Generated tokens spent reasoning: up to and including the end tag's token (exact when the tag is one
    token), else the reasoning text's token count."""
    if not reasoning and not token_ids:
        return 0
    end_id = tokenizer.convert_tokens_to_ids(end_tag) if tokenizer is not None else None
    if isinstance(end_id, int) and end_id != tokenizer.unk_token_id:
        if end_id in token_ids:
            return token_ids.index(end_id) + 1
        return len(token_ids) if reasoning else 0
    if not reasoning:
        return 0
    return min(len(token_ids), len(tokenizer.encode(reasoning, add_special_tokens=False)))
