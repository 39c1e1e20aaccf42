"""lm-evaluation-harness's `local-completions` loglikelihood, by its exact request shape (httpx, as the
harness's LocalCompletionsAPI sends it: token-id prompts of context + continuation, `echo: true`,
`max_tokens: 1`, `logprobs: 1`, `temperature: 0`, `seed`), scored as its `parse_logprobs` does: the sum of
`token_logprobs[ctxlen:-1]`, greedy when each is its position's top logprob. The harness itself is not
installed (it pulls torch, datasets and evaluate); the shape is copied from lm_eval 0.4's
models/openai_completions.py."""

from __future__ import annotations

import httpx
import pytest

from tests.clients.conftest import KEY, MODEL

pytestmark = pytest.mark.clients
AUTH = {"Authorization": f"Bearer {KEY}"}
# (context, right continuation, wrong ones): facts the default model clearly knows
ITEMS = [
    ("The capital of France is", " Paris", [" London", " Banana"]),
    ("One, two, three, four,", " five", [" seven", " apple"]),
    ("Monday, Tuesday,", " Wednesday", [" Sunday", " March"]),
    ("The opposite of hot is", " cold", [" blue", " seven"]),
]


def _tokens(server: str, text: str) -> list[int]:
    r = httpx.post(f"{server}/tokenize", json={"prompt": text}, headers=AUTH, timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


def _loglikelihoods(server: str, requests: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """One batched request for (context tokens, continuation tokens) pairs, parsed like the harness."""
    payload = {"model": MODEL, "prompt": [ctx + cont for ctx, cont in requests], "temperature": 0, "max_tokens": 1,
               "logprobs": 1, "seed": 1234, "echo": True}
    r = httpx.post(f"{server}/v1/completions", json=payload, headers=AUTH, timeout=300)
    r.raise_for_status()
    out = []
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for choice, (ctx, cont) in zip(choices, requests, strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ctx) + len(cont) + 1 and lp["token_logprobs"][0] is None
        scored = lp["token_logprobs"][len(ctx):-1]
        tops = lp["top_logprobs"][len(ctx):-1]
        assert len(scored) == len(cont) and all(isinstance(x, float) for x in scored)
        greedy = all(tok == max(top.values()) for tok, top in zip(scored, tops, strict=True))
        out.append((sum(scored), greedy))
    return out


def test_multiple_choice_loglikelihood(server):
    for context, right, wrong in ITEMS:
        ctx = _tokens(server, context)
        # the harness splits context and continuation at the token level of their concatenation
        options = [right, *wrong]
        reqs = []
        for option in options:
            whole = _tokens(server, context + option)
            assert whole[:len(ctx)] == ctx
            reqs.append((ctx, whole[len(ctx):]))
        scores = _loglikelihoods(server, reqs)
        best = max(range(len(options)), key=lambda i: scores[i][0])
        assert options[best] == right, (context, dict(zip(options, scores, strict=True)))
        assert scores[0][1]  # the right one-token answer is the model's greedy choice


def test_generate_until_shape(server):
    """The harness's generate_until request: text prompts, stop sequences, max_tokens."""
    payload = {"model": MODEL, "prompt": ["Q: What is 2+2?\nA:"], "max_tokens": 16, "temperature": 0,
               "stop": ["\n"], "seed": 1234}
    r = httpx.post(f"{server}/v1/completions", json=payload, headers=AUTH, timeout=300)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    assert "\n" not in choice["text"] and choice["finish_reason"] in ("stop", "length")
