"""What every API endpoint shares: the serving context, request validation (context length, sampling
parameters, KV retention class, structured output), the engine stream with metrics and disconnect
handling, usage and SSE framing. Chat / Completions (openai_api, completions_api), Responses
(responses_api) and Anthropic Messages (anthropic_api) build on these."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from deepinfer.engine.engine_client import EngineClient
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.structured import StructuredOutputParams
from deepinfer.engine.validation import RequestError, context_max_tokens
from deepinfer.multimodal.inputs import MultiModalInputs
from deepinfer.recipe.output import RecipeOptions
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.protocol import APIError, SamplingFields, StreamOptions


@dataclass
class ServingContext:
    engine: EngineClient
    model_name: str
    metrics: ServerMetrics
    recipe: RecipeOptions = field(default_factory=RecipeOptions)  # the model's tool / reasoning parsers
    media_domains: tuple[str, ...] = ()  # hosts image URLs may name (`--allowed-media-domains`; empty: any)
    # the LoRA adapter a request named as its `model` (its handler's context then reports that name); None: base
    lora: str | None = None


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, param: str) -> int:
    """Validate lengths (the request validator's API rule); return the effective max_tokens."""
    try:
        return context_max_tokens(prompt_len, max_tokens, max_model_len, param)
    except RequestError as e:
        raise APIError(400, str(e), param=e.param, code=e.code) from e


def make_sampling_params(**kwargs: Any) -> SamplingParams:
    """SamplingParams, with its validation errors as the client's (400)."""
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise APIError(400, str(e).removeprefix("invalid sampling parameter: ")) from e


# OpenAI's value of each sampling parameter the model's generation config may set
_OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def sampling_knobs(engine: EngineClient, **given: Any) -> dict[str, Any]:
    """temperature, top_p, top_k, min_p and repetition_penalty for SamplingParams: what the request gave (None:
    unset; an API without a field leaves it out), else the model's default (`--generation-config`), else OpenAI's."""
    defaults = engine.sampling_defaults
    return {name: given[name] if given.get(name) is not None else defaults.get(name, fallback)
            for name, fallback in _OPENAI_SAMPLING.items()}


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None,
                    engine: EngineClient) -> SamplingParams:
    """The Chat / Completions fields as SamplingParams (structured output and logit_bias included)."""
    from deepinfer.server.structured_fields import engine_fields

    return make_sampling_params(
        n=req.n, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids, max_tokens=max_tokens,
        min_tokens=req.min_tokens, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        **sampling_knobs(engine, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                         repetition_penalty=req.repetition_penalty),
        ignore_eos=req.ignore_eos, logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output, allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words, prompt_logprobs=req.prompt_logprobs, **engine_fields(req, engine),
    )


def truncated_prompt(ids: list[int], req: SamplingFields, max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last N tokens (-1: the last `max_model_len`)."""
    n = req.truncate_prompt_tokens
    if n is None:
        return ids
    if n == -1:
        n = max_model_len
    if n < 1:
        raise APIError(400, f"truncate_prompt_tokens must be -1 or >= 1, got {n}", param="truncate_prompt_tokens")
    return ids[-n:]


# vLLM request fields this server does not implement. Unknown fields are ignored (clients send fields servers may
# not know), but these change what a vLLM user gets back: ignored, they would answer another question. (`echo` is
# a declared field of Completions, so only Chat's reaches this.)
_UNSUPPORTED = {
    "use_beam_search": "beam search is not supported; sample several with n (Completions: best_of)",
    "chat_template": "a per-request chat_template is not accepted; start the server with --chat-template",
    "logits_processors": "logits_processors are not supported",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
    "echo": "echo is not supported on chat completions (continue_final_message continues the last message)",
    "priority": "requests are scheduled first come, first served; only priority 0 is accepted",
}


def check_unsupported(req: SamplingFields) -> None:
    """A 400 naming the field for a vLLM extra that is set but not implemented here."""
    for name, value in (req.model_extra or {}).items():
        if name in _UNSUPPORTED and value not in (None, False, [], {}, ""):
            raise APIError(400, _UNSUPPORTED[name], param=name)


def check_prompt_logprobs(req: SamplingFields) -> None:
    """vLLM's rule for `prompt_logprobs`: not on a stream (it has no place in a chunk). Its range is the
    request limits' (`--max-logprobs`) and SamplingParams' to check."""
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "prompt_logprobs is not available when stream is true", param="prompt_logprobs")


def with_structured_output(params: SamplingParams, param: str, **spec: Any) -> SamplingParams:
    """`params` constrained by a grammar (`json_schema=`, `json_object=`, `regex=` or `grammar=`, as in
    deepinfer.engine.structured.StructuredOutputParams); a 400 naming `param` if the spec is invalid."""
    if params.structured_output is not None:
        raise APIError(400, f"{param} cannot be combined with another structured-output constraint", param=param)
    try:
        return dataclasses.replace(params, structured_output=StructuredOutputParams(**spec))
    except (ValueError, TypeError) as e:
        raise APIError(400, f"{param}: {e}", param=param) from e


RETENTION_HEADER = "x-cache-retention"


def retention_class(ctx: ServingContext, req: SamplingFields, raw: Request) -> str:
    """The request's KV retention class: the body's `prompt_cache_retention`, else the x-cache-retention
    header, else the server's default class. An unknown class is the client's error (400)."""
    return resolve_retention_class(ctx, req.prompt_cache_retention, "prompt_cache_retention", raw)


def resolve_retention_class(ctx: ServingContext, name: str | None, param: str, raw: Request) -> str:
    """`name` (from the body field `param`), else the x-cache-retention header, else the default class."""
    if name is None and raw.headers.get(RETENTION_HEADER) is not None:
        name, param = raw.headers[RETENTION_HEADER].strip() or None, RETENTION_HEADER
    try:
        return ctx.engine.check_retention(name)
    except ValueError as e:
        raise APIError(400, str(e), param=param) from e


def tenant_of(raw: Request) -> str | None:
    """The prefix cache namespace of the API key that authenticated `raw` (None without keys)."""
    return getattr(raw.state, "cache_tenant", None)


def usage(prompt_tokens: int, completion_tokens: int, cached: int, replayed: int = 0) -> dict:
    """OpenAI's usage object (with DeepSeek's cache hit / miss counts). `replayed`: of the cached tokens,
    those whose sliding-window KV was recomputed (SWA bounded replay), reported when there are any."""
    details = {"cached_tokens": cached} | ({"replayed_tokens": replayed} if replayed else {})
    return {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": details,
        "prompt_cache_hit_tokens": cached, "prompt_cache_miss_tokens": prompt_tokens - cached,
    }


def running_usage(out: RequestOutput | None) -> dict | None:
    """One request's usage so far, for the chunks of a stream with `stream_options.continuous_usage_stats`
    (vLLM's extension, which load generators such as guidellm ask for)."""
    if out is None:
        return None
    return usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens,
                 out.num_replayed_tokens)


