"""OpenAI Chat Completions and Completions on top of AsyncEngine: request -> token ids ->
SamplingParams -> engine stream -> JSON body or SSE chunks in OpenAI's exact shapes."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import suppress
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.server.logprobs import chat_logprobs, completion_logprobs
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingFields
from deepinfer.server.structured_fields import engine_fields, precompile


@dataclass
class ServingContext:
    engine: AsyncEngine
    model_name: str
    metrics: ServerMetrics


# ---------------------------------------------------------------- request -> engine inputs


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """Flatten OpenAI messages (string or list-of-parts content) into chat-template dicts."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type")
                if kind in ("text", "input_text"):
                    texts.append(str(part.get("text", "")))
                else:
                    raise APIError(400, f"content part type {kind!r} is not supported by this model",
                                   param=f"messages[{i}].content")
            content = "".join(texts)
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": content or ""})
    return out


def render_chat_prompt(tokenizer, req: ChatCompletionRequest) -> list[int]:
    from deepinfer.recipe.tokenizer import render_chat

    try:
        return render_chat(tokenizer, chat_messages(req), req.add_generation_prompt,
                           **(req.chat_template_kwargs or {}))
    except APIError:
        raise
    except Exception as e:  # template errors (e.g. unsupported role order) are the client's to fix
        raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, param: str) -> int:
    """Validate lengths; return the effective max_tokens."""
    if prompt_len >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                            f"prompt has {prompt_len} tokens. Please reduce the length of the {param}.",
                       param=param, code="context_length_exceeded")
    if max_tokens is None:
        return max_model_len - prompt_len
    if max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if prompt_len + max_tokens > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {param}, "
                            f"{max_tokens} in the completion). Please reduce the length of the {param} "
                            f"or completion.", param="max_tokens", code="context_length_exceeded")
    return max_tokens


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None, engine: AsyncEngine) -> SamplingParams:
    extra = engine_fields(req, engine)  # structured output, logit_bias (APIError names the field)
    try:
        return SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
            min_p=req.min_p or 0.0, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
            max_tokens=max_tokens, min_tokens=req.min_tokens, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
            ignore_eos=req.ignore_eos, logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output, **extra,
        )
    except ValueError as e:
        raise APIError(400, str(e).removeprefix("invalid sampling parameter: ")) from e


RETENTION_HEADER = "x-cache-retention"


def retention_class(ctx: ServingContext, req: SamplingFields, raw: Request) -> str:
    """The request's KV retention class: the body's `prompt_cache_retention`, else the x-cache-retention
    header, else the server's default class. An unknown class is the client's error (400)."""
    name = req.prompt_cache_retention
    param = "prompt_cache_retention"
    if name is None and raw.headers.get(RETENTION_HEADER) is not None:
        name, param = raw.headers[RETENTION_HEADER].strip() or None, RETENTION_HEADER
    try:
        return ctx.engine.engine.core.check_retention(name)
    except ValueError as e:
        raise APIError(400, str(e), param=param) from e


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
        "prompt_cache_hit_tokens": cached, "prompt_cache_miss_tokens": prompt_tokens - cached,
    }


# ---------------------------------------------------------------- engine stream helpers


async def stream_with_metrics(ctx: ServingContext, prompt_ids: list[int], params: SamplingParams,
                              cache_salt: str | None, prompt: str | None = None,
                              retention: str | None = None) -> AsyncIterator[RequestOutput]:
    timer = ctx.metrics.timer()
    async for out in ctx.engine.generate(prompt_ids, params, prompt=prompt, cache_salt=cache_salt,
                                         retention_class=retention):
        timer.observe(out)
        yield out


