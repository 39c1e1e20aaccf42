"""Tools on the way in: one description of a function tool for all three APIs, the tool choice, the
prompt (through the model's chat template, or our Hermes-style system prompt when the template cannot
render tools), and the JSON schema that enforces `tool_choice` required / named.

    OpenAI chat   {"type": "function", "function": {"name", "description", "parameters"}}
    Responses     {"type": "function", "name", "description", "parameters", "strict"}
    Anthropic     {"name", "description", "input_schema"}
                       └──────────────▶ ToolSpec ──▶ template tools / fallback prompt / choice schema
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_EMPTY_PARAMS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def template_dict(self) -> dict[str, Any]:
        """The shape HF chat templates expect (OpenAI chat's)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # none | auto | required | named
    name: str | None = None

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")


class ToolError(ValueError):
    """A tools / tool_choice problem in the request; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _spec(name: Any, description: Any, parameters: Any, param: str) -> ToolSpec:
    if not isinstance(name, str) or not name:
        raise ToolError("a function tool needs a non-empty name", param)
    if parameters is None:
        parameters = _EMPTY_PARAMS
    if not isinstance(parameters, dict):
        raise ToolError(f"the parameters of tool {name!r} must be a JSON schema object", param)
    return ToolSpec(name, description if isinstance(description, str) else None, parameters)


def specs_from_openai(tools: list[dict] | None, param: str = "tools") -> list[ToolSpec]:
    """Chat Completions tools (nested `function`) or Responses tools (flat); other tool types are refused."""
    out = []
    for i, t in enumerate(tools or []):
        where = f"{param}[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise ToolError(f"tool type {kind!r} is not supported; only function tools are", where)
        fn = t.get("function", t)
        if not isinstance(fn, dict):
            raise ToolError("function must be an object", where)
        out.append(_spec(fn.get("name"), fn.get("description"), fn.get("parameters"), where))
    _check_unique(out, param)
    return out


def specs_from_anthropic(tools: list[dict] | None) -> list[ToolSpec]:
    out = []
    for i, t in enumerate(tools or []):
        where = f"tools.{i}"
        if not isinstance(t, dict) or t.get("type", "custom") not in ("custom", None):
            raise ToolError(f"tool type {t.get('type') if isinstance(t, dict) else t!r} is not supported; "
                            "only custom (client) tools are", where)
        out.append(_spec(t.get("name"), t.get("description"), t.get("input_schema"), where))
    _check_unique(out, "tools")
    return out


def _check_unique(specs: list[ToolSpec], param: str) -> None:
    names = [s.name for s in specs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ToolError(f"tool name {dup!r} is used twice", param)


def openai_tool_choice(choice: Any, specs: list[ToolSpec], param: str = "tool_choice") -> ToolChoice:
    """"none" | "auto" | "required" | {"type": "function", "function": {"name"}} | {"type": "function", "name"}."""
    if choice is None:
        return ToolChoice("auto" if specs else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ToolError(f"tool_choice must be none, auto, required or a function, got {choice!r}", param)
        mode = choice
    elif isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function", choice)
        name = fn.get("name") if isinstance(fn, dict) else None
        return _named(name, specs, param)
    else:
        raise ToolError("tool_choice must be none, auto, required or {\"type\": \"function\", ...}", param)
    if mode == "required" and not specs:
        raise ToolError("tool_choice 'required' needs tools", param)
    return ToolChoice(mode)


def anthropic_tool_choice(choice: dict | None, specs: list[ToolSpec]) -> ToolChoice:
    """{"type": "auto" | "any" | "tool" | "none", "name"?}."""
    if choice is None:
        return ToolChoice("auto" if specs else "none")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        return ToolChoice("auto" if specs else "none")
    if kind == "none":
        return ToolChoice("none")
    if kind == "any":
        if not specs:
            raise ToolError("tool_choice 'any' needs tools", "tool_choice")
        return ToolChoice("required")
    if kind == "tool":
        return _named(choice.get("name"), specs, "tool_choice")
    raise ToolError("tool_choice.type must be auto, any, tool or none", "tool_choice")


def _named(name: Any, specs: list[ToolSpec], param: str) -> ToolChoice:
    if not isinstance(name, str) or name not in {s.name for s in specs}:
        raise ToolError(f"tool_choice names {name!r}, which is not among the tools", param)
    return ToolChoice("named", name)


# ---------------------------------------------------------------- prompt


FALLBACK_TOOL_PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


def template_renders_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def fallback_messages(messages: list[dict], specs: list[ToolSpec]) -> list[dict]:
    """For templates that ignore `tools`: describe the tools in the system message and write earlier
    calls and results as Hermes-style text, which any template renders."""
    text = FALLBACK_TOOL_PROMPT.format(tools="\n".join(json.dumps(s.template_dict(), ensure_ascii=False)
                                                       for s in specs)) if specs else ""
    out: list[dict] = []
    for m in messages:
        m = dict(m)
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                              "arguments": c["function"]["arguments"]}, ensure_ascii=False)
                + "\n</tool_call>" for c in m.pop("tool_calls"))
            m["content"] = ((m.get("content") or "") + ("\n" if m.get("content") else "") + calls)
        elif m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        m.pop("reasoning_content", None)
        out.append(m)
    if text:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{text}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def render_prompt(tokenizer, messages: list[dict], specs: list[ToolSpec] | None,
                  add_generation_prompt: bool = True, as_text: bool = False, **template_kwargs: Any) -> list[int] | str:
    """Prompt token ids for a conversation with (optional) tools, through the model's chat template (`as_text`:
    the prompt's text, for a processor that tokenizes it with images); `template_kwargs` go to `render_chat`
    (`continue_final_message` among them)."""
    from deepinfer.recipe.tokenizer import render_chat, render_chat_text

    render = render_chat_text if as_text else render_chat
    if template_renders_tools(tokenizer):
        tools = [s.template_dict() for s in specs] if specs else None
        return render(tokenizer, messages, add_generation_prompt, tools=tools, **template_kwargs)
    return render(tokenizer, fallback_messages(messages, specs or []), add_generation_prompt, **template_kwargs)


def arguments_object(arguments: Any) -> Any:
    """A call's arguments as templates want them: a dict when the JSON text holds an object."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


# ---------------------------------------------------------------- constrained tool choice


_DEF_KEYS = ("$defs", "definitions")


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _hoisted(spec: ToolSpec, index: int, defs: dict[str, Any]) -> dict[str, Any]:
    """`spec.parameters` ready to sit inside the call wrapper: its `$defs` / `definitions` moved into
    `defs` (the wrapper's root `$defs`) under names unique to this tool, and its local `$ref`s rewritten
    to them. References resolve from the document root, which the wrapper now is; left in place, a
    nested model's `#/$defs/City` would dangle. A reference into the parameters themselves (`#`,
    `#/properties/...`: recursive schemas) points at a copy of the parameters kept in `defs` too."""
    params = spec.parameters
    prefix = f"tool{index}_{re.sub(r'[^A-Za-z0-9_]', '_', spec.name)}"
    renamed: dict[tuple[str, str], str] = {}
    for key in _DEF_KEYS:
        for name in params.get(key) or {}:
            renamed[key, name] = f"{prefix}__{name}"
    root_name = f"{prefix}__root"
    uses_root = False

    def ref(target: str) -> str:
        nonlocal uses_root
        if not target.startswith("#"):
            return target  # remote references are the grammar compiler's to refuse
        parts = target[1:].split("/")[1:] if target[1:] else []
        if len(parts) >= 2 and (parts[0], _unescape(parts[1])) in renamed:
            rest = parts[2:]
            return "/".join(["#", "$defs", _escape(renamed[parts[0], _unescape(parts[1])]), *rest])
        uses_root = True
        return "/".join(["#", "$defs", _escape(root_name), *parts])

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (ref(v) if k == "$ref" and isinstance(v, str) else walk(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    if not renamed and not _has_local_ref(params):
        return params
    body = walk({k: v for k, v in params.items() if k not in _DEF_KEYS})
    for key in _DEF_KEYS:
        for name, schema in (params.get(key) or {}).items():
            defs[renamed[key, name]] = walk(schema)
    if uses_root:
        defs[root_name] = body
    return body


def _has_local_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return any((k == "$ref" and isinstance(v, str) and v.startswith("#")) or _has_local_ref(v)
                   for k, v in node.items())
    if isinstance(node, list):
        return any(_has_local_ref(v) for v in node)
    return False


def _call_schema(spec: ToolSpec, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": spec.name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_choice_schema(specs: list[ToolSpec], choice: ToolChoice, parallel: bool = True) -> dict[str, Any]:
    """The JSON schema the output must follow: named -> one call object of that tool; required -> an array
    of at least one call (at most one unless `parallel`) of any tool. Each tool's `$defs` move to the
    root of this schema (see `_hoisted`)."""
    defs: dict[str, Any] = {}
    if choice.mode == "named":
        index, spec = next((i, s) for i, s in enumerate(specs) if s.name == choice.name)
        schema = _call_schema(spec, _hoisted(spec, index, defs))
    elif choice.mode == "required":
        schema = {"type": "array", "minItems": 1,
                  "items": {"anyOf": [_call_schema(s, _hoisted(s, i, defs)) for i, s in enumerate(specs)]}}
        if not parallel:
            schema["maxItems"] = 1
    else:
        raise ValueError(f"tool choice {choice.mode!r} is not enforced by a schema")
    if defs:
        schema["$defs"] = defs
    return schema
