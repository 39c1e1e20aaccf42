"""KV streaming between real workers: a local cluster (router, 2 prefill + 1 decode worker processes) whose
prefill runs in small chunks, so a long prompt's blocks are shipped while it still computes.

- the decode worker has imported most of a long prompt's blocks before the router even asks it to decode
  (which it does only once the first token exists), and the output is token-identical to one engine;
- a prefill worker killed mid-stream: the router retries on the other one, the decode worker drops the
  partial transfer (no block stays held or used), and the answer is still identical.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import httpx
import openai
import pytest

from deepinfer import LLM, SamplingParams
from tests.server_utils import INTERNAL, running_cluster
from tests.server_utils import cluster_workers as _workers

CHUNK = 8
FLAGS = ("--dtype", "float32", "--kv-cache-memory", "64MiB", "--no-profile-cost-model", "--max-model-len", "1024",
         "--max-num-batched-tokens", str(CHUNK), "--scheduler", "tokens")
MODEL = "llama"
BS = 16


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def _load(url: str) -> dict:
    return httpx.get(f"{url}/internal/load", headers=INTERNAL, timeout=10).json()


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    log = tmp_path_factory.mktemp("stream") / "cluster.log"
    with running_cluster("--model", str(tiny_models[MODEL]), *FLAGS, "--prefill-workers", "2", "--decode-workers",
                         "1", "--health-interval", "2", "--token-timeout", "60", log=log) as base:
        yield base


@pytest.fixture(scope="module")
def reference(tiny_models):
    with LLM(str(tiny_models[MODEL]), dtype="float32", kv_cache_memory="64MiB", profile_cost_model=False,
             max_model_len=1024, kv_store="none") as llm:
        def run(prompt: list[int], n: int) -> str:
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            return llm.generate([prompt], params)[0].outputs[0].text
        yield run


def _complete(base: str, prompt: list[int], n: int) -> str:
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == n
    return r.choices[0].text


def _decoder(base: str) -> str:
    return next(w["url"] for w in _workers(base) if w["role"] == "decode")


def _settled(url: str, timeout: float = 20) -> dict:
    """The decode worker's load once nothing runs and no transfer is held (fails the test otherwise)."""
    deadline = time.monotonic() + timeout
    while True:
        ld = _load(url)
        if ld["num_running"] == 0 and ld["transfers_pending"] == 0 and ld["kv_blocks_held"] == 0 \
                and ld["kv_usage"] == 0:
            return ld
        assert time.monotonic() < deadline, {k: ld[k] for k in ("num_running", "transfers_pending", "kv_blocks_held",
                                                                 "kv_usage", "transfers_broken")}
        time.sleep(0.2)


def test_blocks_arrive_at_the_decode_worker_before_the_first_token(cluster, reference):
    prompt = _prompt(1, 900)  # 56 full blocks, computed 8 tokens a step
    full = len(prompt) // BS
    decoder = _decoder(cluster)
    before = _load(decoder)
    assert _complete(cluster, prompt, 8) == reference(prompt, 8)
    after = _settled(decoder)
    imported = after["blocks_imported"] - before["blocks_imported"]
    early = after["blocks_imported_before_decode"] - before["blocks_imported_before_decode"]
    assert imported == full
    # the router asks for the decode only once the first token exists: these were imported while the
    # prefill worker still computed the prompt (only the last chunk's block can come after it)
    assert early >= full // 2, (early, full)
    sent_early = sum(_load(w["url"])["blocks_sent_before_first_token"] for w in _workers(cluster)
                     if w["role"] == "prefill")
    assert sent_early >= full // 2


def test_prefill_worker_killed_mid_stream_is_retried_and_the_partial_transfer_dropped(cluster, reference):
    prompt = _prompt(2, 1000)
    want = reference(prompt, 6)
    decoder = _decoder(cluster)
    before = _load(decoder)
    retries = httpx.get(f"{cluster}/internal/workers", headers=INTERNAL, timeout=10).json()["prefill_retries"]
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["text"] = _complete(cluster, prompt, 6)
        except Exception as e:  # noqa: BLE001 - reported below
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    prefills = [w for w in _workers(cluster) if w["role"] == "prefill" and w["alive"]]
    full = len(prompt) // BS
    victim = None
    deadline = time.monotonic() + 60
    while victim is None:
        assert time.monotonic() < deadline and t.is_alive(), ("the prefill finished before it could be killed", result)
        # the worker computing the prompt (its running sequence identifies it: its queued-seconds estimate
        # can reach 0 before the prompt is done) is frozen at once, so a slow poll under a loaded machine
        # cannot let it finish while the decode worker's count is read; it is killed only mid-stream
        running = next((w for w in prefills if _load(w["url"])["num_running"] > 0), None)
        if running is not None:
            pid = running["load"]["pid"]
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.3)  # blocks already on the wire land before the count is read
            landed = _load(decoder)["blocks_imported"] - before["blocks_imported"]
            if 4 <= landed < full:
                victim = running
            else:
                os.kill(pid, signal.SIGCONT)
                assert landed < full, ("the whole prompt had been shipped before the prefill could be killed", landed)
        time.sleep(0.01)
    os.kill(victim["load"]["pid"], signal.SIGKILL)
    t.join(timeout=120)
    assert not t.is_alive(), "the request hung"
    assert result.get("text") == want, result
    state = httpx.get(f"{cluster}/internal/workers", headers=INTERNAL, timeout=10).json()
    assert state["prefill_retries"] == retries + 1
    after = _settled(decoder)  # nothing held, nothing in use: the broken transfer's blocks were released
    assert after["transfers_broken"] == before["transfers_broken"] + 1
    assert after["transfers_received"] == before["transfers_received"] + 2  # the broken one and the retry's
