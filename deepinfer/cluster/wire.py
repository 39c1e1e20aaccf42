"""JSON shapes of what crosses the router <-> worker HTTP boundary: sampling parameters, outputs, logprobs.

Token-level state travels as token ids; text is re-derived nowhere: a decode worker's
outputs already carry the detokenized text of the whole completion (its engine was
given the prefill's first token, see `LLMEngine.add_request(output_prefix=...)`).
Prompt logprobs come once, in the prefill worker's output (the worker that ran the prompt).

A decode worker streams one line per step, and each line carries only what the step added
(`output_delta_to_json`: new text, token ids and their logprob entries, plus the finish state), so a
stream's bytes grow with its length, not with its square; the router adds the lines up
(`output_delta_from_json`) into the cumulative `RequestOutput` its handlers expect.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from deepinfer.engine.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.structured import StructuredOutputParams


def params_to_json(p: SamplingParams) -> dict[str, Any]:
    return dataclasses.asdict(p)


def params_from_json(d: dict[str, Any]) -> SamplingParams:
    """The inverse of `params_to_json`: JSON turned the grammar into a dict and logit_bias keys into strings."""
    d = dict(d)
    if d.get("structured_output") is not None:
        d["structured_output"] = StructuredOutputParams(**d["structured_output"])
    if d.get("logit_bias") is not None:
        d["logit_bias"] = {int(t): float(v) for t, v in d["logit_bias"].items()}
    return SamplingParams(**d)


def logprobs_to_json(entries: list[dict[int, Logprob] | None] | None) -> list[list[list[Any]] | None] | None:
    """[{token: Logprob}] -> [[[token, logprob, rank, decoded], ...], ...] (JSON keys cannot be ints); an entry
    may be None (a prompt's first token has no logprob)."""
    if entries is None:
        return None
    return [None if e is None else [[t, lp.logprob, lp.rank, lp.decoded_token] for t, lp in e.items()]
            for e in entries]


def logprobs_from_json(data: list | None) -> list[dict[int, Logprob] | None] | None:
    if data is None:
        return None
    return [None if e is None else {int(t): Logprob(lp, rank, dec) for t, lp, rank, dec in e} for e in data]


def output_to_json(out: RequestOutput) -> dict[str, Any]:
    return {
        "request_id": out.request_id, "prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids,
        "finished": out.finished, "num_cached_tokens": out.num_cached_tokens,
        "num_cached_tokens_by_tier": out.num_cached_tokens_by_tier, "metrics": out.metrics,
        "num_replayed_tokens": out.num_replayed_tokens,
        "outputs": [{
            "index": c.index, "text": c.text, "token_ids": c.token_ids, "cumulative_logprob": c.cumulative_logprob,
            "logprobs": logprobs_to_json(c.logprobs), "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        } for c in out.outputs],
        "prompt_logprobs": logprobs_to_json(out.prompt_logprobs),
    }


def output_from_json(d: dict[str, Any]) -> RequestOutput:
    outputs = [CompletionOutput(index=c["index"], text=c["text"], token_ids=list(c["token_ids"]),
                                cumulative_logprob=c["cumulative_logprob"], logprobs=logprobs_from_json(c["logprobs"]),
                                finish_reason=c["finish_reason"], stop_reason=c["stop_reason"])
               for c in d["outputs"]]
    return RequestOutput(request_id=d["request_id"], prompt=d["prompt"], prompt_token_ids=list(d["prompt_token_ids"]),
                         outputs=outputs, finished=d["finished"], num_cached_tokens=d["num_cached_tokens"],
                         num_cached_tokens_by_tier=dict(d["num_cached_tokens_by_tier"]), metrics=dict(d["metrics"]),
                         num_replayed_tokens=d.get("num_replayed_tokens", 0),
                         prompt_logprobs=logprobs_from_json(d.get("prompt_logprobs")))


def output_delta_to_json(out: RequestOutput) -> dict[str, Any]:
    """What `out` adds to the request's previous output: `delta_text`, `delta_token_ids`, the logprob entries
    of those tokens, and the finish state (prompt, prompt logprobs and cache facts are the prefill's)."""
    outputs = []
    for c in out.outputs:
        k = len(c.delta_token_ids)
        lps = None if c.logprobs is None else c.logprobs[len(c.logprobs) - k:]
        outputs.append({"index": c.index, "delta_text": c.delta_text, "delta_token_ids": c.delta_token_ids,
                        "delta_logprobs": logprobs_to_json(lps), "cumulative_logprob": c.cumulative_logprob,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, "error": c.error})
    return {"request_id": out.request_id, "finished": out.finished, "delta_outputs": outputs}


def output_delta_from_json(d: dict[str, Any], prev: RequestOutput | None, base: RequestOutput) -> RequestOutput:
    """The cumulative output after delta line `d`: `prev` (the stream's previous output, None for its first
    line) extended by it; request-level facts (prompt, cache hits, metrics, prompt logprobs) from `base`."""
    outputs = []
    for i, c in enumerate(d["delta_outputs"]):
        p = prev.outputs[i] if prev is not None else None
        delta_lps = logprobs_from_json(c["delta_logprobs"])
        logprobs = None if delta_lps is None else (list(p.logprobs or []) if p is not None else []) + delta_lps
        outputs.append(CompletionOutput(
            index=c["index"], text=(p.text if p is not None else "") + c["delta_text"],
            token_ids=(list(p.token_ids) if p is not None else []) + list(c["delta_token_ids"]),
            cumulative_logprob=c["cumulative_logprob"], logprobs=logprobs, finish_reason=c["finish_reason"],
            stop_reason=c["stop_reason"], error=c.get("error"), delta_text=c["delta_text"],
            delta_token_ids=list(c["delta_token_ids"])))
    return dataclasses.replace(base, request_id=d["request_id"], outputs=outputs, finished=d["finished"],
                               kv_blocks=None)
