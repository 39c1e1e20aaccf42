"""OpenAI Chat Completions on top of the engine: messages (+ tools) -> chat template -> token ids ->
SamplingParams -> engine stream -> JSON body or SSE chunks in OpenAI's exact shapes, with reasoning
(`reasoning_content`) and tool calls (`tool_calls`) parsed out of the model's text.

Shared helpers live in serving.py (re-exported here for existing importers); Completions in
completions_api.py."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from deepinfer.engine.outputs import CompletionOutput, RequestOutput
from deepinfer.multimodal.inputs import MultiModalInputs
from deepinfer.recipe.output import Content, OutputParser, Reasoning
from deepinfer.recipe.tool_parsers import ToolCallDelta
from deepinfer.recipe.tools import arguments_object
from deepinfer.server.completions_api import completion
from deepinfer.server.logprobs import chat_logprobs, vllm_prompt_logprobs
from deepinfer.server.protocol import APIError, ChatCompletionRequest, TokenizeRequest
from deepinfer.server.serving import (
    ChoiceState,
    ServingContext,
    chain,
    check_context,
    check_prompt_logprobs,
    check_unsupported,
    client_gone,
    error_event,
    final_output_or_disconnect,
    first_or_error,
    retention_class,
    running_usage,
    sampling_params,
    sse,
    stream_usage,
    stream_with_metrics,
    tenant_of,
    truncated_prompt,
    usage,
)
from deepinfer.server.structured_fields import grammar_field
from deepinfer.server.tooling import (
    ToolPlan,
    constrain,
    grammar_param,
    kept_calls,
    openai_plan,
    output_parser,
    render_with_images,
)

__all__ = ["ServingContext", "chat_completion", "chat_messages", "completion"]


# ---------------------------------------------------------------- request -> engine inputs


_TEXT_PARTS = ("text", "input_text", "output_text")


def _content(content, where: str, images: bool) -> str | list[dict]:
    """String or list-of-parts content as text; with `images` (a model that takes them) a list holding image
    parts stays a list of `text` and `image_url` parts, for the chat template and the model's processor."""
    if not isinstance(content, list):
        return content or ""
    kinds = [part.get("type") if isinstance(part, dict) else None for part in content]
    for kind in kinds:
        if kind not in _TEXT_PARTS and not (images and kind == "image_url"):
            raise APIError(400, f"content part type {kind!r} is not supported by this model", param=where)
    if "image_url" not in kinds:
        return "".join(str(part.get("text", "")) for part in content)
    parts: list[dict] = []
    for j, (part, kind) in enumerate(zip(content, kinds, strict=True)):
        if kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise APIError(400, "an image_url part needs image_url.url", param=f"{where}[{j}]")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": str(part.get("text", ""))})
    return parts


def chat_messages(req, images: bool = False) -> list[dict]:
    """OpenAI messages -> chat-template dicts (assistant tool calls with object arguments, tool results);
    `images`: image parts are kept (`_content`)."""
    out = []
    for i, m in enumerate(req.messages):
        role = "system" if m.role == "developer" else m.role
        msg: dict = {"role": role, "content": _content(m.content, f"messages[{i}].content", images)}
        calls = getattr(m, "tool_calls", None)
        if role == "assistant" and calls:
            msg["tool_calls"] = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise APIError(400, "a tool call needs function.name", param=f"messages[{i}].tool_calls[{j}]")
                msg["tool_calls"].append({"id": c.get("id"), "type": "function", "function": {
                    "name": fn["name"], "arguments": arguments_object(fn.get("arguments") or "{}")}})
        if role == "tool":
            msg["tool_call_id"] = getattr(m, "tool_call_id", None)
        out.append(msg)
    return out


def chat_plan(req: ChatCompletionRequest) -> ToolPlan:
    return openai_plan(req.tools, req.tool_choice, req.parallel_tool_calls)


