"""Tool-call parsers: find the function calls a model wrote in its output, whole or while it streams.

Each model family writes calls its own way; a registry maps a name to the parser:

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call>   Hermes, Qwen 2.5 / 3, and our
                                                                            fallback prompt for templates
                                                                            that cannot render tools
    llama3_json  {"name": "f", "parameters": {...}} [; {...}]              Llama 3.1+ (after <|python_tag|>
                                                                            or as the whole reply)
    json         {"name": ..., "arguments": ...} or [{...}, ...]           what a constrained `tool_choice`
                                                                            (required / named) produced

A parser is fed text deltas and returns events in order: `str` for content text and
`ToolCallDelta` for calls (the first delta of a call carries its name, later ones pieces of the
arguments). Text that could still turn into a call (a partial `<tool_call>` tag, a JSON object
whose first key is not known yet) is held back. The arguments of a call written in the usual key
order (name first) stream as the model writes them; otherwise the call is sent whole once its JSON
closes. Streaming and non-streaming use the same parser, so both return the same calls. A call
whose JSON never parses stays content (nothing of it was sent as a call).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

# the usual head of a call object; once it is seen, the arguments value can stream
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass
class ToolCallDelta:
    """A piece of call `index`: the first one has `name`, the rest extend `arguments`."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text


class _ObjectScanner:
    """Finds where a JSON object or array ends, fed one chunk at a time (strings and escapes aware)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_str = False
        self.esc = False

    def feed(self, text: str) -> int | None:
        """Scan `text`; the index just past the closing bracket if the value closes in it, else None."""
        for i, ch in enumerate(text):
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class _Call:
    """One call object being written: `{"name": ..., "arguments": {...}}`.

    `feed` takes text starting at the object's `{`; it returns the deltas it can send now and, once the
    object closes, how many characters of the chunk it used (`done`)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.outer = _ObjectScanner()
        self.args: _ObjectScanner | None = None
        self.args_start = -1
        self.args_end = -1
        self.started = False  # the name was sent
        self.name = ""
        self.done = False
        self.sent_args = ""

    def feed(self, chunk: str) -> tuple[list[ToolCallDelta], int | None]:
        base = len(self.text)
        self.text += chunk
        end = self.outer.feed(chunk)
        if end is not None:
            self.text = self.text[: base + end]
            self.done = True
        out: list[ToolCallDelta] = []
        if not self.started:
            m = _HEAD.match(self.text)
            if m and len(self.text) > m.end() and self.text[m.end()] in "{[":
                try:
                    name = json.loads(f'"{m.group(1)}"')
                except json.JSONDecodeError:
                    name = None
                if name:
                    self.started, self.name = True, name
                    self.args_start = m.end()
                    self.args = _ObjectScanner()
                    out.append(ToolCallDelta(self.index, name=name))
                    scan_from = self.args_start
                    close = self.args.feed(self.text[scan_from:])
                    self.args_end = scan_from + close if close is not None else -1
                    out += self._arg_delta()
            return out, end
        if self.args is not None and self.args_end < 0:
            scan_from = max(base, self.args_start)
            close = self.args.feed(self.text[scan_from:])
            if close is not None:
                self.args_end = scan_from + close
        out += self._arg_delta()
        return out, end

    def _arg_delta(self) -> list[ToolCallDelta]:
        upto = self.args_end if self.args_end >= 0 else len(self.text)
        new = self.text[self.args_start + len(self.sent_args): upto]
        if not new:
            return []
        self.sent_args += new
        return [ToolCallDelta(self.index, arguments=new)]

    def finish(self) -> tuple[list[ToolCallDelta], ToolCall | None]:
        """The last deltas and the call, or (nothing, None) if it never became a valid call."""
        try:
            obj = json.loads(self.text)
        except json.JSONDecodeError:
            obj = None
        valid = isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"]
        if self.started:  # already announced: end it with what was written (a truncated call still ends)
            return [], ToolCall(self.name, self.sent_args or "{}")
        if not valid:
            return [], None
        args = obj.get("arguments", obj.get("parameters", {}))
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        self.started = True
        self.sent_args = text
        return [ToolCallDelta(self.index, name=obj["name"]), ToolCallDelta(self.index, arguments=text)], \
            ToolCall(obj["name"], text)


Event = str | ToolCallDelta


