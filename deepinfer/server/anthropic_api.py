"""Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

The reply's content is a list of blocks: `thinking` (when the model reasons), `text`, `tool_use`.
Streaming sends Anthropic's events:

    message_start, ping,
    per block: content_block_start, content_block_delta* (text_delta | thinking_delta | input_json_delta),
               content_block_stop
    message_delta (stop_reason, usage), message_stop

A final assistant message is a prefill (protocol_anthropic.split_prefill): the reply's content is
what follows it, as Anthropic returns it.

stop_reason: tool_use when the model called a tool, max_tokens when cut short, stop_sequence when a
stop_sequences entry matched, end_turn otherwise. Errors on these paths use Anthropic's shape
(protocol_anthropic.anthropic_error_body; app.py picks it by path).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from deepinfer.engine.outputs import CompletionOutput, RequestOutput
from deepinfer.multimodal.inputs import MultiModalInputs
from deepinfer.recipe.output import Content, OutputParser, Reasoning
from deepinfer.recipe.tool_parsers import ToolCallDelta
from deepinfer.server.protocol import APIError
from deepinfer.server.protocol_anthropic import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_error_body,
    cache_retention,
    chat_messages,
    output_format,
    split_prefill,
)
from deepinfer.server.serving import (
    ServingContext,
    chain,
    check_context,
    client_gone,
    final_output_or_disconnect,
    first_or_error,
    make_sampling_params,
    resolve_retention_class,
    sampling_knobs,
    sse_event,
    stream_with_metrics,
    tenant_of,
    with_structured_output,
)
from deepinfer.server.tooling import (
    ToolPlan,
    anthropic_plan,
    constrain,
    grammar_param,
    kept_calls,
    output_parser,
    render_with_images,
)


def _prompt(ctx: ServingContext, req: CountTokensRequest) -> tuple[list[int], ToolPlan, MultiModalInputs | None]:
    plan = anthropic_plan(req.tools, req.tool_choice)
    kwargs = {}
    if isinstance(req.thinking, dict) and req.thinking.get("type") in ("enabled", "disabled"):
        kwargs["enable_thinking"] = req.thinking["type"] == "enabled"  # Qwen3-style templates read this
    messages, prefill = split_prefill(chat_messages(req, images=ctx.engine.multimodal_processor is not None), req)
    ids, images = render_with_images(ctx, messages, plan, "messages", add_generation_prompt=not prefill,
                                     continue_final_message=prefill, **kwargs)
    return ids, plan, images


async def count_tokens(ctx: ServingContext, req: CountTokensRequest) -> dict:
    ids, _, _ = _prompt(ctx, req)
    return {"input_tokens": len(ids)}


def _usage(final: RequestOutput, prompt_len: int, breakpoints: bool) -> dict:
    """Anthropic splits the prompt: read from cache + written to cache + the rest. The engine caches every
    prefix; with cache_control breakpoints the uncached tokens count as written, else as plain input."""
    cached = final.num_cached_tokens
    rest = prompt_len - cached
    return {"input_tokens": 0 if breakpoints else rest, "output_tokens": len(final.outputs[0].token_ids),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": rest if breakpoints else 0,
            **({"replayed_input_tokens": final.num_replayed_tokens} if final.num_replayed_tokens else {})}


def _stop(c: CompletionOutput, called: bool, stops: list[str]) -> tuple[str, str | None]:
    if called:
        return "tool_use", None
    if c.finish_reason == "length":
        return "max_tokens", None
    if isinstance(c.stop_reason, str) and c.stop_reason in stops:
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _input(arguments: str) -> dict | None:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


async def create_message(ctx: ServingContext, req: MessagesRequest, raw: Request):
    engine = ctx.engine
    engine.check_admission()
    prompt_ids, plan, images = _prompt(ctx, req)
    if req.max_tokens < 1:
        raise APIError(400, "max_tokens: must be at least 1", param="max_tokens")
    max_tokens = check_context(len(prompt_ids), req.max_tokens, engine.max_model_len, "messages")
    params = make_sampling_params(**sampling_knobs(engine, temperature=req.temperature, top_p=req.top_p,
                                                   top_k=req.top_k),
                                  stop=req.stop_sequences, max_tokens=max_tokens, seed=req.seed)
    fmt = output_format(req)
    if fmt is not None:
        params = with_structured_output(params, "output_config.format", **fmt)
    params = constrain(params, plan)  # a forced tool call's grammar governs this turn
    name, breakpoints = cache_retention(req)
    retention = resolve_retention_class(ctx, name, "cache_control", raw)
    mid = f"msg_{uuid.uuid4().hex}"
    gen = stream_with_metrics(ctx, prompt_ids, params, None, retention=retention, cache_tenant=tenant_of(raw),
                              grammar_param=grammar_param(plan, "output_config.format" if fmt else None),
                              multi_modal=images)
    if req.stream:
        first = await first_or_error(gen)
        return StreamingResponse(_stream(output_parser(ctx, prompt_ids, plan, fmt is not None), req, plan, mid,
                                         ctx.model_name, prompt_ids, breakpoints, first, gen),
                                 media_type="text/event-stream")
    final = await final_output_or_disconnect(raw, gen)
    if final is None:
        return client_gone()
    c = final.outputs[0]
    parser = output_parser(ctx, prompt_ids, plan, fmt is not None)
    parser.parse_all(c.text)
    blocks: list[dict] = []
    if parser.reasoning_text:
        blocks.append({"type": "thinking", "thinking": parser.reasoning_text, "signature": ""})
    text = c.text if parser.passthrough else parser.content_text
    calls = []
    for call in kept_calls(parser.tool_calls, plan):
        args = _input(call.arguments)
        if args is None:  # arguments that do not parse stay visible as text
            text += call.arguments
        else:
            calls.append({"type": "tool_use", "id": _tool_id(), "name": call.name, "input": args})
    if text.strip() or not (calls or blocks):  # an empty reply is still one (empty) text block
        blocks.append({"type": "text", "text": text})
    blocks += calls
    stop_reason, stop_sequence = _stop(c, bool(calls), req.stop_sequences or [])
    return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": ctx.model_name,
                         "content": blocks, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                         "usage": _usage(final, len(prompt_ids), breakpoints)})


class _Blocks:
    """Keeps one content block open at a time and numbers them."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.index = -1
        self.open: str | None = None  # "text" | "thinking" | "tool_use"
        self.pending_ws = ""
        self.called = False

    def start(self, kind: str, block: dict) -> list[str]:
        out = self.stop()
        self.index += 1
        self.open = kind
        return out + [sse_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                         "content_block": block})]

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict) -> str:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def feed(self, events: list) -> list[str]:
        out: list[str] = []
        for e in events:
            if isinstance(e, Reasoning):
                if self.open != "thinking":
                    out += self.start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": e.text}))
            elif isinstance(e, Content):
                if self.open != "text":
                    if not (self.pending_ws + e.text).strip():
                        self.pending_ws += e.text
                        continue
                    out += self.start("text", {"type": "text", "text": ""})
                    e, self.pending_ws = Content(self.pending_ws + e.text), ""
                out.append(self._delta({"type": "text_delta", "text": e.text}))
            elif isinstance(e, ToolCallDelta):
                if not self.plan.parallel and e.index > 0:
                    continue
                if e.name is not None:
                    self.called = True
                    out += self.start("tool_use", {"type": "tool_use", "id": _tool_id(), "name": e.name,
                                                    "input": {}})
                if e.arguments and self.open == "tool_use":
                    out.append(self._delta({"type": "input_json_delta", "partial_json": e.arguments}))
        return out


