"""Tenant isolation of the prefix cache and authentication inside a cluster.

Two API keys are two tenants: the same long prompt sent by the second finds none of the first's KV,
in any tier (device cache, persistent store after a restart, a 1P+1D cluster's router lookup and KV
transfer), whatever `cache_salt` it sends; keys of one `KEY=GROUP` group share. Stored responses are the
tenant's own (another key gets the 404 of an unknown id). Internal endpoints, the KV transfer port and
a worker's public API refuse peers without the cluster token. Real servers, workers, stores and sockets.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.cluster.auth import CLUSTER_TOKEN_HEADER
from deepinfer.cluster.transfer import (
    MAC_SIZE,
    MAGIC,
    NONCE_SIZE,
    KVTransferError,
    TCPKVTransfer,
    handshake_mac,
)
from deepinfer.config import API_KEYS_ENV, CLUSTER_TOKEN_ENV, ServerConfig, config_from_args
from deepinfer.kvcache.hashing import root_hash
from deepinfer.kvcache.space import scan
from deepinfer.server.tenants import Tenants, cache_id
from tests.server_utils import free_port, metric, running_server

FLAGS = ("--served-model-name", "tiny", "--dtype", "float32", "--kv-cache-memory", "64MiB", "--no-profile-cost-model", "--max-model-len", "512")
KEY_A, KEY_B, KEY_C, KEY_D = "key-alice", "key-bob", "key-carol", "key-dave"
BS = 16


def _prompt(seed: int, n: int = 70) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def _cached(base: str, key: str, prompt: list[int], **extra) -> int:
    """Cached prompt tokens of one completion sent with `key` (through the official SDK)."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True, **extra})
    return r.usage.prompt_tokens_details.cached_tokens


