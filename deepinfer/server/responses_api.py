"""OpenAI Responses API: `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`.

A response's output is a list of items: a `reasoning` item (when the model reasons), a `message`
with one `output_text` part, and `function_call` items. Streaming sends, with one growing
`sequence_number`:

    response.created, response.in_progress
    per item:  output_item.added
               message:       content_part.added, output_text.delta*, output_text.done, content_part.done
               reasoning:     content_part.added, reasoning_text.delta*, reasoning_text.done, content_part.done
               function_call: function_call_arguments.delta*, function_call_arguments.done
               output_item.done
    response.completed (response.incomplete when max_output_tokens cut it short)

`include: ["message.output_text.logprobs"]` (with `top_logprobs`) fills the message's `logprobs` with every
generated token's, as Chat Completions does (a token of reasoning or of a tool call included); streamed, each
`output_text.delta` carries those of the tokens since the previous one.

`previous_response_id` continues a stored conversation (response_store.py); instructions are not
carried over, as in OpenAI's API.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from deepinfer.engine.outputs import RequestOutput
from deepinfer.recipe.output import Content, OutputEvent, OutputParser, Reasoning
from deepinfer.recipe.tool_parsers import ToolCallDelta
from deepinfer.server.logprobs import chat_logprobs
from deepinfer.server.protocol import APIError
from deepinfer.server.protocol_responses import ResponsesRequest, input_messages, output_messages, text_format
from deepinfer.server.response_store import ResponseStore
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
    constrain,
    grammar_param,
    kept_calls,
    openai_plan,
    output_parser,
    render_with_images,
)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _retention_name(value: str | None) -> str | None:
    return "in-memory" if value == "in_memory" else value  # the SDK spells OpenAI's class with "_"


class _Job:
    """One response being made: the request, its prompt and plan, and the Response object's fixed fields."""

    def __init__(self, ctx: ServingContext, req: ResponsesRequest, store: ResponseStore, raw: Request) -> None:
        self.ctx, self.req, self.store = ctx, req, store
        history: list[dict] = []
        self.tenant = tenant_of(raw)  # owns what `finish` stores; only its own previous responses continue
        if req.previous_response_id is not None:
            prev = store.get(req.previous_response_id, self.tenant)
            if prev is None:
                raise APIError(404, f"Previous response with id '{req.previous_response_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found")
            history = prev.messages
        self.conversation = history + input_messages(req.input, images=ctx.engine.multimodal_processor is not None)
        if not self.conversation:
            raise APIError(400, "input must not be empty", param="input")
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + self.conversation
        self.plan: ToolPlan = openai_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
        self.prompt_ids, self.images = render_with_images(ctx, messages, self.plan, "input")
        engine = ctx.engine
        max_tokens = check_context(len(self.prompt_ids), req.max_output_tokens or engine.sampling_defaults.get(
            "max_tokens"), engine.max_model_len, "input")
        self.logprobs = LOGPROBS_ITEM in (req.include or [])
        self.top_logprobs = req.top_logprobs or 0
        params = make_sampling_params(**sampling_knobs(engine, temperature=req.temperature, top_p=req.top_p),
                                      max_tokens=max_tokens,
                                      seed=req.seed, logprobs=self.top_logprobs if self.logprobs else None)
        fmt = text_format(req.text)
        if fmt is not None:
            params = with_structured_output(params, "text.format", **fmt)
        params = constrain(params, self.plan)  # a forced tool call's grammar governs this turn
        self.grammar_param = grammar_param(self.plan, "text.format" if fmt is not None else None)
        self.params = params
        self.structured = fmt is not None
        self.retention = resolve_retention_class(ctx, _retention_name(req.prompt_cache_retention),
                                                 "prompt_cache_retention", raw)
        self.id = _id("resp")
        self.created = int(time.time())

    def token_logprobs(self, final: RequestOutput, start: int | None = None) -> list[dict]:
        """Chat Completions' logprob entries of the generated tokens from `start` (default: all), if asked for."""
        c = final.outputs[0]
        if not self.logprobs or c.logprobs is None:
            return []
        begin = 0 if start is None else start
        return chat_logprobs(self.ctx.engine.tokenizer, c, begin, len(c.token_ids), self.top_logprobs)["content"]

    def body(self, status: str, output: list[dict], usage: dict | None, incomplete: bool = False) -> dict:
        req = self.req
        tools = [{"type": "function", "name": s.name, "description": s.description, "parameters": s.parameters,
                  "strict": False} for s in self.plan.specs]
        choice = self.plan.choice
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.ctx.model_name, "output": output, "parallel_tool_calls": self.plan.parallel,
            "previous_response_id": req.previous_response_id, "prompt_cache_key": req.prompt_cache_key,
            "prompt_cache_retention": req.prompt_cache_retention,
            "reasoning": {"effort": None, "summary": None}, "store": req.store,
            "temperature": req.temperature, "top_p": req.top_p,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": {"type": "function", "name": choice.name} if choice.mode == "named" else
            req.tool_choice if isinstance(req.tool_choice, str) else "auto",
            "tools": tools, "truncation": "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {},
        }

    def usage(self, final: RequestOutput, parser: OutputParser) -> dict:
        out_tokens = sum(len(c.token_ids) for c in final.outputs)
        return {"input_tokens": len(self.prompt_ids),
                "input_tokens_details": {"cached_tokens": final.num_cached_tokens, "cache_write_tokens": 0,
                                          **({"replayed_tokens": final.num_replayed_tokens}
                                             if final.num_replayed_tokens else {})},
                "output_tokens": out_tokens,
                "output_tokens_details": {"reasoning_tokens": parser.reasoning_tokens(final.outputs[0].token_ids)},
                "total_tokens": len(self.prompt_ids) + out_tokens}

    def finish(self, final: RequestOutput, parser: OutputParser, output: list[dict]) -> dict:
        incomplete = final.outputs[0].finish_reason == "length"
        body = self.body("incomplete" if incomplete else "completed", output, self.usage(final, parser), incomplete)
        if self.req.store:
            self.store.put(self.id, body, self.conversation + output_messages(output), self.tenant)
        return body


