"""One request's output, parsed as it streams: reasoning, then content and tool calls.

    text deltas ──▶ reasoning parser ──reasoning──────────────────────────▶ Reasoning(text)
                                    └─content──▶ tool parser ──content───▶ Content(text)
                                                             └─calls─────▶ ToolCallDelta(index, name | arguments)

Every API (Chat Completions, Responses, Messages) renders these events in its own shapes; a
non-streaming reply is the same parser fed the whole text at once, so both agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.recipe.reasoning import REASONING_PARSERS, prompt_opens_thinking, reasoning_token_count
from deepinfer.recipe.tool_parsers import ToolCall, ToolCallDelta, ToolParser, get_tool_parser


@dataclass
class Reasoning:
    text: str


@dataclass
class Content:
    text: str


OutputEvent = Reasoning | Content | ToolCallDelta


@dataclass(frozen=True)
class RecipeOptions:
    """What the server resolved at startup: which parsers this model's output needs."""

    tool_parser: str = "hermes"
    reasoning_parser: str | None = None


class OutputParser:
    def __init__(self, options: RecipeOptions, tokenizer, prompt_ids: list[int], tools: bool,
                 constrained_tools: bool = False, constrained: bool = False) -> None:
        """`constrained_tools`: the output is the JSON of a required / named tool choice. `constrained`: a
        grammar shapes the whole output (tool choice or structured output), so there is no reasoning in it."""
        self.tokenizer = tokenizer
        self.reasoning = None
        if options.reasoning_parser is not None and tokenizer is not None and not (constrained or constrained_tools):
            cls = REASONING_PARSERS[options.reasoning_parser]
            self.reasoning = cls(in_reasoning=prompt_opens_thinking(tokenizer, prompt_ids))
        self.tools: ToolParser | None = None
        if constrained_tools:
            self.tools = get_tool_parser("json")()
        elif tools:
            self.tools = get_tool_parser(options.tool_parser)()
        self._content = ""

    @property
    def passthrough(self) -> bool:
        return self.reasoning is None and self.tools is None

    def feed(self, delta: str) -> list[OutputEvent]:
        if not delta:
            return []
        pieces = self.reasoning.feed(delta) if self.reasoning is not None else [("content", delta)]
        return self._count(self._route(pieces))

    def finish(self) -> list[OutputEvent]:
        events = self._route(self.reasoning.finish()) if self.reasoning is not None else []
        if self.tools is not None:
            events += [Content(e) if isinstance(e, str) else e for e in self.tools.finish()]
        return self._count(events)

    def _count(self, events: list[OutputEvent]) -> list[OutputEvent]:
        self._content += "".join(e.text for e in events if isinstance(e, Content))
        return events

    def _route(self, pieces: list[tuple[str, str]]) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        for kind, text in pieces:
            if kind == "reasoning":
                out.append(Reasoning(text))
            elif self.tools is None:
                out.append(Content(text))
            else:
                out += [Content(e) if isinstance(e, str) else e for e in self.tools.feed(text)]
        return out

    # -------------------------------------------------------------- results (after finish)

    @property
    def reasoning_text(self) -> str:
        return self.reasoning.reasoning if self.reasoning is not None else ""

    @property
    def content_text(self) -> str:
        return self._content

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    @property
    def cut_call(self) -> int | None:
        """The index of the call the output stopped in (its JSON not closed), if it did."""
        return self.tools.cut if self.tools is not None else None

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        if self.reasoning is None:
            return 0
        return reasoning_token_count(self.tokenizer, token_ids, self.reasoning_text)

    def parse_all(self, text: str) -> list[OutputEvent]:
        """Whole-text parse (non-streaming)."""
        return self.feed(text) + self.finish()
