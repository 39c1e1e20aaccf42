"""LoRA adapters through a real local cluster (`deepinfer serve --prefill-workers 1 --decode-workers 1
--enable-lora --lora-modules ...`: a router and two worker processes) on a tiny float32 Llama, through the official
`openai` SDK: the router lists the workers' adapters, a request naming one equals peft's model with it (its prompt
prefilled on one worker, its KV moved under the adapter's block names and decoded on the other), the base model's
requests beside it are unchanged, and the router refuses to load adapters itself (they are the workers')."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.conftest import hf_greedy
from tests.lora.adapters import ALL_PROJECTIONS, peft_model, write_adapter
from tests.server_utils import INTERNAL, cluster_workers, metric, running_cluster

FLAGS = ("--dtype", "float32", "--kv-cache-memory", "64MiB", "--no-profile-cost-model", "--max-model-len", "1024")
PROMPT = "List the first ten prime numbers, then explain why each of them is prime in one short sentence. " * 2


@pytest.fixture(scope="module")
def adapter(tiny_models, tmp_path_factory):
    return write_adapter(tiny_models["llama"], tmp_path_factory.mktemp("lora") / "primes", ALL_PROJECTIONS, rank=8,
                         alpha=16, seed=7)


@pytest.mark.slow  # ~30 s (a router and two workers): the default suite's LoRA coverage is one server's
def test_a_cluster_serves_its_workers_adapters(tiny_models, adapter, tmp_path):
    model = tiny_models["llama"]
    tok = AutoTokenizer.from_pretrained(str(model))
    ids = list(tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False))
    want = hf_greedy(peft_model(model, adapter), ids, 12)
    with running_cluster("--model", str(model), *FLAGS, "--prefill-workers", "1", "--decode-workers", "1",
                         "--enable-lora", "--lora-modules", f"primes={adapter}", log=tmp_path / "cluster.log") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        cards = {m.id: m.model_dump() for m in client.models.list().data}
        assert cards["primes"]["parent"] != "primes" and cards["primes"]["root"] == str(adapter)
        for name in ("primes", next(iter(cards))):
            r = client.completions.create(model=name, prompt=ids, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 12
            if name == "primes":
                assert r.choices[0].text == tok.decode(want, skip_special_tokens=True) and r.model == "primes"
            else:
                assert r.choices[0].text != tok.decode(want, skip_special_tokens=True)  # the base model's own
        # the adapter's prompt KV went from the prefill to the decode worker and was found there
        workers = cluster_workers(base)
        sent = sum(httpx.get(f"{w['url']}/internal/load", headers=INTERNAL, timeout=10).json()["blocks_sent"]
                   for w in workers if w["role"] == "prefill")
        assert sent > 0
        assert sum(metric(w["url"], "deepinfer:prefix_cache_hits_total") for w in workers
                   if w["role"] == "decode") >= sent * 16
        r = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapter)}, timeout=30)
        assert r.status_code == 400 and "--lora-modules" in r.json()["error"]["message"]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt=ids, max_tokens=2)