def _responses_are_the_tenants_own(base: str) -> None:
    """A's stored response: for B, GET, DELETE and previous_response_id answer exactly as for an unknown id
    (nothing tells B it exists); A still reads and continues it afterwards."""
    a = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY_A, max_retries=0, timeout=120)
    first = a.responses.create(model="tiny", input="hello", max_output_tokens=2)
    unknown = "resp_" + "0" * 32

    def as_b(method: str, rid: str) -> httpx.Response:
        headers = {"authorization": f"Bearer {KEY_B}"}
        if method == "POST":
            return httpx.post(f"{base}/v1/responses", headers=headers, timeout=60, json={
                "model": "tiny", "input": "more", "max_output_tokens": 2, "previous_response_id": rid})
        return httpx.request(method, f"{base}/v1/responses/{rid}", headers=headers, timeout=60)

    for method in ("GET", "DELETE", "POST"):
        theirs, none = as_b(method, first.id), as_b(method, unknown)
        assert theirs.status_code == none.status_code == 404, (method, theirs.text)
        assert theirs.json() == json.loads(none.text.replace(unknown, first.id)), method
    assert a.responses.retrieve(first.id).output == first.output  # B's DELETE left it in place
    second = a.responses.create(model="tiny", input="more", max_output_tokens=2, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    a.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(first.id)


# ---------------------------------------------------------------- the scheme, in process


def test_tenant_and_salt_are_separate_fields_of_the_root():
    model, layout = "model-x", "float32/16/3/2/16"
    plain = root_hash(model, layout)
    assert root_hash(model, layout, None, None) == plain  # no tenant: the root stores were written with
    tenant = cache_id(key=KEY_A)
    roots = {plain, root_hash(model, layout, tenant), root_hash(model, layout, None, tenant),
             root_hash(model, layout, tenant, tenant), root_hash(model, layout, "s", tenant),
             root_hash(model, layout, f"s|tenant|{len(tenant)}:{tenant}"), root_hash(model, layout, KEY_A)}
    assert len(roots) == 7  # a salt never spells a tenant, nor a tenant a salt
    assert root_hash(model, layout, "s", tenant) == root_hash(model, layout, "s", cache_id(key=KEY_A))  # stable


def test_api_keys_groups_and_config():
    from deepinfer.cli import build_parser

    tenants = Tenants([KEY_A, KEY_B, f"{KEY_C}=team", f"{KEY_D}=team", "b64key=="])
    a, b, c, d = (tenants.match(k) for k in (KEY_A, KEY_B, KEY_C, KEY_D))
    assert len({a.cache_id, b.cache_id, c.cache_id}) == 3 and c == d and c.group == "team"
    assert tenants.match("b64key==") is not None and tenants.match("b64key") is None
    assert tenants.match(f"{KEY_C}=team") is None and tenants.match("") is None
    assert KEY_A not in a.cache_id and cache_id(group=KEY_A) != cache_id(key=KEY_A)
    for bad in ([""], ["=team"], [KEY_A, KEY_A]):
        with pytest.raises(ValueError):
            Tenants(bad)
    # one key as a string (the old type) still works; the repr never shows keys or the cluster token
    cfg = ServerConfig(api_key=KEY_A, cluster_token="secret-token")
    assert cfg.api_key == (KEY_A,) and KEY_A not in repr(cfg) and "secret-token" not in repr(cfg)
    args = build_parser().parse_args(["serve", "--api-key", KEY_A, "--api-key", f"{KEY_C}=team"])
    assert config_from_args(ServerConfig, args).api_key == (KEY_A, f"{KEY_C}=team")
    assert config_from_args(ServerConfig, build_parser().parse_args(["router"])).api_key == ()


def test_api_keys_from_the_environment(monkeypatch, capsys):
    from deepinfer.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert f"${API_KEYS_ENV}" in capsys.readouterr().out
    monkeypatch.setenv(API_KEYS_ENV, f" {KEY_A}, {KEY_B}\n{KEY_C}=team\r\n\n")
    serve = build_parser().parse_args(["serve"])
    assert config_from_args(ServerConfig, serve).api_key == (KEY_A, KEY_B, f"{KEY_C}=team")
    given = build_parser().parse_args(["router", "--api-key", KEY_D])
    assert config_from_args(ServerConfig, given).api_key == (KEY_D,)  # --api-key wins over the variable
    monkeypatch.setenv(API_KEYS_ENV, f"{KEY_A},{KEY_A}")
    with pytest.raises(ValueError, match="twice"):
        ServerConfig()


def test_router_store_lookup_hashes_with_the_tenant(tiny_models, tmp_path):
    """What a worker writes to the store for a tenant is what the router finds for that tenant, and
    only for it; the tenant's id sent as a salt does not reach its blocks either."""
    from deepinfer.cluster.client import ClusterEngineClient
    from deepinfer.cluster.policies import DeepInferPolicy
    from deepinfer.cluster.pool import WorkerPool
    from deepinfer.config import RouterConfig
    from deepinfer.kvcache import RetentionPolicy
    from deepinfer.kvcache.blocks import layout_of

    store, prompt, tenant = tmp_path / "store", _prompt(1), cache_id(key=KEY_A)
    with LLM(str(tiny_models["llama"]), dtype="float32", kv_cache_memory="64MiB", profile_cost_model=False,
             kv_store=str(store), kv_store_admit="always") as llm:
        engine = llm.engine
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2), prompt_token_ids=prompt,
                           cache_tenant=tenant)
        while engine.has_unfinished():
            engine.step()
        core = engine.core
        core.flush_kv_store()
        lay = layout_of(core.runner.kv_caches)
        load = {"model_identity": core.model_identity,
                "kv_layout": [lay.dtype, lay.block_size, lay.num_layers, lay.num_kv_heads, lay.head_dim]}
        # the same engine: the tenant's blocks are device hits for the tenant only
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), cache_salt=tenant)[0]
        assert out.num_cached_tokens == 0
    pool = WorkerPool()
    worker = pool.add("http://127.0.0.1:1", "prefill")
    worker.load, worker.alive = load, True
    client = ClusterEngineClient(pool, DeepInferPolicy(), None, 50000, RetentionPolicy(), RouterConfig(), 1024, store)

    def stored(salt: str | None, tenant_id: str | None) -> int:
        hashes, block_size = client._block_hashes(prompt, salt, tenant_id)
        return client._store_lookup(load, hashes) * block_size

    assert stored(None, tenant) == 64
    assert stored(None, None) == stored(None, cache_id(key=KEY_B)) == stored("other", tenant) == 0


