"""Images through a real local cluster (router, encode, prefill and decode worker processes) on a tiny random
Idefics3: the router tokenizes with the model's processor, an encode worker runs the vision tower, the prefill and
decode workers take its embeddings; replies equal transformers' greedy continuation. Without encode workers (or
once the only one is dead) the prefill and decode workers encode the tiles themselves, with the same replies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch

from tests.models.vlm_tiny import png_data_url, random_image
from tests.server_utils import INTERNAL, running_cluster
from tests.server_utils import cluster_workers as _workers

MAX_TOKENS = 8
FLAGS = ("--served-model-name", "m", "--dtype", "float32", "--kv-cache-memory", "64MiB", "--no-profile-cost-model",
         "--max-model-len", "512", "--health-interval", "1")


def _expected(vlm_reference, question: str, image) -> str:
    model, processor = vlm_reference
    content = [{"type": "image"}, {"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    enc = processor(text=text, images=[[image]], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def _ask(base: str, image, question: str, **kw) -> str:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model="m", max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}, **kw,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(image)}},
                                               {"type": "text", "text": question}]}])
    if kw.get("stream"):
        return "".join(c.choices[0].delta.content or "" for c in r if c.choices)
    return r.choices[0].message.content


def _parameters(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _router_state(base: str) -> dict:
    return httpx.get(f"{base}/internal/workers", headers=INTERNAL, timeout=10).json()


def test_encode_prefill_and_decode_workers(tiny_vlm, vlm_reference, tmp_path):
    with running_cluster("--model", str(tiny_vlm), *FLAGS, "--prefill-workers", "1", "--decode-workers", "1",
                         "--encode-workers", "1", log=tmp_path / "cluster.log") as base:
        images = [random_image(30, 40, 70), random_image(31, 50, 50)]
        assert _ask(base, images[0], "What is this?") == _expected(vlm_reference, "What is this?", images[0])
        assert _ask(base, images[1], "And this?", stream=True) == _expected(vlm_reference, "And this?", images[1])
        encoder = next(w for w in _workers(base) if w["role"] == "encode")
        deadline = time.monotonic() + 30  # the worker's stats snapshot follows its engine's loop
        while (load := httpx.get(f"{encoder['url']}/internal/load", headers=INTERNAL, timeout=10).json())[
                "encoded_tiles"] < 10 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert load["encoded_tiles"] == 10  # 5 tiles an image (2 x 2 and the whole image), both here
        assert load["tile_seconds"] > 0  # timed as it encoded (this cluster skips the start-up profile)
        # the tower and connector alone, none of the text model
        hf = vlm_reference[0].model
        assert load["parameters"] == _parameters(hf.vision_model) + _parameters(hf.connector)
        url = encoder["url"]
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'deepinfer:encode_worker_tiles_total{model_name="m"} 10.0' in metrics
        for body in ({}, {"multi_modal": {"positions": [1]}}, {"multi_modal": "x"}):
            r = httpx.post(f"{url}/internal/encode", json=body, headers=INTERNAL, timeout=10)
            assert r.status_code == 400 and r.json()["error"]["param"] == "multi_modal"
        assert httpx.post(f"{url}/internal/encode", json={}, timeout=10).status_code == 401  # no cluster token
        # the only encode worker dies: the prefill and decode workers encode, and the reply is the same (the
        # router learns of the death from the failed call, a fallback, or from its poll first: no encoder left)
        os.kill(load["pid"], signal.SIGKILL)
        assert _ask(base, images[0], "What is this?") == _expected(vlm_reference, "What is this?", images[0])
        state = _router_state(base)
        assert state["failed_requests"] == 0
        assert not next(w for w in state["workers"] if w["role"] == "encode")["alive"]
        # the prefill worker's share of the tower counts in the routing estimate only once it does the encoding
        routes = httpx.get(f"{base}/internal/routes", headers=INTERNAL, timeout=10).json()["routes"]
        assert [r["prefill_tiles"] for r in routes] == [0, 0, 5]


# ~9 s, a process that exits; the registry's refusal is tested in the default suite (test_idefics3.py)
@pytest.mark.slow
def test_an_encode_worker_refuses_a_text_model(tiny_models):
    done = subprocess.run([sys.executable, "-m", "deepinfer.cli", "serve", "--role", "encode", "--model",
                           str(tiny_models["llama"]), "--port", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "not a vision-language model" in done.stderr


def test_gemma3_images_through_prefill_and_decode_workers(tiny_gemma3_vlm, gemma3_vlm_reference, tmp_path):
    """Gemma 3, whose image tokens attend to each other both ways, through a router and a prefill and a decode
    worker (the prefill worker encodes): replies equal transformers'. The second request repeats the first's image
    with another question: the prefill worker's cached prefix ends inside the image, so its chunk starts there."""
    with running_cluster("--model", str(tiny_gemma3_vlm), *FLAGS, "--prefill-workers", "1",
                         "--decode-workers", "1", log=tmp_path / "cluster.log") as base:
        image = random_image(32, 40, 60)
        assert _ask(base, image, "What is this?", stream=True) == \
            _expected(gemma3_vlm_reference, "What is this?", image)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        again = client.chat.completions.create(
            model="m", max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(image)}},
                                                   {"type": "text", "text": "And its colours?"}]}])
        assert again.choices[0].message.content == _expected(gemma3_vlm_reference, "And its colours?", image)
        # the prompts part just after the image, in the block that holds the image's end: the hit is the
        # blocks before it, and ends inside the image
        model, processor = gemma3_vlm_reference
        content = [{"type": "image"}, {"type": "text", "text": "And its colours?"}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        ids = processor(text=text, images=[[image]], add_special_tokens=False)["input_ids"][0]
        placeholders = [i for i, t in enumerate(ids) if t == model.config.image_token_id]
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert placeholders[0] < cached <= placeholders[-1], (cached, placeholders)
        assert _router_state(base)["failed_requests"] == 0
