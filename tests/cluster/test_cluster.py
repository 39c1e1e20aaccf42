"""A real local cluster (`deepinfer serve --prefill-workers 2 --decode-workers 2`: a router and four worker
processes) against a real unified `deepinfer serve`, both on the same tiny float32 model, through the
official `openai` SDK. Greedy output must be token-identical; killing workers mid-run must leave no request
hanging or silently lost. The fault tests run last: they kill workers of the module's cluster.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import threading
import time

import httpx
import openai
import pytest

from deepinfer.cluster.policies import DeepInferPolicy, RouteInfo, WorkerView
from deepinfer.cluster.pool import Worker, peer_cost_models
from tests.server_utils import INTERNAL, metric, running_cluster, running_server
from tests.server_utils import cluster_workers as _workers

FLAGS = ("--dtype", "float32", "--kv-cache-memory", "64MiB", "--no-profile-cost-model", "--max-model-len", "1024")
MODEL = "llama"
IGNORE_EOS = {"ignore_eos": True}
PROMPTS = [
    "Hi",
    "Tell me a story about a cat who learns to fly over the mountains.",
    "List the first ten prime numbers, then explain why each of them is prime in one short sentence. " * 3,
]


@pytest.fixture(scope="module")
def unified(tiny_models, tmp_path_factory):
    log = tmp_path_factory.mktemp("unified") / "server.log"
    with running_server("--model", str(tiny_models[MODEL]), *FLAGS, log=log) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    log = tmp_path_factory.mktemp("cluster") / "cluster.log"
    with running_cluster("--model", str(tiny_models[MODEL]), *FLAGS, "--prefill-workers", "2", "--decode-workers",
                         "2", "--health-interval", "2", "--token-timeout", "30", log=log) as base:
        yield base


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster}/v1", api_key="x", max_retries=0, timeout=120)


def _chat(c: openai.OpenAI, prompt: str, max_tokens: int, **kw):
    return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                     max_tokens=max_tokens, temperature=0, extra_body=IGNORE_EOS, **kw)


def test_chat_is_token_identical_to_unified(client, unified, cluster):
    for prompt in PROMPTS:
        ref = _chat(unified, prompt, 12, logprobs=True, top_logprobs=2)
        got = _chat(client, prompt, 12, logprobs=True, top_logprobs=2)
        assert got.choices[0].message.content == ref.choices[0].message.content
        assert [t.token for t in got.choices[0].logprobs.content] == [t.token for t in ref.choices[0].logprobs.content]
        for a, b in zip(got.choices[0].logprobs.content, ref.choices[0].logprobs.content, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert got.choices[0].finish_reason == ref.choices[0].finish_reason == "length"
        assert got.usage.completion_tokens == ref.usage.completion_tokens == 12
        assert got.usage.prompt_tokens == ref.usage.prompt_tokens
    # the long prompts' KV went prefill -> decode worker and was used there (prefix hits on decode workers)
    sent = sum(httpx.get(f"{w['url']}/internal/load", headers=INTERNAL, timeout=10).json()["blocks_sent"] for w in _workers(cluster)
               if w["role"] == "prefill")
    assert sent > 0
    hits = sum(metric(w["url"], "deepinfer:prefix_cache_hits_total") for w in _workers(cluster)
               if w["role"] == "decode")
    assert hits >= sent * 16


def test_prompt_logprobs_match_unified(client, unified):
    """Completions `echo` + `logprobs`: the prefill worker computes the prompt's logprobs and the router hands
    them on with the decode worker's tokens; the reply has unified mode's shape and values (one entry per
    prompt token, the first `null`, then the generated ones), streamed or not, a prompt as text or token ids,
    and with `max_tokens: 0` (the prompt scored only, the request ending on the prefill worker)."""
    for prompt, max_tokens in ((PROMPTS[1], 6), (PROMPTS[2], 0), (list(range(5, 45)), 3)):
        kw = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=2, temperature=0,
                  extra_body=IGNORE_EOS)
        ref, got = unified.completions.create(**kw), client.completions.create(**kw)
        r, g = ref.choices[0], got.choices[0]
        n_prompt = ref.usage.prompt_tokens
        assert got.usage.prompt_tokens == n_prompt and got.usage.completion_tokens == max_tokens
        assert g.text == r.text
        assert g.logprobs.tokens == r.logprobs.tokens and g.logprobs.text_offset == r.logprobs.text_offset
        assert len(g.logprobs.tokens) == n_prompt + max_tokens
        assert g.logprobs.token_logprobs[0] is None and g.logprobs.top_logprobs[0] is None
        assert None not in g.logprobs.token_logprobs[1:]
        assert g.logprobs.token_logprobs[1:] == pytest.approx(r.logprobs.token_logprobs[1:], abs=1e-4)
        for a, b in zip(g.logprobs.top_logprobs[1:], r.logprobs.top_logprobs[1:], strict=True):
            assert a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)
        chunks = list(client.completions.create(**kw, stream=True))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        lps = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
        assert text == r.text and tokens == r.logprobs.tokens
        assert lps[0] is None and lps[1:] == pytest.approx(r.logprobs.token_logprobs[1:], abs=1e-4)


def test_streaming_is_token_identical_to_unified(client, unified):
    prompt = PROMPTS[1]
    ref = _chat(unified, prompt, 16)
    chunks = list(_chat(client, prompt, 16, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 16


def test_one_token_stop_strings_and_completions_match_unified(client, unified):
    for kw in ({"max_tokens": 1}, {"max_tokens": 10, "stop": ["a", "e"]}):
        ref = unified.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}],
                                              temperature=0, **kw)
        got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}],
                                             temperature=0, **kw)
        assert got.choices[0].message.content == ref.choices[0].message.content
        assert got.choices[0].finish_reason == ref.choices[0].finish_reason
    ref = unified.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0, extra_body=IGNORE_EOS)
    got = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0, extra_body=IGNORE_EOS)
    assert got.choices[0].text == ref.choices[0].text


def test_structured_output_through_the_cluster_matches_unified(client, unified):
    # the decode worker's grammar replays the prefill worker's first token before sampling its own
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "required": ["a", "b"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    ref = _chat(unified, PROMPTS[0], 24, response_format=fmt)
    got = _chat(client, PROMPTS[0], 24, response_format=fmt)
    assert got.choices[0].message.content == ref.choices[0].message.content
    assert got.choices[0].finish_reason == ref.choices[0].finish_reason
    with pytest.raises(openai.BadRequestError):  # rejected by the router, before any worker
        _chat(client, PROMPTS[0], 4, response_format={"type": "json_schema", "json_schema": {
            "name": "bad", "schema": {"type": "no-such-type"}}})


def test_n_choices_match_unified(client, unified):
    ref = _chat(unified, PROMPTS[1], 6, n=3)
    got = _chat(client, PROMPTS[1], 6, n=3)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.message.content for c in got.choices] == [c.message.content for c in ref.choices]
    assert got.usage.completion_tokens == ref.usage.completion_tokens == 18
    chunks = list(_chat(client, PROMPTS[1], 6, n=2, stream=True))
    for i in range(2):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == ref.choices[i].message.content


def test_bad_input_gets_clear_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, "x " * 2000, 8)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[10**9], max_tokens=2)


def test_the_router_applies_the_server_limits(client, cluster):
    """The router is the server's app: counts and non-finite numbers are refused there, before any worker
    sees them, and its admission bound is built on the decode workers' max_num_seqs (2 x 128, + 4x waiting)."""
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, PROMPTS[0], 4, n=100000)
    assert e.value.body["param"] == "n"
    r = httpx.post(f"{cluster}/v1/chat/completions", headers={"content-type": "application/json"},
                   content=b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": NaN}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert metric(cluster, "deepinfer:admission_capacity") == 5 * 2 * 128
    assert _chat(client, PROMPTS[0], 2).choices
    assert metric(cluster, "deepinfer:admitted_sequences") == 0


def test_metrics_have_per_worker_and_per_pool_signals(client, cluster):
    _chat(client, PROMPTS[1], 4)
    text = httpx.get(f"{cluster}/metrics", timeout=10).text
    for name in ("worker_queued_prefill_seconds", "worker_running_requests", "worker_kv_usage",
                 "pool_queued_prefill_seconds", "pool_running_requests", "pool_kv_usage"):
        assert f"deepinfer:cluster_{name}" in text
    assert metric(cluster, "deepinfer:cluster_pool_workers_live") == 4
    assert metric(cluster, "deepinfer:cluster_worker_up") == 4
    assert metric(cluster, "deepinfer:generation_tokens_total") > 0  # the server's own metrics still work


def test_the_router_keeps_its_latest_routing_decisions(client, cluster):
    before = len(httpx.get(f"{cluster}/internal/routes", headers=INTERNAL, timeout=10).json()["routes"])
    _chat(client, PROMPTS[2], 2)
    routes = httpx.get(f"{cluster}/internal/routes", headers=INTERNAL, timeout=10).json()["routes"]
    assert len(routes) == before + 1
    last = routes[-1]
    roles = {w["url"]: w["role"] for w in _workers(cluster)}
    assert roles[last["prefill"]] == "prefill" and roles[last["decode"]] == "decode"
    assert last["prompt_tokens"] > 0 and last["prefill_estimate_seconds"] > 0 and last["attempt"] == 0
    # where each worker runs, for the decode pick's locality rule (unpinned: the CPUs this process may use)
    for w in _workers(cluster):
        assert w["view"]["host"] == socket.gethostname()
        assert list(w["view"]["cpus"]) == sorted(os.sched_getaffinity(0))


def test_a_prompt_arriving_while_its_prefix_is_in_prefill_is_routed_knowing_it(client, cluster):
    """Two turns of one conversation sent at once (a long shared history): the one routed second sees that
    the other's prefill, not yet in the store, will have computed their shared blocks on its worker."""
    seen = []
    for attempt in range(5):
        history = f"Conversation {attempt}. " + PROMPTS[2] * 4
        start = threading.Barrier(2)

        def send(turn: str, history: str = history, start: threading.Barrier = start) -> None:
            start.wait()
            _chat(client, history + turn, 2)

        threads = [threading.Thread(target=send, args=(t,)) for t in (" First question?", " Second question?")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        first, second = httpx.get(f"{cluster}/internal/routes", headers=INTERNAL, timeout=10).json()["routes"][-2:]
        assert first["inflight_prefix_tokens"] == {}  # the first one routed had nothing to share
        seen.append(second["inflight_prefix_tokens"])
        if seen[-1]:
            break
    # on the first one's worker only; the history is ~280 tokens: many whole 16-token blocks
    assert list(seen[-1]) == [first["prefill"]] and seen[-1][first["prefill"]] >= 128, seen
    # which the estimate there counts as cached: the second prompt's compute there is a fraction of a cold one
    cold = second["prefill_finishes"][second["prefill"]] if second["prefill"] != first["prefill"] else None
    there = second["prefill_finishes"][first["prefill"]] - first["prefill_estimate_seconds"]
    assert there < 0.5 * (cold if cold is not None else first["prefill_estimate_seconds"])


def test_internal_endpoints_reject_bad_input(cluster):
    worker = next(w["url"] for w in _workers(cluster) if w["role"] == "prefill")
    for path, body in (("prefill", {"request_id": "x"}), ("decode", {"request_id": "x", "prompt_token_ids": [1]}),
                       ("prefill", {"request_id": "x", "prompt_token_ids": [1], "params": {"bogus": 1}}),
                       ("prefill", {"request_id": "x", "prompt_token_ids": [1], "params": {"temperature": -1}})):
        r = httpx.post(f"{worker}/internal/{path}", json=body, headers=INTERNAL, timeout=10)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"]
    r = httpx.post(f"{worker}/internal/prefill", content=b"{not json", headers=INTERNAL, timeout=10)
    assert r.status_code == 400


def test_register_rejects_bad_workers(cluster):
    r = httpx.post(f"{cluster}/internal/register", json={"url": "ftp://x", "role": "prefill"}, headers=INTERNAL, timeout=10)
    assert r.status_code == 400
    r = httpx.post(f"{cluster}/internal/register", json={"url": "http://127.0.0.1:1", "role": "boss"}, headers=INTERNAL, timeout=10)
    assert r.status_code == 400


def test_client_disconnect_aborts_on_the_decode_worker(client, cluster):
    stream = _chat(client, PROMPTS[2], 400, stream=True)
    chunks = 0
    for chunk in stream:
        chunks += bool(chunk.choices and chunk.choices[0].delta.content)
        if chunks >= 3:
            break
    stream.close()
    decoders = [w["url"] for w in _workers(cluster) if w["role"] == "decode"]
    deadline = time.monotonic() + 20
    while True:  # the router closed its stream to the worker, which aborted the request and freed its blocks
        loads = [httpx.get(f"{u}/internal/load", headers=INTERNAL, timeout=10).json() for u in decoders]
        if all(ld["num_running"] == 0 and ld["num_waiting"] == 0 and ld["kv_usage"] == 0 for ld in loads):
            break
        assert time.monotonic() < deadline, loads
        time.sleep(0.2)


# ---------------------------------------------------------------- faults (they kill workers: keep them last)


def _stream_outcome(c: openai.OpenAI, prompt: str, max_tokens: int, progress: list[int], slot: int) -> str:
    try:
        finish, tokens = None, 0
        for chunk in _chat(c, prompt, max_tokens, stream=True, stream_options={"include_usage": True}):
            if chunk.choices:
                progress[slot] += 1
                finish = chunk.choices[0].finish_reason or finish
            elif chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        if finish == "length" and tokens == max_tokens:
            return "completed"
        return f"lost (finish={finish}, tokens={tokens})"  # ended without an error and without finishing
    except openai.APIError:
        return "error"


def _next_prefill_pick(cluster: str, route: dict) -> dict:
    """The prefill worker the router's policy picks next for a prompt routed like `route` (an earlier
    routing decision for the same prompt), from the views the router reports, once no prefill worker
    has work queued (a stale report of queued work would count) and each has been polled since this call
    began (a poll landing between this prediction and the request would bring the cost models the
    earlier request refitted)."""
    start = time.monotonic()
    deadline = start + 15
    while True:
        workers = [w for w in _workers(cluster) if w["role"] == "prefill"]
        fresh = all(w["seen_seconds_ago"] is not None and w["seen_seconds_ago"] < time.monotonic() - start
                    for w in workers)
        if fresh and all(w["view"]["queued_prefill_seconds"] == 0 for w in workers) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    fields = {f.name for f in dataclasses.fields(WorkerView)} - {"cost_model"}
    models = peer_cost_models([Worker(w["url"], "prefill", load=w["load"]) for w in workers])  # as the router
    views = [WorkerView(**{k: v for k, v in w["view"].items() if k in fields}, cost_model=models[w["url"]])
             for w in workers]
    # the store may have the prompt's blocks by now: a pick that depends on it cannot be predicted
    picks = {DeepInferPolicy().pick_prefill(views, RouteInfo(route["prompt_tokens"], cached)).url
             for cached in (route["cached_tokens"], (route["prompt_tokens"] - 1) // 16 * 16)}
    assert len(picks) == 1, picks
    return next(w for w in workers if w["url"] in picks)


def test_prefill_worker_dying_before_the_first_token_is_retried_elsewhere(client, cluster):
    # polls are 2 s apart: right after the kill the router still counts the worker in rotation, and kill
    # the worker the policy picks next, so the request must move
    _chat(client, PROMPTS[1], 1)
    before = httpx.get(f"{cluster}/internal/workers", headers=INTERNAL, timeout=10).json()["prefill_retries"]
    victim = _next_prefill_pick(cluster, httpx.get(f"{cluster}/internal/routes", headers=INTERNAL, timeout=10).json()["routes"][-1])
    os.kill(victim["load"]["pid"], signal.SIGKILL)
    r = _chat(client, PROMPTS[1], 6)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    state = httpx.get(f"{cluster}/internal/workers", headers=INTERNAL, timeout=10).json()
    route = httpx.get(f"{cluster}/internal/routes", headers=INTERNAL, timeout=10).json()["routes"][-1]
    assert state["prefill_retries"] == before + 1, f"victim {victim['url']}: {route}"
    assert not next(w for w in state["workers"] if w["url"] == victim["url"])["alive"]


def test_decode_worker_dying_mid_stream_loses_no_request(client, cluster):
    c = client.with_options(timeout=90)
    n, max_tokens = 6, 300
    progress = [0] * n
    outcomes: list[str | None] = [None] * n

    def run(i: int) -> None:
        outcomes[i] = _stream_outcome(c, PROMPTS[i % len(PROMPTS)], max_tokens, progress, i)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sum(p > 3 for p in progress) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    victim = next(w for w in _workers(cluster) if w["role"] == "decode" and w["alive"])
    os.kill(victim["load"]["pid"], signal.SIGKILL)
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), f"requests hung: {outcomes}"
    assert all(o in ("completed", "error") for o in outcomes), outcomes
    assert "error" in outcomes  # some streams were on the killed worker (decode spreads them over both)
    # the survivors serve new requests
    for prompt in PROMPTS:
        r = _chat(client, prompt, 6)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    assert not next(w for w in _workers(cluster) if w["url"] == victim["url"])["alive"]


@pytest.mark.slow  # ~50 s: a second cluster, pinned
def test_pinned_workers_decode_next_to_their_prefill_worker(tiny_models, tmp_path):
    """`--pin-workers` deals the workers over the CPUs (prefill workers first). On an idle cluster the decode
    scores tie, and the deepinfer policy gives the tie to the decode worker sharing the prefill worker's CPUs."""
    with running_cluster("--model", str(tiny_models[MODEL]), *FLAGS, "--prefill-workers", "2", "--decode-workers",
                         "2", "--pin-workers", "--health-interval", "0.5", log=tmp_path / "cluster.log") as base:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        for prompt in PROMPTS * 2:
            _chat(c, prompt, 2)
        routes = httpx.get(f"{base}/internal/routes", headers=INTERNAL, timeout=10).json()["routes"]
        cpus = {w["url"]: set(w["view"]["cpus"]) for w in _workers(base)}
    assert len(routes) == 2 * len(PROMPTS)
    assert len({r["prefill"] for r in routes}) == 2  # the idle prefill workers share the work
    assert all(cpus[r["prefill"]] & cpus[r["decode"]] for r in routes), routes
    # every decode candidate is logged as the pick saw it, and the pick was within the margin of the best
    for r in routes:
        assert set(r["decode_loads"]) == set(cpus) - {r["prefill"] for r in routes}
        scores = {url: d["score"] for url, d in r["decode_loads"].items()}
        assert scores[r["decode"]] <= min(scores.values()) + 0.2


@pytest.mark.slow
def test_router_command_with_workers_joining_by_url(tiny_models, tmp_path):
    """`deepinfer router` with no workers listed; a prefill and a decode worker started with --router-url
    register and heartbeat; the router serves once both are in, and drops a worker that stops."""
    import subprocess
    import sys

    from tests.server_utils import free_port

    model = str(tiny_models[MODEL])
    port = free_port()
    router = f"http://127.0.0.1:{port}"
    procs = [subprocess.Popen([sys.executable, "-m", "deepinfer.cli", "--log-level", "WARNING", "router", "--port",
                               str(port), "--model", model, "--health-interval", "0.5", "--worker-timeout", "3"])]
    try:
        for role in ("prefill", "decode"):
            procs.append(subprocess.Popen([sys.executable, "-m", "deepinfer.cli", "--log-level", "WARNING", "serve",
                                           "--role", role, "--port", str(free_port()), "--model", model, *FLAGS,
                                           "--router-url", router]))
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{router}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the workers did not join"
            time.sleep(0.5)
        c = openai.OpenAI(base_url=f"{router}/v1", api_key="x", max_retries=0, timeout=60)
        r = _chat(c, PROMPTS[1], 5)
        assert r.usage.completion_tokens == 5
        assert sorted(w["role"] for w in _workers(router)) == ["decode", "prefill"]
        procs[2].terminate()
        procs[2].wait(timeout=30)
        deadline = time.monotonic() + 15
        while httpx.get(f"{router}/health", timeout=2).status_code == 200:
            assert time.monotonic() < deadline, "a stopped worker stayed in rotation"
            time.sleep(0.2)
        with pytest.raises(openai.APIStatusError) as e:
            _chat(c, PROMPTS[1], 5)
        assert e.value.status_code == 503
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