def check_prefill_flags(req: ChatCompletionRequest | TokenizeRequest) -> None:
    """vLLM's rule: a final message continued (prefill) gets no new turn's header after it."""
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true: set "
                       "add_generation_prompt to false to continue the final message", param="continue_final_message")


def render_chat_prompt(ctx: ServingContext, req: ChatCompletionRequest, plan: ToolPlan
                       ) -> tuple[list[int], MultiModalInputs | None]:
    """The request's prompt ids, and its images (None without)."""
    check_prefill_flags(req)
    kwargs = {**(req.chat_template_kwargs or {}), **({"documents": req.documents} if req.documents else {})}
    messages = chat_messages(req, images=ctx.engine.multimodal_processor is not None)
    return render_with_images(ctx, messages, plan, "messages", req.add_generation_prompt,
                              continue_final_message=req.continue_final_message, **kwargs)


# ---------------------------------------------------------------- chat completions


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _message(c: CompletionOutput, parser: OutputParser, plan: ToolPlan) -> tuple[dict, str | None]:
    """The assistant message of a finished choice, and its finish reason."""
    if parser.passthrough:
        return {"role": "assistant", "content": c.text, "tool_calls": []}, c.finish_reason
    parser.parse_all(c.text)
    calls = kept_calls(parser.tool_calls, plan)
    content = parser.content_text
    msg: dict = {"role": "assistant", "content": (content if content.strip() else None) if calls else content,
                 "tool_calls": [{"id": _call_id(), "type": "function",
                                 "function": {"name": t.name, "arguments": t.arguments}} for t in calls]}
    if parser.reasoning is not None:
        msg["reasoning_content"] = msg["reasoning"] = parser.reasoning_text or None
    finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
    return msg, finish


async def chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request):
    engine = ctx.engine
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise APIError(400, "top_logprobs must be between 0 and 20", param="top_logprobs")
    check_prompt_logprobs(req)
    check_unsupported(req)
    engine.check_admission()
    plan = chat_plan(req)
    prompt_ids, images = render_chat_prompt(ctx, req, plan)
    if images is not None and req.truncate_prompt_tokens is not None:
        raise APIError(400, "truncate_prompt_tokens cannot cut a prompt with images", param="truncate_prompt_tokens")
    prompt_ids = truncated_prompt(prompt_ids, req, engine.max_model_len)
    max_tokens = check_context(len(prompt_ids), req.max_completion_tokens or req.max_tokens
                               or engine.sampling_defaults.get("max_tokens"), engine.max_model_len, "messages")
    top_n = req.top_logprobs or 0
    params = constrain(sampling_params(req, max_tokens, top_n if req.logprobs else None, engine), plan)
    grammar = grammar_param(plan, grammar_field(req))
    retention = retention_class(ctx, req, raw)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    gen = stream_with_metrics(ctx, prompt_ids, params, req.cache_salt, retention=retention,
                              grammar_param=grammar, cache_tenant=tenant_of(raw), multi_modal=images)
    if req.stream:
        first = await first_or_error(gen)
        return StreamingResponse(_chat_sse(ctx, req, plan, rid, created, first, gen, top_n),
                                 media_type="text/event-stream")
    final = await final_output_or_disconnect(raw, gen)
    if final is None:
        return client_gone()
    choices, parsers = [], []
    for c in final.outputs:
        parsers.append(output_parser(ctx, prompt_ids, plan, grammar_field(req) is not None))
        message, finish = _message(c, parsers[-1], plan)
        choices.append({
            "index": c.index, "message": message,
            "logprobs": chat_logprobs(engine.tokenizer, c, 0, len(c.token_ids), top_n) if req.logprobs else None,
            "finish_reason": finish, "stop_reason": c.stop_reason,
        })
    body = {"id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name,
            "choices": choices, "usage": _usage(ctx, final, parsers), "system_fingerprint": None}
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(engine.tokenizer, prompt_ids, final.prompt_logprobs,
                                                       req.prompt_logprobs)
    return JSONResponse(body)


