"""Run by tests/clients/test_llama_index.py with the llama-index virtualenv's python (not pytest's: see
llama_index_requirements.txt): `python llama_index_client.py BASE_URL API_KEY MODEL`. llama-index's
OpenAILike as its users call it; prints one JSON object: what each call returned (types, text) and every
request the library sent (path and body, recorded by an httpx event hook)."""

from __future__ import annotations

import asyncio
import json
import sys
from importlib.metadata import version

import httpx
from llama_index.core.llms import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.llms.openai_like import OpenAILike
from pydantic import BaseModel


class City(BaseModel):
    """A city and its country."""

    name: str
    country: str


class Trip(BaseModel):
    """A trip: where to and for how many days."""

    destination: City  # nested: $defs in the tool's schema
    days: int


def main() -> None:
    base, key, model = sys.argv[1:4]
    sent: list[dict] = []

    def record(request: httpx.Request) -> None:
        sent.append({"path": request.url.path, "body": json.loads(request.content or b"null")})

    async def arecord(request: httpx.Request) -> None:
        record(request)

    common = dict(model=model, api_base=f"{base}/v1", api_key=key, context_window=2048, max_tokens=60,
                  temperature=0.0, max_retries=0, timeout=300,
                  http_client=httpx.Client(event_hooks={"request": [record]}),
                  async_http_client=httpx.AsyncClient(event_hooks={"request": [arecord]}))
    chat_llm = OpenAILike(**common, is_chat_model=True, is_function_calling_model=True)
    text_llm = OpenAILike(**common, is_chat_model=False)
    prompt = PromptTemplate("Plan a {days} day trip to {city}.")
    out: dict = {"versions": {p: version(p) for p in ("llama-index-core", "llama-index-llms-openai-like",
                                                       "llama-index-llms-openai", "openai")}}

    def step(name: str, fn) -> None:
        start = len(sent)
        out[name] = {"result": fn(), "requests": sent[start:]}

    def trip(t) -> dict:
        return {"type": type(t).__name__, "destination_type": type(t.destination).__name__, "value": t.model_dump()}

    step("structured", lambda: trip(chat_llm.structured_predict(Trip, prompt, days="3", city="Paris, France")))
    step("astructured", lambda: trip(asyncio.run(
        chat_llm.astructured_predict(Trip, prompt, days="2", city="Rome, Italy"))))
    step("chat", lambda: (lambda r: {"role": r.message.role.value, "content": r.message.content})(
        chat_llm.chat([ChatMessage(role="user", content="Say hello.")])))
    step("stream_chat", lambda: [r.delta for r in chat_llm.stream_chat([ChatMessage(role="user",
                                                                                   content="Count to five.")])])
    step("complete", lambda: text_llm.complete("The capital of France is").text)
    step("stream_complete", lambda: [r.delta for r in text_llm.stream_complete("Once upon a time")])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