async def _closed(reader: asyncio.StreamReader) -> bool:
    """Whether the peer closed the connection without sending anything (a reset counts: it closed with
    our bytes unread)."""
    try:
        return await asyncio.wait_for(reader.read(), 5) == b""
    except ConnectionResetError:
        return True


def test_kv_transfer_handshake_needs_the_token():
    async def main():
        rx = TCPKVTransfer("127.0.0.1", 0, token="right")
        seen: list[str] = []
        blocks = [(bytes([i]) * 16, bytes([i]) * 100) for i in range(3)]

        async def on_transfer(incoming):
            seen.append(incoming.transfer_id)
            async for _ in incoming:
                pass

        addr = await rx.start(on_transfer)
        assert await TCPKVTransfer(token="right").send(addr, "ok", blocks) == 3
        for token in ("wrong", None):  # a wrong token, none at all: the receiver proves nothing to them
            with pytest.raises(KVTransferError, match="cluster token"):
                await TCPKVTransfer(token=token).open(addr, f"bad-{token}", 5)
        # a raw peer that answers the challenge with a bogus proof and sends a block: closed, nothing taken
        host, port = addr.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(MAGIC + os.urandom(NONCE_SIZE))
        await reader.readexactly(NONCE_SIZE + MAC_SIZE)
        writer.write(b"\x00\x03bad" + os.urandom(MAC_SIZE) + b"B" + bytes(16) * 2 + (100).to_bytes(8, "big")
                     + bytes(100))
        assert await _closed(reader)  # without a byte of answer
        writer.close()
        # the previous protocol's header (no handshake) followed by a block: closed too
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"DIKV2\n\x00\x03old" + b"B" + bytes(40) + bytes(100))
        assert await _closed(reader)
        writer.close()
        for _ in range(50):
            if rx.refused == 4:
                break
            await asyncio.sleep(0.05)
        assert seen == ["ok"] and rx.blocks_received == 3 and rx.refused == 4
        await rx.close()

    asyncio.run(main())


# ---------------------------------------------------------------- a real server, a real store