async def final_output_or_disconnect(raw: Request, gen: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    """Run a stream to its end; if the client disconnects first, stop it (aborting the request)."""
    final: list[RequestOutput] = []

    async def consume() -> None:
        async for out in gen:
            final[:] = [out]

    task = asyncio.create_task(consume())
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await raw.is_disconnected():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
            await gen.aclose()
            return None
    task.result()
    return final[0] if final else None


async def merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output)."""
    if len(gens) == 1:
        async for out in gens[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, g: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in g:
                await q.put((i, out))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await q.put((i, e))
        finally:
            await q.put((i, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await q.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def _client_gone() -> JSONResponse:
    """Nobody reads this reply; it only ends the handler (nginx's 499 convention)."""
    return JSONResponse(APIError(499, "client disconnected", "client_closed", code="499").body(), status_code=499)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def error_event(e: BaseException) -> str:
    status = getattr(e, "status", 500)
    return sse({"error": {"message": str(e), "type": "server_error" if status >= 500 else "invalid_request_error",
                          "param": None, "code": status}})


@dataclass
class _ChoiceState:
    sent_text: int = 0
    sent_tokens: int = 0
    started: bool = False
    finished: bool = False
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------- chat completions


async def chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request):
    engine = ctx.engine
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise APIError(400, "top_logprobs must be between 0 and 20", param="top_logprobs")
    engine.check_admission()
    prompt_ids = render_chat_prompt(engine.tokenizer, req)
    max_tokens = check_context(len(prompt_ids), req.max_completion_tokens or req.max_tokens,
                               engine.max_model_len, "messages")
    top_n = req.top_logprobs or 0
    params = sampling_params(req, max_tokens, top_n if req.logprobs else None, engine)
    await precompile(req, engine)
    retention = retention_class(ctx, req, raw)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    gen = stream_with_metrics(ctx, prompt_ids, params, req.cache_salt, retention=retention)
    if req.stream:
        first = await _first_or_error(gen)
        return StreamingResponse(_chat_sse(ctx, req, rid, created, first, gen, top_n),
                                 media_type="text/event-stream")
    final = await final_output_or_disconnect(raw, gen)
    if final is None:
        return _client_gone()
    choices = []
    for c in final.outputs:
        choices.append({
            "index": c.index, "message": {"role": "assistant", "content": c.text, "tool_calls": []},
            "logprobs": chat_logprobs(engine.tokenizer, c, 0, len(c.token_ids), top_n) if req.logprobs else None,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
        })
    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name,
        "choices": choices, "usage": usage(len(prompt_ids), completion_tokens, final.num_cached_tokens),
        "system_fingerprint": None,
    })


