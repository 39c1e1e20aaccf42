"""Request body of the OpenAI Responses API (`POST /v1/responses`), and its input items as chat messages.

Input items understood: messages (string content or input_text / output_text parts), `function_call`
(an earlier call of the assistant), `function_call_output` (its result); `reasoning` items are
dropped (the model does not see earlier reasoning). Anything else is a 400.
"""

from __future__ import annotations

from typing import Any

from deepinfer.recipe.tools import arguments_object
from deepinfer.server.protocol import APIError, Lenient


class ResponsesRequest(Lenient):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    user: str | None = None
    seed: int | None = None  # extension: reproducible sampling
    include: list[str] | None = None  # "message.output_text.logprobs" is the one this server produces
    top_logprobs: int | None = None


def _parts(content: Any, where: str, images: bool = False) -> str | list[dict]:
    """Content parts as text; with `images` (a model that takes them) parts holding an `input_image` stay a
    list of `text` and `image_url` parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "content must be a string or a list of parts", param=where)
    parts: list[dict] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "input_image" and images:
            url = part.get("image_url")
            if not isinstance(url, str):
                raise APIError(400, "an input_image part needs image_url (a data: or http(s) URL; file_id is not "
                               "supported)", param=f"{where}[{j}]")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise APIError(400, f"content part type {kind!r} is not supported by this model",
                           param=f"{where}[{j}]")
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _parts_text(content: Any, where: str) -> str:
    """Content parts as text (no images: a tool's output)."""
    return str(_parts(content, where))


def input_messages(inp: str | list[dict[str, Any]], images: bool = False) -> list[dict]:
    """Responses `input` -> chat-template messages (`images`: input_image parts kept, see `_parts`)."""
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    msgs: list[dict] = []
    for i, item in enumerate(inp):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, "an input item must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"unsupported role {role!r}", param=f"{where}.role")
            msgs.append({"role": "system" if role == "developer" else role,
                         "content": _parts(item.get("content", ""), f"{where}.content", images and role == "user")})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str):
                raise APIError(400, "a function_call item needs a name", param=f"{where}.name")
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item["name"], "arguments": arguments_object(item.get("arguments") or "{}")}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": output if isinstance(output, str) else _parts_text(output, f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"input item type {kind!r} is not supported", param=f"{where}.type")
    return msgs


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the assistant turn of the conversation (for previous_response_id)."""
    msg: dict = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "message":
            msg["content"] += "".join(p["text"] for p in item["content"])
        elif item["type"] == "function_call":
            msg.setdefault("tool_calls", []).append({
                "id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": arguments_object(item["arguments"])}})
    return [msg]


def text_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` -> StructuredOutputParams keywords (None for plain text)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, "text.format.schema must be a JSON schema object", param="text.format.schema")
        return {"json_schema": schema}
    if kind == "json_object":
        return {"json_object": True}
    raise APIError(400, f"text.format.type must be text, json_schema or json_object, got {kind!r}",
                   param="text.format.type")
