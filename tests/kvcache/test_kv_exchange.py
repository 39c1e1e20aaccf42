"""The engine hooks of disaggregation, in process: export a prefilled prompt's KV blocks from one engine,
import them into another, continue there after the first token -- token-identical to one engine doing it all.

Real engines on tiny float32 models, real TCP transfer on 127.0.0.1; no mocks.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.cluster.transfer import TCPKVTransfer, checksum
from deepinfer.kvcache.exchange import export_blocks, import_blocks, prompt_block_hashes, release_blocks
from tests.conftest import hf_greedy
from tests.models.test_models_vs_hf import _assert_all_free

BS = 16


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def _llm(path) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory="64MiB", profile_cost_model=False, kv_store="none")


def _run(llm: LLM, prompt: list[int], params: SamplingParams, **kw):
    engine = llm.engine
    engine.add_request(prompt, params, prompt_token_ids=prompt, **kw)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
    return final


@pytest.mark.parametrize("length", [5, 16, 47, 64])
def test_prefill_here_decode_there_matches_one_engine(tiny_models, length):
    model = tiny_models["llama"]
    prompt = _prompt(length, length)
    full = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    with _llm(model) as unified, _llm(model) as prefill, _llm(model) as decode:
        ref = _run(unified, prompt, full).outputs[0]
        first = _run(prefill, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=2))
        assert first.outputs[0].token_ids == ref.token_ids[:1]
        blocks = export_blocks(prefill.engine.core, prompt, None)
        assert len(blocks) == length // BS  # every full block of the prompt, nothing of the tail
        assert [h for h, _ in blocks] == prompt_block_hashes(decode.engine.core, prompt, None)
        assert import_blocks(decode.engine.core, blocks) == len(blocks)
        out = _run(decode, prompt, full, output_prefix=first.outputs[0].token_ids,
                   prefix_logprobs=first.outputs[0].logprobs)
        got = out.outputs[0]
        assert got.token_ids == ref.token_ids
        assert got.text == ref.text
        assert out.num_cached_tokens == (length // BS) * BS  # the imported blocks were hits, not recomputed
        assert [max(e, key=lambda t: e[t].logprob) for e in got.logprobs] == ref.token_ids
        for a, b in zip(got.logprobs, ref.logprobs, strict=True):
            assert set(a) == set(b)
            for t in a:
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
        for llm in (unified, prefill, decode):
            _assert_all_free(llm)


def test_import_skips_held_blocks_and_stops_at_a_bad_payload(tiny_models):
    prompt = _prompt(3, 64)
    with _llm(tiny_models["llama"]) as a, _llm(tiny_models["llama"]) as b:
        _run(a, prompt, SamplingParams(temperature=0.0, max_tokens=1))
        blocks = export_blocks(a.engine.core, prompt, None)
        assert len(blocks) == 4
        assert export_blocks(a.engine.core, prompt, "another-tenant") == []  # the salt changes every name
        # a payload of the wrong size ends the import there: a prefix of the chain is all that is kept
        bad = [blocks[0], (blocks[1][0], bytearray(8)), *blocks[2:]]
        assert import_blocks(b.engine.core, bad) == 1
        assert import_blocks(b.engine.core, blocks) == 4
        _assert_all_free(b)


def test_tcp_transfer_delivers_blocks_and_keeps_only_a_verified_prefix():
    async def main():
        rx = TCPKVTransfer("127.0.0.1", 0)
        addr = await rx.start()
        tx = TCPKVTransfer()
        blocks = [(bytes([i]) * 16, bytes([i]) * (1000 + i)) for i in range(5)]
        assert await tx.send(addr, "t1", blocks) == 5
        got = await rx.receive("t1", timeout=5)
        assert [(h, bytes(p)) for h, p in got] == blocks
        assert checksum(got[2][1]) == checksum(blocks[2][1])
        # a transfer nobody sent times out instead of hanging
        with pytest.raises(TimeoutError):
            await rx.receive("never", timeout=0.2)
        # a corrupted block (checksum mismatch) cuts the run: blocks after it are dropped too
        import deepinfer.cluster.transfer as t

        real = t.checksum
        calls = []

        def flaky(data):
            calls.append(1)
            return b"\x00" * 16 if len(calls) == 3 else real(data)

        t.checksum = flaky
        try:
            accepted = await tx.send(addr, "t2", blocks)
        finally:
            t.checksum = real
        assert accepted == 2
        assert len(await rx.receive("t2", timeout=5)) == 2
        await rx.close()

    asyncio.run(main())


def test_tcp_stream_delivers_batches_as_they_are_sent_and_reports_a_break():
    from deepinfer.cluster.transfer import KVTransferError

    async def main():
        seen: dict[str, list] = {}
        ends: dict[str, str] = {}
        arrived = asyncio.Event()

        async def on_transfer(incoming):
            seen[incoming.transfer_id] = []
            try:
                async for batch in incoming:
                    seen[incoming.transfer_id].append([(h, bytes(p)) for h, p in batch])
                    arrived.set()
                ends[incoming.transfer_id] = "ok"
            except KVTransferError:
                ends[incoming.transfer_id] = "broken"

        rx = TCPKVTransfer("127.0.0.1", 0)
        addr = await rx.start(on_transfer)
        blocks = [(bytes([i]) * 16, bytes([i]) * 5000) for i in range(6)]
        stream = await TCPKVTransfer().open(addr, "s1")
        stream.send(blocks[:2])
        await asyncio.wait_for(arrived.wait(), 5)  # the first blocks land before the transfer is finished
        for _ in range(250):  # the two blocks may come as one batch or two, as the socket delivers them
            if sum(map(len, seen["s1"])) == 2:
                break
            await asyncio.sleep(0.02)
        assert "s1" not in ends and sum(map(len, seen["s1"])) == 2
        stream.send(blocks[2:])
        assert await stream.finish(5) == 6
        for _ in range(50):
            if "s1" in ends:
                break
            await asyncio.sleep(0.02)
        assert ends["s1"] == "ok" and [b for batch in seen["s1"] for b in batch] == blocks
        # a sender that goes away mid-stream: the receiver's iteration fails instead of waiting forever
        stream = await TCPKVTransfer().open(addr, "s2")
        stream.send(blocks[:3])
        for _ in range(50):
            if sum(map(len, seen.get("s2", []))) == 3:
                break
            await asyncio.sleep(0.02)
        await stream.abort()
        for _ in range(50):
            if "s2" in ends:
                break
            await asyncio.sleep(0.02)
        assert ends["s2"] == "broken" and sum(map(len, seen["s2"])) == 3
        await rx.close()

    asyncio.run(main())


def test_tcp_transfer_to_nobody_fails_fast():
    from deepinfer.cluster.transfer import KVTransferError
    from tests.server_utils import free_port

    async def main():
        with pytest.raises(KVTransferError):
            await TCPKVTransfer().send(f"127.0.0.1:{free_port()}", "x", [(b"\x01" * 16, b"abc")], timeout=5)

    asyncio.run(main())


def test_stats_report_queued_prefill_seconds_and_kv_tokens(tiny_models):
    with _llm(tiny_models["llama"]) as llm:
        engine = llm.engine
        cost = engine.core.cost_model
        assert engine.stats()["prefill_queued_seconds"] == 0.0
        for n in (40, 300):
            engine.add_request(_prompt(n, n), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        s = engine.stats()
        assert s["prefill_queued_seconds"] == pytest.approx(cost.prefill_seconds(40) + cost.prefill_seconds(300))
        assert s["kv_tokens"] == 0
        while engine.has_unfinished():
            engine.step()
            s = engine.stats()
            if s["num_running"] == 2 and s["prefill_queued_seconds"] == 0.0:
                assert s["kv_tokens"] >= 340  # both prompts computed, decoding
        assert engine.stats()["prefill_queued_seconds"] == 0.0 and engine.stats()["kv_tokens"] == 0


def test_queued_prefill_seconds_count_the_chunk_in_flight(tiny_models):
    """With host work overlapped, `step()` returns with the next step already launched, whose tokens
    the scheduler counts as computed: the prefill chunk in it must still count as queued work."""
    with LLM(str(tiny_models["llama"]), dtype="float32", kv_cache_memory="64MiB", profile_cost_model=False,
             kv_store="none", overlap_host_work="on", max_num_batched_tokens=64, scheduler="tokens") as llm:
        engine = llm.engine
        cost = engine.core.cost_model
        engine.add_request(_prompt(3, 300), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        seen = 0
        while engine.has_unfinished():
            engine.step()
            inflight = engine._inflight
            req = next(iter(engine.core.scheduler.running), None)
            if inflight is None or req is None or not any(i.num_new_tokens > 1 for i in inflight.plan.scheduled):
                continue
            start = next(i.start for i in inflight.plan.scheduled if i.num_new_tokens > 1)
            assert req.num_computed_tokens > start  # the scheduler already counts the chunk as computed
            want = cost.prefill_seconds(300, start)
            assert engine.stats()["prefill_queued_seconds"] == pytest.approx(want, rel=1e-6)
            seen += 1
        assert seen >= 3  # 300 tokens in 64-token chunks: several steps had a prefill chunk in flight


def test_router_store_lookup_names_blocks_like_the_engine(tiny_models, tmp_path):
    """The router's estimate of a prompt's cached part (a lookup in the shared store) must agree with
    what a worker writes there: same chain hashes from the worker's reported model identity and layout."""
    from deepinfer.cluster.client import ClusterEngineClient
    from deepinfer.cluster.policies import DeepInferPolicy
    from deepinfer.cluster.pool import WorkerPool
    from deepinfer.config import RouterConfig
    from deepinfer.kvcache import RetentionPolicy
    from deepinfer.kvcache.blocks import layout_of

    store = tmp_path / "store"
    prompt = _prompt(9, 70)
    with LLM(str(tiny_models["llama"]), dtype="float32", kv_cache_memory="64MiB", profile_cost_model=False,
             kv_store=str(store), kv_store_admit="always") as llm:  # as a prefill worker's engine writes
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))
        core = llm.engine.core
        core.flush_kv_store()
        lay = layout_of(core.runner.kv_caches)
        load = {"model_identity": core.model_identity,
                "kv_layout": [lay.dtype, lay.block_size, lay.num_layers, lay.num_kv_heads, lay.head_dim]}
    pool = WorkerPool()
    worker = pool.add("http://127.0.0.1:1", "prefill")
    worker.load, worker.alive = load, True  # the report the router hashes by
    client = ClusterEngineClient(pool, DeepInferPolicy(), None, 50000, RetentionPolicy(), RouterConfig(), 1024, store)

    def stored(prompt_ids: list[int], salt: str | None = None) -> int:
        hashes, block_size = client._block_hashes(prompt_ids, salt)
        return client._store_lookup(load, hashes) * block_size

    assert stored(prompt) == 64  # 4 full blocks of 70 tokens
    assert stored(prompt + [5] * 40) == 64  # a longer prompt: its stored prefix
    assert stored(prompt, "tenant-b") == 0  # another salt names other blocks
    assert stored([7] + prompt[1:]) == 0