async def _first_or_error(gen: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    """Pull the first output before the 200 is sent, so engine-side rejections still get a status."""
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return None


async def _chain(first: RequestOutput | None, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    if first is not None:
        yield first
        if first.finished:
            return
    async for out in gen:
        yield out


async def _chat_sse(ctx: ServingContext, req: ChatCompletionRequest, rid: str, created: int,
                    first: RequestOutput | None, gen, top_n: int) -> AsyncIterator[str]:
    tokenizer = ctx.engine.tokenizer
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    states = [_ChoiceState() for _ in range(req.n)]
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name}

    def chunk(choice: dict) -> str:
        body = {**base, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return sse(body)

    last: RequestOutput | None = None
    try:
        async for out in _chain(first, gen):
            last = out
            for c in out.outputs:
                st = states[c.index]
                if not st.started:
                    st.started = True
                    yield chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None})
                delta = c.text[st.sent_text:]
                new_tokens = len(c.token_ids) - st.sent_tokens
                if delta or (c.finished() and not st.finished):
                    lp = None
                    if req.logprobs and new_tokens > 0:
                        lp = chat_logprobs(tokenizer, c, st.sent_tokens, len(c.token_ids), top_n)
                    if delta or lp:
                        yield chunk({"index": c.index, "delta": {"content": delta}, "logprobs": lp,
                                     "finish_reason": None})
                    st.sent_text, st.sent_tokens = len(c.text), len(c.token_ids)
                if c.finished() and not st.finished:
                    st.finished = True
                    yield chunk({"index": c.index, "delta": {}, "logprobs": None,
                                 "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    except Exception as e:  # noqa: BLE001 - the status is already sent; report in-band and end the stream
        yield error_event(e)
        yield sse("[DONE]")
        return
    if include_usage and last is not None:
        completion_tokens = sum(len(c.token_ids) for c in last.outputs)
        yield sse({**base, "choices": [],
                   "usage": usage(len(last.prompt_token_ids), completion_tokens, last.num_cached_tokens)})
    yield sse("[DONE]")


# ---------------------------------------------------------------- completions


def completion_prompts(req: CompletionRequest, tokenizer) -> list[tuple[str | None, list[int]]]:
    p = req.prompt
    if isinstance(p, str):
        items: list = [p]
    elif p and all(isinstance(x, int) for x in p):
        items = [p]
    else:
        items = list(p)
    if not items:
        raise APIError(400, "prompt must not be empty", param="prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            if tokenizer is None:
                raise APIError(400, "this model has no tokenizer; send token ids", param="prompt")
            out.append((item, list(tokenizer.encode(item))))
        else:
            out.append((None, list(item)))
    return out


async def completion(ctx: ServingContext, req: CompletionRequest, raw: Request):
    engine = ctx.engine
    if req.suffix is not None:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise APIError(400, "logprobs must be between 0 and 20", param="logprobs")
    prompts = completion_prompts(req, engine.tokenizer)
    retention = retention_class(ctx, req, raw)
    engine.check_admission(len(prompts))
    for _, ids in prompts:
        if not ids:
            raise APIError(400, "prompt must not be empty", param="prompt")
        bad = next((t for t in ids if not 0 <= t < engine.engine.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of range [0, {engine.engine.vocab_size})", param="prompt")
    max_tokens = [check_context(len(ids), req.max_tokens if req.max_tokens is not None else 16,
                                engine.max_model_len, "prompt") for _, ids in prompts]
    await precompile(req, engine)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    gens = [stream_with_metrics(ctx, ids, sampling_params(req, mt, req.logprobs, engine), req.cache_salt, prompt=text,
                                retention=retention)
            for (text, ids), mt in zip(prompts, max_tokens, strict=True)]
    if req.stream:
        return StreamingResponse(_completion_sse(ctx, req, rid, created, prompts, gens),
                                 media_type="text/event-stream")
    finals = await asyncio.gather(*(final_output_or_disconnect(raw, g) for g in gens))
    if any(f is None for f in finals):
        return _client_gone()
    choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
    for pi, ((text, ids), final) in enumerate(zip(prompts, finals, strict=True)):
        prompt_tokens += len(ids)
        cached += final.num_cached_tokens
        echo = (text if text is not None else engine.tokenizer.decode(ids)) if req.echo else ""
        for c in final.outputs:
            completion_tokens += len(c.token_ids)
            lp = None
            if req.logprobs is not None:
                lp = completion_logprobs(engine.tokenizer, c, 0, len(c.token_ids), req.logprobs, len(echo))
            choices.append({"index": pi * req.n + c.index, "text": echo + c.text, "logprobs": lp,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
                         "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached),
                         "system_fingerprint": None})


async def _completion_sse(ctx: ServingContext, req: CompletionRequest, rid: str, created: int, prompts, gens):
    tokenizer = ctx.engine.tokenizer
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    states: dict[int, _ChoiceState] = {}
    finals: dict[int, RequestOutput] = {}
    base = {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name}
    try:
        async for pi, out in merge(gens):
            for c in out.outputs:
                index = pi * req.n + c.index
                st = states.setdefault(index, _ChoiceState())
                text = c.text
                if req.echo and not st.started:
                    echo_text = prompts[pi][0] if prompts[pi][0] is not None else tokenizer.decode(prompts[pi][1])
                    text_out = echo_text + text[st.sent_text:]
                else:
                    text_out = text[st.sent_text:]
                st.started = True
                fin = c.finish_reason if c.finished() and not st.finished else None
                if text_out or fin:
                    lp = None
                    if req.logprobs is not None and len(c.token_ids) > st.sent_tokens:
                        lp = completion_logprobs(tokenizer, c, st.sent_tokens, len(c.token_ids), req.logprobs,
                                                 st.sent_text)
                    body = {**base, "choices": [{"index": index, "text": text_out, "logprobs": lp,
                                                 "finish_reason": fin, "stop_reason": c.stop_reason if fin else None}]}
                    if include_usage:
                        body["usage"] = None
                    yield sse(body)
                    st.sent_text, st.sent_tokens = len(text), len(c.token_ids)
                st.finished = st.finished or fin is not None
            finals[pi] = out
    except Exception as e:  # noqa: BLE001
        yield error_event(e)
        yield sse("[DONE]")
        return
    if include_usage:
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        completion_tokens = sum(len(c.token_ids) for f in finals.values() for c in f.outputs)
        cached = sum(f.num_cached_tokens for f in finals.values())
        yield sse({**base, "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached)})
    yield sse("[DONE]")