# ---------------------------------------------------------------- output items


LOGPROBS_ITEM = "message.output_text.logprobs"


def _message(item_id: str, text: str, status: str = "completed", logprobs: list[dict] | None = None) -> dict:
    """A message item; "in_progress" ones (stream openers) have no content yet, "incomplete" ones (cut
    by max_output_tokens, as OpenAI marks them) keep what was written."""
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if status == "in_progress" else [_text_part(text, logprobs)]}


def _text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _reasoning(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]}


def _call(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(parser: OutputParser, plan: ToolPlan, events: list[OutputEvent], cut: bool) -> list[dict]:
    """The items of a parsed output. `cut`: max_output_tokens ended it; the item it was writing then (the
    kind of the last event that wrote something, or the call whose JSON never closed) is "incomplete", as
    OpenAI marks it; the items finished before it are "completed"."""
    last = next((e for e in reversed(events) if not isinstance(e, Content) or e.text.strip()), None)
    cut_reasoning = cut and isinstance(last, Reasoning)
    cut_message = cut and (last is None or isinstance(last, Content))
    items = []
    if parser.reasoning_text:
        items.append(_reasoning(_id("rs"), parser.reasoning_text, _status(cut_reasoning)))
    calls = kept_calls(parser.tool_calls, plan)
    if parser.content_text.strip() or not items + calls:  # an empty reply is still one (empty) message
        items.append(_message(_id("msg"), parser.content_text, _status(cut_message)))
    items += [_call(_id("fc"), _id("call"), c.name, c.arguments, _status(cut and i == parser.cut_call))
              for i, c in enumerate(calls)]
    return items


def _status(cut: bool) -> str:
    return "incomplete" if cut else "completed"


async def create_response(ctx: ServingContext, req: ResponsesRequest, store: ResponseStore, raw: Request):
    ctx.engine.check_admission()
    job = _Job(ctx, req, store, raw)
    gen = stream_with_metrics(ctx, job.prompt_ids, job.params, None, retention=job.retention,
                              grammar_param=job.grammar_param, cache_tenant=tenant_of(raw), multi_modal=job.images)
    if req.stream:
        first = await first_or_error(gen)
        return StreamingResponse(_stream(job, first, gen), media_type="text/event-stream")
    final = await final_output_or_disconnect(raw, gen)
    if final is None:
        return client_gone()
    parser = output_parser(ctx, job.prompt_ids, job.plan, job.structured)
    text = final.outputs[0].text
    if parser.passthrough:
        output = [_message(_id("msg"), text, _status(_cut(final)))]
    else:
        output = output_items(parser, job.plan, parser.parse_all(text), _cut(final))
    message = next((item for item in output if item["type"] == "message"), None)
    if message is not None:
        message["content"][0]["logprobs"] = job.token_logprobs(final)
    return JSONResponse(job.finish(final, parser, output))


def _cut(final: RequestOutput) -> bool:
    """max_output_tokens ended the output (the response is "incomplete", and so is the item it was writing)."""
    return final.outputs[0].finish_reason == "length"


def stored_response(store: ResponseStore, response_id: str, tenant: str | None) -> dict:
    item = store.get(response_id, tenant)  # another tenant's response: the same 404 as an unknown id
    if item is None:
        raise APIError(404, f"No response found with id '{response_id}'.", type="invalid_request_error",
                       param="response_id", code="response_not_found")
    return item.body


def delete_response(store: ResponseStore, response_id: str, tenant: str | None) -> dict:
    if not store.delete(response_id, tenant):
        raise APIError(404, f"No response found with id '{response_id}'.", param="response_id",
                       code="response_not_found")
    return {"id": response_id, "object": "response", "deleted": True}


# ---------------------------------------------------------------- streaming


class _Events:
    """Numbers the events and keeps one output item open at a time."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict] = []  # finished items
        self.open: dict | None = None  # {"kind", "item", "index", "text", "call"}
        self.pending_ws = ""  # whitespace content seen while no message is open
        self.pending_logprobs: list[dict] = []  # tokens' entries not yet sent with a text delta
        self.calls_kept: set[int] = set()

    def ev(self, kind: str, **data) -> str:
        frame = sse_event(kind, {"type": kind, "sequence_number": self.seq, **data})
        self.seq += 1
        return frame

    def _open(self, kind: str, item: dict, call: int | None = None) -> list[str]:
        index = len(self.items)
        self.open = {"kind": kind, "item": item, "index": index, "text": "", "call": call, "logprobs": []}
        out = [self.ev("response.output_item.added", output_index=index, item=item)]
        if kind == "message":
            out.append(self.ev("response.content_part.added", item_id=item["id"], output_index=index,
                               content_index=0, part=_text_part("")))
        elif kind == "reasoning":
            out.append(self.ev("response.content_part.added", item_id=item["id"], output_index=index,
                               content_index=0, part={"type": "reasoning_text", "text": ""}))
        return out

    def close(self, cut: bool = False, cut_call: int | None = None) -> list[str]:
        """Finish the open item; `cut`: max_output_tokens ended the output while it was open, so a message or
        reasoning is "incomplete", and a call is if it is the one whose JSON never closed (`cut_call`)."""
        o, self.open = self.open, None
        if o is None:
            return []
        item, index, text = o["item"], o["index"], o["text"]
        where = {"item_id": item["id"], "output_index": index}
        if o["kind"] == "message":
            lps = o["logprobs"] + self.pending_logprobs  # the last tokens' (an end of turn after the text)
            self.pending_logprobs = []
            done = _message(item["id"], text, _status(cut), lps)
            out = [self.ev("response.output_text.done", **where, content_index=0, text=text, logprobs=lps),
                   self.ev("response.content_part.done", **where, content_index=0, part=_text_part(text, lps))]
        elif o["kind"] == "reasoning":
            done = _reasoning(item["id"], text, _status(cut))
            part = {"type": "reasoning_text", "text": text}
            out = [self.ev("response.reasoning_text.done", **where, content_index=0, text=text),
                   self.ev("response.content_part.done", **where, content_index=0, part=part)]
        else:
            done = _call(item["id"], item["call_id"], item["name"], text, _status(cut and o["call"] == cut_call))
            out = [self.ev("response.function_call_arguments.done", **where, name=item["name"], arguments=text)]
        self.items.append(done)
        return out + [self.ev("response.output_item.done", output_index=index, item=done)]

    def feed(self, events: list, plan: ToolPlan) -> list[str]:
        out: list[str] = []
        for e in events:
            kind = "reasoning" if isinstance(e, Reasoning) else "message" if isinstance(e, Content) else "call"
            if kind == "message" and (self.open is None or self.open["kind"] != "message"):
                if not (self.pending_ws + e.text).strip():
                    self.pending_ws += e.text
                    continue
                e = Content(self.pending_ws + e.text)
                self.pending_ws = ""
            if isinstance(e, ToolCallDelta):
                if not plan.parallel and e.index > 0:
                    if e.name is not None:  # a call left out: the one before it is finished
                        out += self.close()
                    continue
                if e.name is not None:
                    item = _call(_id("fc"), _id("call"), e.name, "", "in_progress")
                    out += self.close() + self._open("call", item, e.index)
                if e.arguments and self.open is not None:
                    self.open["text"] += e.arguments
                    out.append(self.ev("response.function_call_arguments.delta", item_id=self.open["item"]["id"],
                                       output_index=self.open["index"], delta=e.arguments))
                continue
            if self.open is None or self.open["kind"] != kind:
                out += self.close()
                item = _message(_id("msg"), "", "in_progress") if kind == "message" else \
                    _reasoning(_id("rs"), "", "in_progress")
                out += self._open(kind, item)
            self.open["text"] += e.text
            delta_kind = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
            extra = {}
            if kind == "message":
                extra["logprobs"], self.pending_logprobs = self.pending_logprobs, []
                self.open["logprobs"] += extra["logprobs"]
            out.append(self.ev(delta_kind, item_id=self.open["item"]["id"], output_index=self.open["index"],
                               content_index=0, delta=e.text, **extra))
        return out


async def _stream(job: _Job, first: RequestOutput | None, gen) -> AsyncIterator[str]:
    ev = _Events()
    yield ev.ev("response.created", response=job.body("in_progress", [], None))
    yield ev.ev("response.in_progress", response=job.body("in_progress", [], None))
    parser = output_parser(job.ctx, job.prompt_ids, job.plan, job.structured)
    last = None
    try:
        async for out in chain(first, gen):
            last = out
            c = out.outputs[0]
            ev.pending_logprobs += job.token_logprobs(out, len(c.token_ids) - len(c.delta_token_ids))
            delta = c.delta_text
            events = parser.feed(delta) if not parser.passthrough else ([Content(delta)] if delta else [])
            if c.finished():
                events += parser.finish()
            for frame in ev.feed(events, job.plan):
                yield frame
    except Exception as e:  # noqa: BLE001 - the status is already sent; report in-band and end the stream
        yield ev.ev("error", code=str(getattr(e, "status", "server_error")), message=str(e), param=None)
        return
    cut = last is not None and _cut(last)
    for frame in ev.close(cut, parser.cut_call):  # the item open at the end is the one max_output_tokens cut
        yield frame
    if not ev.items:  # an empty reply is still one (empty) message
        for frame in ev._open("message", _message(_id("msg"), "", "in_progress")) + ev.close(cut):
            yield frame
    if last is None:
        return
    body = job.finish(last, parser, ev.items)
    yield ev.ev("response.incomplete" if body["status"] == "incomplete" else "response.completed", response=body)