def test_continued_request_keeps_penalties_and_stop_rules(tiny_models):
    """Penalties see the first token as generated output (not prompt), on the continuing engine too."""
    prompt = _prompt(11, 40)
    kw = dict(temperature=0.0, presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3, min_tokens=3)
    full = SamplingParams(max_tokens=16, **kw)
    with _llm(tiny_models["llama"]) as unified, _llm(tiny_models["llama"]) as other:
        ref = _run(unified, prompt, full).outputs[0]
        first = _run(unified, prompt, SamplingParams(max_tokens=1, **{**kw, "min_tokens": 1})).outputs[0]
        assert first.token_ids == ref.token_ids[:1]
        got = _run(other, prompt, full, output_prefix=first.token_ids).outputs[0]
        assert got.token_ids == ref.token_ids and got.text == ref.text and got.finish_reason == ref.finish_reason
        with pytest.raises(ValueError, match="prefix_logprobs"):
            other.engine.add_request(prompt, SamplingParams(max_tokens=4, logprobs=1), prompt_token_ids=prompt,
                                     output_prefix=[5])


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_streamed_export_ships_blocks_chunk_by_chunk_and_held_import_continues_identically(tiny_models, overlap):
    """`stream_kv`: outputs carry each chunk's newly computed prompt blocks before the first token exists;
    imported under a hold key as they come, they serve the continued request and are released after."""
    model = tiny_models["llama"]
    prompt = _prompt(21, 150)  # 9 full blocks + a 6-token tail; 32-token chunks -> 5 prefill steps
    full = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    chunked = dict(max_num_batched_tokens=32, scheduler="tokens", overlap_host_work=overlap)
    with _llm(model) as unified, LLM(str(model), dtype="float32", kv_cache_memory="64MiB", profile_cost_model=False,
                                     kv_store="none", **chunked) as prefill, _llm(model) as decode:
        ref = _run(unified, prompt, full).outputs[0]
        engine = prefill.engine
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                           prompt_token_ids=prompt, stream_kv=True)
        batches, first = [], None
        while engine.has_unfinished():
            for out in engine.step():
                if out.kv_blocks:
                    batches.append((out.outputs[0].token_ids[:], out.kv_blocks))
                if out.finished:
                    first = out.outputs[0].token_ids
        assert first == ref.token_ids[:1]
        assert len(batches) >= 4  # one batch per chunk that completed a block
        assert sum(not toks for toks, _ in batches) >= 3  # most arrived before the first token existed
        blocks = [b for _, bs in batches for b in bs]
        assert [h for h, _ in blocks] == prompt_block_hashes(decode.engine.core, prompt, None)  # in chain order
        for _, bs in batches:
            assert decode.engine.import_kv_blocks(bs, hold_key="t") == len(bs)
        assert decode.engine.stats()["kv_blocks_held_for_imports"] == 9
        out = _run(decode, prompt, full, output_prefix=first)
        assert out.outputs[0].token_ids == ref.token_ids
        assert out.num_cached_tokens == 9 * BS
        assert decode.engine.release_kv_blocks("t") == 9
        assert decode.engine.release_kv_blocks("t") == 0
        for llm in (unified, prefill, decode):
            _assert_all_free(llm)


