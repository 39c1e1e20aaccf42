"""The engine's side of LoRA: which adapters stay loaded (slots, eviction, slots opened past --max-cpu-loras while
every one is busy, unloading while a request runs), `--max-loras` as a limit on the running requests' adapters,
the KV store naming an adapter's blocks apart across a restart, and the flags' parsing. Outputs are checked against
peft (tests/lora/adapters.py) wherever an adapter ran."""

from __future__ import annotations

import json
import random

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineConfig, LoRAConfig, parse_lora_modules
from deepinfer.lora import LoRARequest, read_adapter
from tests.conftest import hf_greedy
from tests.lora.adapters import ALL_PROJECTIONS, peft_model, write_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


@pytest.fixture(scope="module")
def three(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora3")
    base = tiny_models["llama"]
    return {name: write_adapter(base, root / name, ALL_PROJECTIONS[i:i + 4], rank=4, alpha=8, seed=10 + i)
            for i, name in enumerate(("a", "b", "c"))}


def _llm(tiny_models, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "64MiB")
    return LLM(str(tiny_models["llama"]), dtype="float32", profile_cost_model=False, enable_lora=True, **kw)


def test_slots_evict_the_least_recently_used_idle_adapter(tiny_models, three):
    llm = _llm(tiny_models, lora_modules={"a": str(three["a"])}, max_cpu_loras=1)
    manager = llm.engine.core.lora
    p = _prompt(1, 20)
    out = {n: llm.generate([p], GREEDY, lora_request=LoRARequest(n, 0, str(three[n])))[0].outputs[0].token_ids
           for n in ("a", "b", "a", "c")}
    # one slot: each adapter replaced the idle one before it, and came back from disk when named again
    assert manager.names() == ["a", "b", "c"] and len(manager._slots) == 1 and "c" in manager._slots
    for n in ("a", "b", "c"):
        assert out[n] == hf_greedy(peft_model(tiny_models["llama"], three[n]), p, 10), n


def test_busy_slots_open_another_and_give_it_up(tiny_models, three):
    llm = _llm(tiny_models, lora_modules={"a": str(three["a"])}, max_cpu_loras=1)
    engine, manager = llm.engine, llm.engine.core.lora
    prompts = [_prompt(2, 12), _prompt(3, 30)]
    # a waiting request holds "a" in the only slot; "b" must not evict it: it gets a slot of its own
    engine.add_request(prompts[0], GREEDY, request_id="ra", lora_request="a")
    engine.add_request(prompts[1], GREEDY, request_id="rb", lora_request=LoRARequest("b", 0, str(three["b"])))
    assert sorted(a.slot for a in manager._slots.values()) == [0, 1]
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o.outputs[0].token_ids
    assert final["ra"] == hf_greedy(peft_model(tiny_models["llama"], three["a"]), prompts[0], 10)
    assert final["rb"] == hf_greedy(peft_model(tiny_models["llama"], three["b"]), prompts[1], 10)
    # the next load gives the extra slot up (its adapter is idle now) and takes slot 0
    llm.generate([prompts[0]], GREEDY, lora_request=LoRARequest("c", 0, str(three["c"])))
    assert [a.slot for a in manager._slots.values()] == [0]


def test_unloading_an_adapter_a_request_runs_with(tiny_models, three):
    llm = _llm(tiny_models, lora_modules={"a": str(three["a"])})
    engine = llm.engine
    p = _prompt(4, 25)
    engine.add_request(p, GREEDY, request_id="r", lora_request="a")
    engine.step()
    engine.unload_lora_adapter("a")
    assert engine.lora_adapter_names() == []
    with pytest.raises(ValueError, match="no LoRA adapter named 'a'"):
        engine.add_request(p, GREEDY, lora_request="a")
    final = None
    while engine.has_unfinished():
        for o in engine.step():
            final = o if o.finished else final
    assert final.outputs[0].token_ids == hf_greedy(peft_model(tiny_models["llama"], three["a"]), p, 10)
    # the name can be served again, from another directory
    engine.load_lora_adapter("a", str(three["b"]))
    again = llm.generate([p], GREEDY, lora_request="a")[0].outputs[0].token_ids
    assert again == hf_greedy(peft_model(tiny_models["llama"], three["b"]), p, 10)
    assert not llm.engine.core.lora.in_use()


def test_max_loras_bounds_the_running_requests_adapters(tiny_models, three):
    llm = _llm(tiny_models, lora_modules={n: str(p) for n, p in three.items()}, max_loras=2)
    scheduler = llm.engine.core.scheduler
    seen: list[int] = []
    schedule = scheduler.schedule

    def watched():
        out = schedule()
        seen.append(len({r.lora.slot for r in scheduler.running if r.lora is not None}))
        return out

    scheduler.schedule = watched
    which = ["a", "b", "c", None, "a", "c", "b", None]
    prompts = [_prompt(10 + i, 8 + 5 * i) for i in range(len(which))]
    outs = llm.generate(prompts, GREEDY, lora_request=[w and LoRARequest(w) for w in which])
    assert max(seen) == 2  # two adapters ran together, never three
    refs = {w: peft_model(tiny_models["llama"], three[w]) for w in three}
    for p, w, o in zip(prompts, which, outs, strict=True):
        if w is not None:
            assert o.outputs[0].token_ids == hf_greedy(refs[w], p, 10)


def test_the_store_keeps_an_adapters_blocks_apart(tiny_models, three, tmp_path):
    """Across a restart, the adapter's prompt is served from the store to the adapter and not to the base model."""
    p = _prompt(20, 70)
    kw = {"kv_store": str(tmp_path), "kv_store_admit": "always", "lora_modules": {"a": str(three["a"])}}
    with _llm(tiny_models, **kw) as llm:
        first = llm.generate([p], GREEDY, lora_request="a")[0]
        assert llm.engine.core.flush_kv_store()
    with _llm(tiny_models, **kw) as llm:
        base = llm.generate([p], GREEDY)[0]
        assert base.num_cached_tokens == 0
        again = llm.generate([p], GREEDY, lora_request="a")[0]
        assert again.num_cached_tokens_by_tier["store"] >= 64
        assert again.outputs[0].token_ids == first.outputs[0].token_ids != base.outputs[0].token_ids


def test_adapters_it_cannot_apply_are_refused(tiny_models, tmp_path):
    base = tiny_models["llama"]
    llm = _llm(tiny_models)
    for targets, match in ((["embed_tokens"], "not a LoRA A or B matrix"),
                           # tied embeddings: peft also saves the whole output matrix, refused by its name
                           (["lm_head", "q_proj"], "lm_head.base_layer.weight' is not a LoRA A or B matrix")):
        path = write_adapter(base, tmp_path / targets[0], targets, rank=4, alpha=4, seed=1)
        with pytest.raises(ValueError, match=match):
            llm.generate(["Hi"], GREEDY, lora_request=LoRARequest(targets[0], 0, str(path)))
    assert llm.engine.lora_adapter_names() == [] and not llm.engine.core.lora.layers.sites  # nothing half loaded
    path = write_adapter(base, tmp_path / "dora", ["q_proj"], rank=4, alpha=4, seed=1)
    cfg = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA is not supported"):
        read_adapter("d", path, 16, torch.float32)


def test_flags_parse_as_vllm_takes_them():
    assert parse_lora_modules(("a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}')) == (("a", "/x"),
                                                                                                ("b", "/y"))
    assert parse_lora_modules({"a": "/x"}) == (("a", "/x"),)
    for bad, match in ((("a",), "expected name=path"), (("a=/x", "a=/y"), "twice"), (("=/x",), "empty name"),
                       (("{nope",), "not valid JSON")):
        with pytest.raises(ValueError, match=match):
            parse_lora_modules(bad)
    with pytest.raises(ValueError, match="needs --enable-lora"):
        LoRAConfig(lora_modules=("a=/x",))
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="deterministic"):
        EngineConfig.from_kwargs(enable_lora=True, deterministic=True)
    assert LoRAConfig(enable_lora=True, lora_modules=("a=/x", "b=/y", "c=/z")).slots == 3
