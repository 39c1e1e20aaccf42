"""Anthropic Messages API request bodies, their conversion to chat-template messages, `cache_control`
-> KV retention class, and Anthropic's error shape {"type": "error", "error": {"type", "message"}}.

Content blocks understood: text; tool_use (assistant) and tool_result (user); thinking blocks of
earlier turns are dropped. A final assistant message is a prefill: the reply continues it. Images and
documents are a 400 (this server runs text models).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from deepinfer.server.protocol import APIError, Lenient

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error" if status >= 500 else
                                                               "invalid_request_error"), "message": message}}


class AnthropicMessage(Lenient):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(Lenient):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # {"format": {"type": "json_schema", "schema"}}
    stream: bool = False
    seed: int | None = None  # extension: reproducible sampling


def _block_text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise APIError(400, f"{where}: content block type {kind!r} is not supported here", param=where)
    return str(block.get("text", ""))


def _blocks_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    return "".join(_block_text(b, f"{where}.{j}") for j, b in enumerate(content))


def _image_url(block: dict, where: str) -> str:
    """An image block's source as a URL: base64 data as a data: URL, a url source as it is."""
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str):
        return f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise APIError(400, f"{where}: an image block needs a base64 or url source", param=where)


def chat_messages(req: CountTokensRequest, images: bool = False) -> list[dict]:
    """Anthropic system + messages -> chat-template messages (tool_use -> tool_calls, tool_result -> tool).
    `images` (a model that takes them): a user message's image blocks become `image_url` parts, its content
    then a list of `text` and `image_url` parts."""
    out: list[dict] = []
    if req.system:
        out.append({"role": "system", "content": _blocks_text(req.system, "system")})
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        calls: list[dict] = []
        parts: list[dict] = []  # with images: the text and image parts in order
        for j, block in enumerate(m.content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.{j}"
            if kind == "text":
                texts.append(str(block.get("text", "")))
                parts.append({"type": "text", "text": texts[-1]})
            elif kind == "image" and images and m.role == "user":
                parts.append({"type": "image_url", "image_url": {"url": _image_url(block, at)}})
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                    raise APIError(400, f"{at}: a tool_use block needs a name and an object input", param=at)
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block["name"], "arguments": block.get("input", {})}})
            elif kind == "tool_result" and m.role == "user":
                result = _blocks_text(block.get("content"), f"{at}.content")
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": ("Error: " + result) if block.get("is_error") else result})
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue
            else:
                raise APIError(400, f"{at}: content block type {kind!r} is not supported in a {m.role} message",
                               param=at)
        if len(parts) > len(texts):
            out.append({"role": m.role, "content": parts})
        elif texts or calls or not m.content:
            msg: dict = {"role": m.role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def split_prefill(messages: list[dict], req: CountTokensRequest) -> tuple[list[dict], bool]:
    """Anthropic's prefill: a final assistant message is the start of the reply, which continues it.
    Returns the chat messages to render and whether the last is continued (False: a new turn). An
    empty final assistant message is no prefill and is dropped; one with tool calls, or with trailing
    whitespace (which the API refuses: it would end the prefill mid-token), is a 400."""
    if req.messages[-1].role != "assistant" or not messages or messages[-1]["role"] != "assistant":
        return messages, False
    at = f"messages.{len(req.messages) - 1}.content"
    last = messages[-1]
    if last.get("tool_calls"):
        raise APIError(400, f"{at}: a final assistant message with tool_use blocks needs a user message with "
                       "their tool_result blocks after it", param=at)
    text = last.get("content") or ""
    if not text:
        return messages[:-1], False
    if text != text.rstrip():
        raise APIError(400, "final assistant content cannot end with trailing whitespace", param=at)
    return messages, True


def _controls(req: CountTokensRequest) -> list[dict]:
    found = []
    blocks: list[Any] = [{"cache_control": (req.model_extra or {}).get("cache_control")}]  # automatic caching
    blocks += list(req.system) if isinstance(req.system, list) else []
    blocks += list(req.tools or [])
    for m in req.messages:
        if isinstance(m.content, list):
            blocks += m.content
    for b in blocks:
        if isinstance(b, dict) and b.get("cache_control") is not None:
            found.append(b["cache_control"])
    return found


def cache_retention(req: CountTokensRequest) -> tuple[str | None, bool]:
    """The retention class `cache_control` asks for, and whether any breakpoint was set.

    The engine caches every prefix anyway; a breakpoint's ttl picks how long the KV blocks stay in
    the persistent store: "5m" (the default) -> the server's default class, "1h" -> a class that keeps
    entries at least a day (OpenAI's "24h": the default class if it does, else the longest)."""
    longest = None
    controls = _controls(req)
    for cc in controls:
        if not isinstance(cc, dict) or cc.get("type") != "ephemeral":
            raise APIError(400, "cache_control.type must be 'ephemeral'", param="cache_control")
        ttl = cc.get("ttl", "5m")
        if ttl not in ("5m", "1h"):
            raise APIError(400, f"cache_control.ttl must be '5m' or '1h', got {ttl!r}", param="cache_control.ttl")
        if ttl == "1h" or longest is None:
            longest = ttl
    if longest is None:
        return None, False
    return ("24h" if longest == "1h" else "in-memory"), True


def output_format(req: MessagesRequest) -> dict | None:
    """`output_config.format` -> StructuredOutputParams keywords (None for free text)."""
    fmt = (req.output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                       param="output_config.format")
    return {"json_schema": fmt["schema"]}