def _usage(ctx: ServingContext, final: RequestOutput, parsers: list[OutputParser]) -> dict:
    """OpenAI usage; with a reasoning parser also `completion_tokens_details.reasoning_tokens`.
    `parsers[i]` has parsed `final.outputs[i]`."""
    body = usage(len(final.prompt_token_ids), sum(len(c.token_ids) for c in final.outputs), final.num_cached_tokens,
                 final.num_replayed_tokens)
    if ctx.recipe.reasoning_parser is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": sum(
            p.reasoning_tokens(c.token_ids) for p, c in zip(parsers, final.outputs, strict=True))}
    return body


def _event_deltas(events: list, st: ChoiceState, plan: ToolPlan) -> list[dict]:
    """Chat `delta` objects for parsed output events."""
    deltas: list[dict] = []
    ids: dict[int, str] = st.extra.setdefault("call_ids", {})
    for e in events:
        if isinstance(e, Reasoning):
            deltas.append({"reasoning_content": e.text, "reasoning": e.text})
        elif isinstance(e, Content):
            deltas.append({"content": e.text})
        elif isinstance(e, ToolCallDelta):
            if not plan.parallel and e.index > 0:
                continue
            if e.name is not None:
                ids[e.index] = _call_id()
                deltas.append({"tool_calls": [{"index": e.index, "id": ids[e.index], "type": "function",
                                               "function": {"name": e.name, "arguments": ""}}]})
            if e.arguments:
                deltas.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.arguments}}]})
    return deltas


async def _chat_sse(ctx: ServingContext, req: ChatCompletionRequest, plan: ToolPlan, rid: str, created: int,
                    first: RequestOutput | None, gen, top_n: int) -> AsyncIterator[str]:
    tokenizer = ctx.engine.tokenizer
    include_usage, continuous_usage = stream_usage(req.stream_options)
    states = [ChoiceState() for _ in range(req.n)]
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name}
    last: RequestOutput | None = None

    def chunk(choice: dict) -> str:
        body = {**base, "choices": [choice]}
        if include_usage:
            body["usage"] = running_usage(last) if continuous_usage else None
        return sse(body)

    try:
        async for out in chain(first, gen):
            last = out
            for c in out.outputs:
                st = states[c.index]
                if not st.started:
                    st.started = True
                    st.extra["parser"] = output_parser(ctx, out.prompt_token_ids, plan, grammar_field(req) is not None)
                    yield chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None})
                parser: OutputParser = st.extra["parser"]
                delta = c.delta_text
                ending = c.finished() and not st.finished
                if delta or ending:
                    lp = None
                    if req.logprobs and len(c.token_ids) > st.sent_tokens:
                        lp = chat_logprobs(tokenizer, c, st.sent_tokens, len(c.token_ids), top_n)
                    if parser.passthrough:
                        deltas = [{"content": delta}] if delta or lp else []
                    else:
                        events = parser.feed(delta) + (parser.finish() if ending else [])
                        deltas = _event_deltas(events, st, plan)
                        if lp and not deltas:
                            deltas = [{"content": ""}]
                    for k, d in enumerate(deltas):
                        yield chunk({"index": c.index, "delta": d, "logprobs": lp if k == 0 else None,
                                     "finish_reason": None})
                    st.sent_tokens = len(c.token_ids)
                if ending:
                    st.finished = True
                    finish = c.finish_reason
                    if st.extra.get("call_ids") and finish == "stop":
                        finish = "tool_calls"
                    yield chunk({"index": c.index, "delta": {}, "logprobs": None,
                                 "finish_reason": finish, "stop_reason": c.stop_reason})
    except Exception as e:  # noqa: BLE001 - the status is already sent; report in-band and end the stream
        yield error_event(e)
        yield sse("[DONE]")
        return
    if include_usage and last is not None:
        parsers = [states[c.index].extra["parser"] for c in last.outputs]
        yield sse({**base, "choices": [], "usage": _usage(ctx, last, parsers)})
    yield sse("[DONE]")