@dataclass
class ToolParser:
    """Base: feed deltas, then `finish()`; `calls` and `content` hold the result."""

    name = "base"
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    cut: int | None = None  # the call `finish()` ended before its object closed (the output stopped in it)

    def feed(self, delta: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """Whole-text parse: (content, calls)."""
        self.feed(text)
        self.finish()
        return self.content, self.calls

    def _emit(self, events: list[Event], item: Event) -> None:
        if isinstance(item, str):
            if not item:
                return
            self.content += item
        events.append(item)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class HermesToolParser(ToolParser):
    name = "hermes"
    open_tag: str = "<tool_call>"
    close_tag: str = "</tool_call>"
    _buf: str = ""
    _call: _Call | None = None
    _call_raw: str = ""  # everything inside the tags, to restore as content if it is not a call
    _skipping: bool = False  # the call object closed; waiting for the close tag

    def feed(self, delta: str) -> list[Event]:
        events: list[Event] = []
        self._buf += delta
        while self._buf:
            if self._call is None and not self._skipping:
                i = self._buf.find(self.open_tag)
                if i < 0:
                    keep = _partial_suffix(self._buf, self.open_tag)
                    self._emit(events, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                self._emit(events, self._buf[:i])
                self._buf = self._buf[i + len(self.open_tag):]
                self._call, self._call_raw = _Call(len(self.calls)), ""
                continue
            j = self._buf.find(self.close_tag)
            region = self._buf if j < 0 else self._buf[:j]
            if j < 0:
                keep = _partial_suffix(region, self.close_tag)
                region = region[: len(region) - keep]
            self._feed_call(events, region)
            if j < 0:
                self._buf = self._buf[len(region):]
                break
            self._buf = self._buf[j + len(self.close_tag):]
            self._end_call(events)
        return events

    def _feed_call(self, events: list[Event], region: str) -> None:
        self._call_raw += region
        if self._call is None or self._skipping:
            return
        if not self._call.text:
            region = region.lstrip()
            if not region:
                return
        out, end = self._call.feed(region)
        events.extend(out)
        if end is not None:
            self._skipping = True

    def _end_call(self, events: list[Event]) -> None:
        call = self._call
        self._call, self._skipping = None, False
        out, done = call.finish() if call is not None else ([], None)
        events.extend(out)
        if done is None:
            self._emit(events, self.open_tag + self._call_raw + self.close_tag)
        else:
            self.calls.append(done)

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._call is None and not self._skipping:
            self._emit(events, self._buf)
        else:
            self._feed_call(events, self._buf)
            call = self._call
            self._call, self._skipping = None, False
            out, done = call.finish() if call is not None else ([], None)
            events.extend(out)
            if done is None:
                self._emit(events, self.open_tag + self._call_raw)
            else:
                if not call.done:
                    self.cut = call.index
                self.calls.append(done)
        self._buf = ""
        return events


@dataclass
class JsonSequenceToolParser(ToolParser):
    """Calls written as bare JSON objects: `{...}; {...}` (Llama 3) or `[{...}, {...}]` (constrained output).
    If the reply does not start with a call, all of it is content."""

    name = "llama3_json"
    separators: str = ";,"
    _buf: str = ""
    _mode: str = "detect"  # detect -> calls -> (between) ... | content
    _call: _Call | None = None
    _raw: str = ""  # all text fed while not yet known to be content

    def feed(self, delta: str) -> list[Event]:
        events: list[Event] = []
        if self._mode == "content":
            self._emit(events, delta)
            return events
        self._raw += delta
        self._buf = (self._buf + delta).replace("<|python_tag|>", "")
        while self._buf and self._mode != "content":
            if self._mode in ("detect", "between"):
                stripped = self._buf.lstrip()
                if not stripped:
                    self._buf = ""
                    break
                ch = stripped[0]
                if self._mode == "detect" and "<|python_tag|>".startswith(stripped) and len(stripped) < 14:
                    break  # maybe the tag, spelled out
                if ch == "[" and self._mode == "detect":
                    self._buf = stripped[1:]
                    self._mode = "between"
                    continue
                if ch in self.separators and self._mode == "between":
                    self._buf = stripped[1:]
                    continue
                if ch == "]" and self._mode == "between":
                    self._buf = stripped[1:]
                    continue
                if ch == "{":
                    self._buf = stripped
                    self._call = _Call(len(self.calls))
                    self._mode = "calls"
                    continue
                self._to_content(events)
                break
            out, end = self._call.feed(self._buf)
            events.extend(out)
            if end is None:
                self._buf = ""
                break
            self._buf = self._buf[end:]
            if not self._close_call(events):
                break
        return events

    def _close_call(self, events: list[Event]) -> bool:
        call, self._call = self._call, None
        out, done = call.finish()
        events.extend(out)
        if done is None:
            self._to_content(events)
            return False
        self.calls.append(done)
        self._mode = "between"
        return True

    def _to_content(self, events: list[Event]) -> None:
        """Not a call after all: what is not already a call is content."""
        if self.calls or (self._call is not None and self._call.started):
            self._emit(events, self._buf)
        else:
            self._emit(events, self._raw.replace("<|python_tag|>", ""))
        self._buf, self._mode, self._call = "", "content", None

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._mode == "calls" and self._call is not None:
            if self._call.started:  # its object never closed (it closes in `feed`)
                self.cut = self._call.index
                self._close_call(events)
            else:
                self._to_content(events)
        elif self._mode == "detect" and self._buf.strip():
            self._to_content(events)
        self._buf = ""
        return events


@dataclass
class JsonChoiceToolParser(JsonSequenceToolParser):
    """The output of a constrained tool_choice: one call object or an array of them."""

    name = "json"
    separators: str = ","


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3_json": JsonSequenceToolParser,
    "json": JsonChoiceToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None


def detect_tool_parser(chat_template: str | None, architectures: list[str] | None = None) -> str:
    """The parser for a model, from what its chat template tells the model to write."""
    template = chat_template if isinstance(chat_template, str) else ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("tools" in template and '"parameters"' in template):
        return "llama3_json"
    if "tools" in template and any("Llama" in a for a in architectures or ()):
        return "llama3_json"
    return "hermes"  # templates without tool support get our Hermes-style prompt (recipe/tools.py)
