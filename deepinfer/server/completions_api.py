"""OpenAI Completions (`/v1/completions`): prompts (text or token ids, one or many) -> engine streams ->
JSON body or SSE chunks in OpenAI's exact shapes.

`best_of` samples that many candidates per prompt and returns the `n` of highest log-probability per
token (not with `stream`). `echo` with `logprobs` returns the prompt's tokens with their logprobs before
the generated ones (the engine's prompt logprobs); `echo` with `max_tokens: 0` only scores the prompt.
This is how evaluation harnesses (lm-evaluation-harness's `local-completions`) compute log-likelihoods."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from deepinfer.engine.outputs import CompletionOutput, RequestOutput
from deepinfer.server.logprobs import completion_logprobs, joined, prompt_logprobs, vllm_prompt_logprobs
from deepinfer.server.protocol import APIError, CompletionRequest
from deepinfer.server.serving import (
    ChoiceState,
    ServingContext,
    check_context,
    check_prompt_logprobs,
    check_unsupported,
    client_gone,
    error_event,
    final_output_or_disconnect,
    merge,
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
from deepinfer.server.structured_fields import grammar_field, precompile


def completion_prompts(req: CompletionRequest, tokenizer, max_model_len: int) -> list[tuple[str | None, list[int]]]:
    """(text, token ids) per prompt; the text is None where there is none to echo as given (token-id prompts,
    and prompts `truncate_prompt_tokens` cut)."""
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
            ids = list(tokenizer.encode(item))
        else:
            item, ids = None, list(item)
        cut = truncated_prompt(ids, req, max_model_len)
        out.append((item if len(cut) == len(ids) else None, cut))
    return out


async def completion(ctx: ServingContext, req: CompletionRequest, raw: Request):
    engine = ctx.engine
    if req.suffix is not None:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise APIError(400, "logprobs must be between 0 and 20", param="logprobs")
    check_prompt_logprobs(req)
    check_unsupported(req)
    prompts = completion_prompts(req, engine.tokenizer, engine.max_model_len)
    retention = retention_class(ctx, req, raw)
    engine.check_admission(len(prompts))
    # max_tokens 0 with echo: score the prompt only. The engine still samples one token (its steps end in
    # a sample), which the reply leaves out.
    score_only = req.max_tokens == 0 and req.echo
    wanted = 1 if score_only else req.max_tokens if req.max_tokens is not None else 16
    max_tokens = [check_context(len(ids), wanted, engine.max_model_len, "prompt") for _, ids in prompts]
    for _, ids in prompts:  # every prompt of a batch before any starts (generate() checks each again)
        engine.validator.check_prompt(ids, "prompt")
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    params = [sampling_params(req, mt, req.logprobs, engine) for mt in max_tokens]
    best_of = _best_of(req)
    if best_of > req.n:  # sample best_of, keep the n best: every candidate needs its logprobs to be ranked
        params = [dataclasses.replace(p, n=best_of, logprobs=p.logprobs if p.logprobs is not None else 0)
                  for p in params]
    if req.echo and req.logprobs is not None:
        params = [dataclasses.replace(p, prompt_logprobs=max(req.logprobs, req.prompt_logprobs or 0)) for p in params]
    await precompile(engine, params[0], grammar_field(req))  # a bad grammar is a 400, also when streaming
    tenant = tenant_of(raw)
    gens = [stream_with_metrics(ctx, ids, p, req.cache_salt, prompt=text, retention=retention,
                                grammar_param=grammar_field(req), cache_tenant=tenant)
            for (text, ids), p in zip(prompts, params, strict=True)]
    if req.stream:
        return StreamingResponse(_completion_sse(ctx, req, rid, created, prompts, gens, score_only),
                                 media_type="text/event-stream")
    finals = await asyncio.gather(*(final_output_or_disconnect(raw, g) for g in gens))
    if any(f is None for f in finals):
        return client_gone()
    choices, prompt_tokens, completion_tokens, cached, replayed = [], 0, 0, 0, 0
    for pi, ((text, ids), final) in enumerate(zip(prompts, finals, strict=True)):
        prompt_tokens += len(ids)
        cached += final.num_cached_tokens
        replayed += final.num_replayed_tokens
        echo = (text if text is not None else engine.tokenizer.decode(ids)) if req.echo else ""
        ranked = best_of > req.n
        if ranked:  # every candidate was generated, kept or not, so each one's tokens are billed
            completion_tokens += sum(len(c.token_ids) for c in final.outputs)
        for c in (_best(final.outputs, req.n) if ranked else final.outputs):
            if score_only:
                c = _scored(c)
            if not ranked:
                completion_tokens += len(c.token_ids)
            lp = None
            if req.logprobs is not None:
                lp = completion_logprobs(engine.tokenizer, c, 0, len(c.token_ids), req.logprobs, len(echo))
                if req.echo:
                    lp = joined(prompt_logprobs(engine.tokenizer, ids, final.prompt_logprobs, req.logprobs), lp)
            choices.append({"index": pi * req.n + c.index, "text": echo + c.text, "logprobs": lp,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            if req.prompt_logprobs is not None:
                choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(engine.tokenizer, ids, final.prompt_logprobs,
                                                                      req.prompt_logprobs)
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
                         "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached, replayed),
                         "system_fingerprint": None})


def _best_of(req: CompletionRequest) -> int:
    """`best_of` (OpenAI's legacy field, vLLM's too): how many candidates to sample per prompt."""
    if req.best_of is None:
        return req.n
    if req.best_of < req.n:
        raise APIError(400, f"best_of ({req.best_of}) must be at least n ({req.n})", param="best_of")
    if req.stream and req.best_of > 1:
        raise APIError(400, "best_of cannot be used with stream", param="best_of")
    return req.best_of


def _best(outputs: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """The `n` candidates of highest log-probability per token (OpenAI's definition of best), best first,
    renumbered 0..n-1. Every candidate was sampled with logprobs, so each has its cumulative logprob."""
    ranked = sorted(outputs, key=lambda c: -(c.cumulative_logprob or 0.0) / max(1, len(c.token_ids)))
    return [dataclasses.replace(c, index=j) for j, c in enumerate(ranked[:n])]


def _scored(c: CompletionOutput) -> CompletionOutput:
    """A `max_tokens: 0` choice: nothing generated (the token the engine sampled is dropped)."""
    return dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                               finish_reason="length" if c.finished() else None, stop_reason=None,
                               delta_text="", delta_token_ids=[])


async def _completion_sse(ctx: ServingContext, req: CompletionRequest, rid: str, created: int, prompts, gens,
                          score_only: bool = False):
    tokenizer = ctx.engine.tokenizer
    include_usage, continuous_usage = stream_usage(req.stream_options)
    states: dict[int, ChoiceState] = {}
    finals: dict[int, RequestOutput] = {}
    base = {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name}
    try:
        async for pi, out in merge(gens):
            for c in out.outputs:
                if score_only:
                    c = _scored(c)
                index = pi * req.n + c.index
                st = states.setdefault(index, ChoiceState())
                text = c.text
                echo_lp = None
                if req.echo and not st.started:
                    echo_text = prompts[pi][0] if prompts[pi][0] is not None else tokenizer.decode(prompts[pi][1])
                    text_out = echo_text + c.delta_text
                    # generated offsets count from the end of the echoed prompt
                    st.extra["echo_len"] = len(echo_text)
                    if req.logprobs is not None:
                        echo_lp = prompt_logprobs(tokenizer, prompts[pi][1], out.prompt_logprobs, req.logprobs)
                else:
                    text_out = c.delta_text
                st.started = True
                fin = c.finish_reason if c.finished() and not st.finished else None
                if text_out or fin:
                    lp = None
                    if req.logprobs is not None and len(c.token_ids) > st.sent_tokens:
                        lp = completion_logprobs(tokenizer, c, st.sent_tokens, len(c.token_ids), req.logprobs,
                                                 st.extra.get("echo_len", 0) + st.sent_text)
                    if echo_lp is not None:
                        lp = joined(echo_lp, lp)
                    body = {**base, "choices": [{"index": index, "text": text_out, "logprobs": lp,
                                                 "finish_reason": fin, "stop_reason": c.stop_reason if fin else None}]}
                    if include_usage:
                        body["usage"] = running_usage(out) if continuous_usage else None
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
        completion_tokens = 0 if score_only else sum(len(c.token_ids) for f in finals.values() for c in f.outputs)
        cached = sum(f.num_cached_tokens for f in finals.values())
        replayed = sum(f.num_replayed_tokens for f in finals.values())
        yield sse({**base, "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached, replayed)})
    yield sse("[DONE]")