def test_tenants_do_not_share_cached_prefixes_even_through_the_store(tiny_models, tmp_path, monkeypatch):
    """The first server takes its keys from $DEEPINFER_API_KEYS, the restarted one from --api-key: the
    same tenants (the store's hits across the restart show it)."""
    store = tmp_path / "store"
    keys = ("--api-key", KEY_A, "--api-key", KEY_B, "--api-key", f"{KEY_C}=team", "--api-key", f"{KEY_D}=team")
    model = ("--model", str(tiny_models["llama"]), *FLAGS, "--kv-store", str(store), "--kv-store-admit", "always")
    p, q, shared = _prompt(10), _prompt(11), _prompt(12)
    monkeypatch.setenv(API_KEYS_ENV, f"{KEY_A},{KEY_B}\n{KEY_C}=team\n{KEY_D}=team\n")  # the process inherits it
    with running_server(*model, log=tmp_path / "first.log") as base:
        monkeypatch.delenv(API_KEYS_ENV)
        assert _cached(base, KEY_A, p) == 0
        assert _cached(base, KEY_B, p) == 0  # A's blocks are on the device: not B's
        assert _cached(base, KEY_A, p) == 64  # ... and still A's
        assert _cached(base, KEY_B, p, cache_salt=cache_id(key=KEY_A)) == 0  # B cannot pick A's namespace
        assert _cached(base, KEY_B, p, cache_salt=KEY_A) == 0
        assert _cached(base, KEY_A, q) == 0
        assert _cached(base, KEY_C, shared) == 0
        assert _cached(base, KEY_D, shared) == 64  # one group, one cache (explicitly configured)
        assert _cached(base, KEY_A, shared) == 0
        # the Anthropic API carries the tenant too
        r = httpx.post(f"{base}/v1/messages", headers={"x-api-key": KEY_B}, timeout=60, json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "lorem ipsum " * 40}]})
        assert r.status_code == 200 and r.json()["usage"]["cache_read_input_tokens"] == 0
        r = httpx.post(f"{base}/v1/messages", headers={"x-api-key": KEY_A}, timeout=60, json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "lorem ipsum " * 40}]})
        assert r.json()["usage"]["cache_read_input_tokens"] == 0
        assert httpx.post(f"{base}/v1/completions", json={"prompt": p}, timeout=30).status_code == 401
        _responses_are_the_tenants_own(base)
    # a restart: only the store remembers, and it keeps the tenants apart as well
    with running_server(*model, *keys, log=tmp_path / "second.log") as base:
        assert _cached(base, KEY_B, q) == 0  # only A sent q
        assert _cached(base, KEY_B, q, cache_salt=cache_id(key=KEY_A)) == 0
        assert _cached(base, KEY_A, q) == 64  # from the store
        assert _cached(base, KEY_D, shared) == 64


# ---------------------------------------------------------------- a real 1P+1D cluster


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


