"""`deepinfer serve --ray ADDRESS`: workers placed on a real local Ray cluster (`ray start --head` on
127.0.0.1, started and stopped by the test), prefill and decode workers, and encode workers for a
vision-language model. Slow: a Ray head plus two or three workers on a 2-core machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

import httpx
import psutil
import pytest

from deepinfer import LLM, SamplingParams
from tests.server_utils import INTERNAL, free_port, running_server

ray = pytest.importorskip("ray")


@pytest.fixture
def ray_head(tmp_path):
    port = free_port()
    # a short temp dir: Ray's unix socket paths must fit in 107 bytes, pytest's tmp_path may not
    temp = tempfile.mkdtemp(prefix="dray", dir="/tmp")
    log = open(tmp_path / "ray.log", "w")  # noqa: SIM115 - closed below
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    # --block: the head's processes live and die with this one process, so the test stops only its own
    proc = subprocess.Popen(["ray", "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                             "--num-cpus=4", "--include-dashboard=false", "--disable-usage-stats", "--block",
                             f"--temp-dir={temp}"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while subprocess.run(["ray", "status", f"--address=127.0.0.1:{port}"], env=env, capture_output=True,
                             timeout=60).returncode != 0:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "ray.log").read_text()[-3000:]
            time.sleep(1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_serve_places_workers_on_ray_and_answers_like_one_engine(ray_head, tiny_models, tmp_path):
    model = str(tiny_models["llama"])
    prompt = list(range(100, 160))
    with LLM(model, dtype="float32", kv_cache_memory="64MiB", profile_cost_model=False, kv_store="none") as llm:
        ref = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    with running_server("--model", model, "--dtype", "float32", "--kv-cache-memory", "64MiB",
                        "--no-profile-cost-model", "--ray", ray_head, "--prefill-workers", "1",
                        "--decode-workers", "1", log=tmp_path / "serve.log", timeout=300) as base:
        r = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 10, "temperature": 0,
                                                       "ignore_eos": True}, timeout=120)
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == ref.outputs[0].text
        workers = httpx.get(f"{base}/internal/workers", headers=INTERNAL, timeout=10).json()["workers"]
        assert sorted(w["role"] for w in workers) == ["decode", "prefill"] and all(w["alive"] for w in workers)
        pids = [w["load"]["pid"] for w in workers]
    # stopping the router stops the workers Ray placed
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, "Ray workers outlived the router"
        time.sleep(0.5)


@pytest.mark.slow
def test_ray_places_encode_workers_and_gemma3_images_go_through_them(ray_head, tiny_gemma3_vlm, gemma3_vlm_reference,
                                                                      tmp_path):
    """`--encode-workers` with `--ray`: the encode worker is an actor's process too; a Gemma 3 chat with an image
    (its placeholders attend both ways) is encoded there, prefilled and decoded by the other two, and equals
    transformers' greedy reply."""
    import openai
    import torch

    from tests.models.vlm_tiny import png_data_url, random_image

    model, processor = gemma3_vlm_reference
    image = random_image(40, 50, 60)
    content = [{"type": "image"}, {"type": "text", "text": "What is this?"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    enc = processor(text=text, images=[[image]], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected = processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    with running_server("--model", str(tiny_gemma3_vlm), "--served-model-name", "m", "--dtype", "float32",
                        "--kv-cache-memory", "64MiB", "--no-profile-cost-model", "--max-model-len", "256",
                        "--ray", ray_head, "--prefill-workers", "1", "--decode-workers", "1", "--encode-workers", "1",
                        log=tmp_path / "serve.log", timeout=300) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="m", max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(image)}},
                                                   {"type": "text", "text": "What is this?"}]}])
        assert reply.choices[0].message.content == expected
        workers = httpx.get(f"{base}/internal/workers", headers=INTERNAL, timeout=10).json()["workers"]
        assert sorted(w["role"] for w in workers) == ["decode", "encode", "prefill"]
        encoder = next(w for w in workers if w["role"] == "encode")
        deadline = time.monotonic() + 30  # the load it reports follows its own loop
        while httpx.get(f"{encoder['url']}/internal/load", headers=INTERNAL, timeout=10).json()[
                "encoded_tiles"] < 1:
            assert time.monotonic() < deadline, "the encode worker on Ray never encoded the image"
            time.sleep(0.2)