@pytest.mark.parametrize("length", [30, 61])
def test_a_sliding_window_model_ships_its_window_and_decodes_exactly(tiny_models, hf_models, length):
    """Full + sliding layers (Qwen2, window 12): the payloads carry the full layer's blocks for every
    position and the sliding layers' where the sender still holds them (at least the window of the
    prompt's end), so the decode engine's lookup hits the whole prompt exactly (no replay) and continues
    as one engine would."""
    model = tiny_models["qwen2_swa"]
    prompt = _prompt(length, length)
    bs = 4
    full = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def make() -> LLM:
        return LLM(str(model), dtype="float32", kv_cache_memory="16MiB", block_size=bs, profile_cost_model=False,
                   kv_store="none")

    with make() as prefill, make() as decode:
        first = _run(prefill, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        blocks = export_blocks(prefill.engine.core, prompt, None)
        assert len(blocks) == length // bs
        hold: list = []  # (group, block) references, as a decode worker holds them until the request arrives
        assert import_blocks(decode.engine.core, blocks, hold) == len(blocks)
        assert sorted({g for g, _ in hold}) == [0, 1]
        out = _run(decode, prompt, full, output_prefix=first.outputs[0].token_ids)
        release_blocks(decode.engine.core, hold)
        assert out.num_cached_tokens == length // bs * bs and out.num_replayed_tokens == 0
        assert out.outputs[0].token_ids == hf_greedy(hf_models["qwen2_swa"], prompt, full.max_tokens)
        for llm in (prefill, decode):
            _assert_all_free(llm)