@pytest.mark.slow  # ~22 s: a cluster
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads worker environments from /proc")
def test_cluster_keeps_tenants_apart_and_its_internals_need_the_token(tiny_models, tmp_path):
    """`serve --prefill-workers 1 --decode-workers 1` with no token given: it generates one and hands it to
    the workers in their environment (not argv). Tenants stay apart through the router's store lookup,
    the prefill worker's cache and the KV transfer; internal endpoints and the KV port refuse peers
    without the token."""
    store, port = tmp_path / "store", free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != CLUSTER_TOKEN_ENV}
    cmd = [sys.executable, "-m", "deepinfer.cli", "--log-level", "WARNING", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--model", str(tiny_models["llama"]), *FLAGS, "--kv-store", str(store), "--kv-store-admit", "always", "--api-key", KEY_A,
           "--api-key", KEY_B, "--prefill-workers", "1", "--decode-workers", "1", "--health-interval", "0.5"]
    log = open(tmp_path / "cluster.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "cluster.log").read_text()
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the cluster did not come up"
            time.sleep(0.5)
        workers = [p for p in _descendants(proc.pid)
                   if b"--role" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert workers
        environ = Path(f"/proc/{workers[0]}/environ").read_bytes().split(b"\0")
        token = next(e.split(b"=", 1)[1] for e in environ if e.startswith(CLUSTER_TOKEN_ENV.encode() + b"="))
        assert len(token) >= 32
        assert all(token not in Path(f"/proc/{p}/cmdline").read_bytes() for p in [proc.pid, *workers])
        internal = {CLUSTER_TOKEN_HEADER: token.decode()}

        # the router's /internal: refused without the token (or with a wrong one), served with it
        assert httpx.get(f"{base}/internal/workers", timeout=10).status_code == 401
        assert httpx.get(f"{base}/internal/routes", headers={CLUSTER_TOKEN_HEADER: "x"}, timeout=10).status_code == 401
        r = httpx.post(f"{base}/internal/register", json={"url": "http://127.0.0.1:1", "role": "prefill"}, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_cluster_token"
        listed = httpx.get(f"{base}/internal/workers", headers=internal, timeout=10).json()["workers"]
        assert len(listed) == 2 and all(w["alive"] for w in listed)
        urls = {w["role"]: w["url"] for w in listed}
        # the workers' /internal likewise; a forged tenant in a prefill body never reaches the engine
        assert httpx.get(f"{urls['decode']}/internal/load", timeout=10).status_code == 401
        forged = {"request_id": "x", "prompt_token_ids": _prompt(20), "params": {"max_tokens": 2},
                  "cache_tenant": cache_id(key=KEY_A)}
        assert httpx.post(f"{urls['prefill']}/internal/prefill", json=forged, timeout=10).status_code == 401
        # the workers' public API too: a client cannot bypass the router's API keys (nor pick a tenant)
        chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{urls['decode']}/v1/chat/completions", json=chat, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_cluster_token"
        r = httpx.post(f"{urls['prefill']}/v1/messages", headers={"x-api-key": KEY_A}, json=chat, timeout=10)
        assert r.status_code == 401 and r.json()["type"] == "error"  # in the Anthropic API's shape
        assert httpx.post(f"{urls['prefill']}/tokenize", json={"prompt": "hi"}, timeout=10).status_code == 401
        r = httpx.post(f"{urls['decode']}/v1/chat/completions", json=chat, headers=internal, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
        assert httpx.get(f"{urls['decode']}/health", timeout=10).status_code == 200  # probes need no token
        _responses_are_the_tenants_own(base)  # the router serves the Responses API itself

        def load(role: str) -> dict:
            return httpx.get(f"{urls[role]}/internal/load", headers=internal, timeout=10).json()

        def last_route() -> dict:
            return httpx.get(f"{base}/internal/routes", headers=internal, timeout=10).json()["routes"][-1]

        p = _prompt(21)
        hits = metric(urls["decode"], "deepinfer:prefix_cache_hits_total")
        assert _cached(base, KEY_A, p) == 0
        assert load("decode")["blocks_imported"] >= 4  # A's KV went over the (authenticated) transfer
        # ... and the decode worker continued A's request in A's namespace, where the blocks landed
        assert metric(urls["decode"], "deepinfer:prefix_cache_hits_total") - hits >= 64
        deadline = time.monotonic() + 30  # the prefill worker writes the store through in the background
        while (not store.is_dir() or scan(store)["blocks"] < 4) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _cached(base, KEY_B, p) == 0
        assert last_route()["cached_tokens"] == 0  # the router's store lookup hashed with B's tenant
        assert _cached(base, KEY_B, p, cache_salt=cache_id(key=KEY_A)) == 0
        assert last_route()["cached_tokens"] == 0
        assert _cached(base, KEY_A, p) == 64
        assert last_route()["cached_tokens"] == 64  # ... and with A's, it finds A's blocks

        # the decode worker's KV port: a peer without the token is closed before any block is read
        imported = load("decode")["blocks_imported"]
        received = load("decode")["transfers_received"]
        host, kv_port = load("decode")["kv_transfer"].rsplit(":", 1)
        with socket.create_connection((host, int(kv_port)), timeout=10) as s:
            s.sendall(MAGIC + os.urandom(NONCE_SIZE))
            challenge = b""
            while len(challenge) < NONCE_SIZE + MAC_SIZE:
                chunk = s.recv(NONCE_SIZE + MAC_SIZE - len(challenge))
                assert chunk
                challenge += chunk
            proof = handshake_mac("not-the-token", b"sender", challenge[:NONCE_SIZE], b"x", b"tid")
            block = b"B" + bytes(16) * 2 + (64).to_bytes(8, "big") + bytes(64)
            s.sendall(b"\x00\x03tid" + proof + block)
            try:
                answer = s.recv(100)
            except ConnectionResetError:  # closed with our block unread: a reset is a close too
                answer = b""
            assert answer == b""
        after = load("decode")
        assert after["blocks_imported"] == imported and after["transfers_received"] == received
        assert after["transfers_refused"] == 1
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
