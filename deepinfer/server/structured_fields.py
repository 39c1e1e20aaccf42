"""Structured-output and logit_bias fields of API requests -> engine parameters.

Accepted spellings (one per request): OpenAI's `response_format` ({"type": "text" | "json_object" |
"json_schema", "json_schema": {"name", "schema", "strict"}}), vLLM's `guided_json` / `guided_regex` /
`guided_grammar` / `guided_choice`, and `structured_outputs: {"json" | "regex" | "grammar" | "choice" |
"json_object": ...}`.
`logit_bias` arrives with string token-id keys (JSON objects have no integer keys).

Grammars are compiled before a request is queued (`precompile`): on the engine's compile pool, awaited
without blocking the event loop, so a bad schema is a 400 naming its field rather than a stream that
ends in an error; the compiled grammar stays in the engine's cache, so the engine does not compile twice.
"""

from __future__ import annotations

from typing import Any

from deepinfer.engine.engine_client import EngineClient
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.structured import StructuredOutputParams
from deepinfer.server.protocol import APIError, SamplingFields


def structured_output(req: SamplingFields) -> tuple[StructuredOutputParams | None, str | None]:
    """The request's constraint and the name of the field it came from (for error messages)."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = req.response_format
    if rf is not None:
        found.extend(_response_format(rf))
    for name, key in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_grammar", "grammar"),
                      ("guided_choice", "choice")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, {key: value}))
    so = req.structured_outputs
    if so is not None:
        keys = {"json": "json_schema", "regex": "regex", "grammar": "grammar", "choice": "choice",
                "json_object": "json_object"}
        given = {k: v for k, v in so.items() if k in keys and v is not None}
        unknown = sorted(set(so) - set(keys))
        if unknown:
            raise APIError(400, f"structured_outputs: unsupported key(s) {unknown}; use one of {sorted(keys)}",
                           param="structured_outputs")
        if len(given) != 1:
            raise APIError(400, f"structured_outputs needs exactly one of {sorted(keys)}", param="structured_outputs")
        (k, v), = given.items()
        found.append((f"structured_outputs.{k}", {keys[k]: v}))
    if not found:
        return None, None
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise APIError(400, f"only one structured-output constraint per request; got {names}", param=found[1][0])
    param, kwargs = found[0]
    try:
        return StructuredOutputParams(**kwargs), param
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param) from e


def _response_format(rf: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    kind = rf.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", {"json_object": True})]
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise APIError(400, "response_format.json_schema.schema is required for type 'json_schema'",
                           param="response_format.json_schema")
        return [("response_format.json_schema.schema", {"json_schema": spec["schema"]})]
    raise APIError(400, f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   param="response_format.type")


def logit_bias(req: SamplingFields, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} with ids in the vocabulary and biases in [-100, 100]."""
    if not req.logit_bias:
        return None
    out: dict[int, float] = {}
    for key, value in req.logit_bias.items():
        try:
            tid = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= tid < vocab_size:
            raise APIError(400, f"logit_bias token id {tid} is out of range [0, {vocab_size})", param="logit_bias")
        if not -100 <= value <= 100:
            raise APIError(400, f"logit_bias values must be in [-100, 100], got {value} for token {tid}",
                           param="logit_bias")
        out[tid] = float(value)
    return out


def engine_fields(req: SamplingFields, engine: EngineClient) -> dict[str, Any]:
    """SamplingParams keyword arguments for these fields."""
    params, _ = structured_output(req)
    return {"structured_output": params, "logit_bias": logit_bias(req, engine.vocab_size)}


def grammar_field(req: SamplingFields) -> str | None:
    """The request field that carries its grammar (for error messages), if any."""
    return structured_output(req)[1]


async def precompile(engine: EngineClient, params: SamplingParams, param: str | None) -> None:
    """Compile the grammar of `params` (or find it cached) before queuing; a bad one is a 400 naming
    `param`, the request field it came from."""
    so = params.structured_output
    if so is None:
        return
    if engine.tokenizer is None:
        raise APIError(400, "structured output needs a tokenizer; this model has none", param=param)
    try:
        await engine.compile_grammar(so)
    except ValueError as e:
        raise APIError(400, f"{param}: {e}" if param else f"invalid grammar: {e}", param=param) from e