def stream_usage(options: StreamOptions | None) -> tuple[bool, bool]:
    """(a final usage chunk, usage on every chunk): `continuous_usage_stats` counts only with `include_usage`."""
    include = bool(options and options.include_usage)
    return include, include and bool(options.continuous_usage_stats)


# ---------------------------------------------------------------- engine stream helpers


async def stream_with_metrics(ctx: ServingContext, prompt_ids: list[int], params: SamplingParams,
                              cache_salt: str | None, prompt: str | None = None,
                              retention: str | None = None, grammar_param: str | None = None,
                              cache_tenant: str | None = None,
                              multi_modal: MultiModalInputs | None = None) -> AsyncIterator[RequestOutput]:
    """The engine's stream for one request, observed by the metrics. A grammar is compiled (or found
    cached) first, so an invalid one is a 400 naming `grammar_param` before anything is queued.
    `cache_tenant`: `tenant_of(raw)`, the authenticated tenant's prefix cache namespace; `multi_modal`: the
    prompt's images (`tooling.render_with_images`)."""
    from deepinfer.server.structured_fields import precompile

    await precompile(ctx.engine, params, grammar_param)
    timer = ctx.metrics.timer()
    async for out in ctx.engine.generate(prompt_ids, params, prompt=prompt, cache_salt=cache_salt,
                                         retention_class=retention, cache_tenant=cache_tenant, multi_modal=multi_modal,
                                         lora=ctx.lora):
        timer.observe(out)
        yield out


async def final_output_or_disconnect(raw: Request, gen: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    """Run a stream to its end; if the client disconnects first, stop it (aborting the request)."""
    final: list[RequestOutput] = []

    async def consume() -> None:
        async for out in gen:
            final[:] = [out]

    task = asyncio.create_task(consume())
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await raw.is_disconnected():
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task
                await gen.aclose()
                return None
    except asyncio.CancelledError:  # the handler itself was cancelled (its client left): so is the stream
        task.cancel()
        raise
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


def client_gone() -> JSONResponse:
    """Nobody reads this reply; it only ends the handler (nginx's 499 convention)."""
    return JSONResponse(APIError(499, "client disconnected", "client_closed", code="499").body(), status_code=499)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def sse_event(event: str, data: dict) -> str:
    """A named SSE frame (Responses and Anthropic streams): `event: <type>` then the JSON data."""
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def error_event(e: BaseException) -> str:
    status = getattr(e, "status", 500)
    return sse({"error": {"message": str(e), "type": "server_error" if status >= 500 else "invalid_request_error",
                          "param": None, "code": status}})


async def first_or_error(gen: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    """Pull the first output before the 200 is sent, so engine-side rejections still get a status."""
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return None


async def chain(first: RequestOutput | None, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    if first is not None:
        yield first
        if first.finished:
            return
    async for out in gen:
        yield out




@dataclass
class ChoiceState:
    """What one choice of a stream has sent so far."""

    sent_text: int = 0
    sent_tokens: int = 0
    started: bool = False
    finished: bool = False
    extra: dict = field(default_factory=dict)