async def _stream(parser: OutputParser, req: MessagesRequest, plan: ToolPlan, mid: str, model: str,
                  prompt_ids: list[int], breakpoints: bool, first: RequestOutput | None, gen) -> AsyncIterator[str]:
    cached = first.num_cached_tokens if first is not None else 0
    start_usage = {"input_tokens": 0 if breakpoints else len(prompt_ids) - cached, "output_tokens": 0,
                   "cache_read_input_tokens": cached,
                   "cache_creation_input_tokens": len(prompt_ids) - cached if breakpoints else 0}
    yield sse_event("message_start", {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": start_usage}})
    yield sse_event("ping", {"type": "ping"})
    blocks = _Blocks(plan)
    last = None
    try:
        async for out in chain(first, gen):
            last = out
            c = out.outputs[0]
            delta = c.delta_text
            events = parser.feed(delta) if not parser.passthrough else ([Content(delta)] if delta else [])
            if c.finished():
                events += parser.finish()
            for frame in blocks.feed(events):
                yield frame
    except Exception as e:  # noqa: BLE001 - the status is already sent; report in-band and end the stream
        yield sse_event("error", anthropic_error_body(getattr(e, "status", 500), str(e)))
        return
    if blocks.index < 0:  # an empty reply is still one (empty) text block
        for frame in blocks.start("text", {"type": "text", "text": ""}):
            yield frame
    for frame in blocks.stop():
        yield frame
    if last is None:
        return
    stop_reason, stop_sequence = _stop(last.outputs[0], blocks.called, req.stop_sequences or [])
    yield sse_event("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                      "usage": _usage(last, len(prompt_ids), breakpoints)})
    yield sse_event("message_stop", {"type": "message_stop"})
