"""Images through the real server, sent with the official SDKs: OpenAI Chat Completions (`image_url` parts, data:
and http URLs), Responses (`input_image`), Anthropic Messages (`image` blocks) and /tokenize, on a tiny random
Idefics3 (SmolVLM's architecture). Replies equal transformers' greedy continuation of the same prompt and
images; the prefix cache reuses an image's blocks for the same image only; bad images are 400s naming the field."""

from __future__ import annotations

import base64
import http.server
import io
import threading

import anthropic
import httpx
import openai
import pytest
import torch

from tests.models.vlm_tiny import png_data_url, random_image
from tests.server_utils import running_server

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(tiny_vlm, tmp_path_factory):
    log = tmp_path_factory.mktemp("srv") / "server.log"
    with running_server("--model", str(tiny_vlm), "--served-model-name", "m", "--dtype", "float32", "--kv-cache-memory", "64MiB",
                        "--max-model-len", "512", log=log) as base:
        yield base


def _expected(vlm_reference, question: str, images: list) -> tuple[int, str]:
    """(prompt tokens, reply text) of transformers' greedy continuation of the chat prompt with `images`."""
    model, processor = vlm_reference
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    enc = processor(text=text, images=[images], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    n = enc["input_ids"].shape[1]
    return n, processor.tokenizer.decode(out[0, n:], skip_special_tokens=True)


def _openai(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, url: str, question: str, **kw):
    return client.chat.completions.create(
        model="m", max_tokens=MAX_TOKENS, temperature=0, **kw,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": question}]}])


def test_chat_completions_with_images(server, vlm_reference):
    client = _openai(server)
    first, second = random_image(20, 40, 70), random_image(21, 40, 70)
    n, text = _expected(vlm_reference, "What is this?", [first])
    done = _chat(client, png_data_url(first), "What is this?")
    assert done.choices[0].message.content == text
    assert done.usage.prompt_tokens == n and done.usage.completion_tokens == MAX_TOKENS
    streamed = _chat(client, png_data_url(first), "What is this?", stream=True,
                     stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    # the same image again: every full block was cached; another image of the same size: only the blocks
    # before the image tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    other = _chat(client, png_data_url(second), "What is this?")
    assert other.choices[0].message.content == _expected(vlm_reference, "What is this?", [second])[1]
    assert other.usage.prompt_tokens_details.cached_tokens < 16


def test_two_images_and_an_http_url(server, vlm_reference):
    images = [random_image(22, 30, 20), random_image(23, 64, 48)]
    payload = io.BytesIO()
    images[1].save(payload, format="PNG")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(payload.getvalue())

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/cat.png"
        done = _openai(server).chat.completions.create(
            model="m", max_tokens=MAX_TOKENS, temperature=0,
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": png_data_url(images[0])}},
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "Compare them."}]}])
    finally:
        httpd.shutdown()
    n, text = _expected(vlm_reference, "Compare them.", images)
    assert done.choices[0].message.content == text and done.usage.prompt_tokens == n


def test_responses_and_anthropic_messages_with_images(server, vlm_reference):
    image = random_image(24, 50, 50)
    n, text = _expected(vlm_reference, "Describe it.", [image])
    url = png_data_url(image)
    resp = _openai(server).responses.create(
        model="m", max_output_tokens=MAX_TOKENS, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                            {"type": "input_text", "text": "Describe it."}]}])
    assert resp.output_text == text and resp.usage.input_tokens == n
    aclient = anthropic.Anthropic(base_url=server, api_key="x", max_retries=0, timeout=120)
    data = url.split(",", 1)[1]
    content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
               {"type": "text", "text": "Describe it."}]
    msg = aclient.messages.create(model="m", max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                                  messages=[{"role": "user", "content": content}])
    assert msg.content[0].text == text
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == n
    counted = aclient.messages.count_tokens(model="m", messages=[{"role": "user", "content": content}])
    assert counted.input_tokens == n
    r = httpx.post(f"{server}/tokenize", timeout=60, json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe it."}]}]})
    assert r.status_code == 200 and r.json()["count"] == n


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,@@@", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "cannot read the image"),
    ("ftp://example.com/a.png", "data: URL"),
    ("http://127.0.0.1:9/none.png", "cannot fetch the image"),
])
def test_bad_images_are_400s(server, url, message):
    with pytest.raises(openai.BadRequestError, match=message) as err:
        _chat(_openai(server), url, "What is this?")
    assert err.value.body["param"] == "messages"
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200


def test_more_images_than_the_limit_are_refused(server):
    """--max-images-per-request (8 by default), checked on the raw body before any image is read."""
    url = png_data_url(random_image(25, 8, 8))
    content = [{"type": "image_url", "image_url": {"url": url}}] * 9 + [{"type": "text", "text": "Hi"}]
    r = httpx.post(f"{server}/v1/chat/completions", timeout=60,
                   json={"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400 and "at most 8 images" in r.text and r.json()["error"]["param"] == "messages"
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": url.split(",")[1]}}]
    r = httpx.post(f"{server}/v1/messages", timeout=60, json={
        "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": blocks * 9}]})
    assert r.status_code == 400 and "at most 8 images" in r.text


def test_image_tokens_typed_as_text_are_refused(server):
    """A prompt that spells the image placeholder without an image: a 400, not a reply from its plain embedding."""
    r = httpx.post(f"{server}/v1/completions", timeout=60,
                   json={"model": "m", "prompt": "look: <image>", "max_tokens": 2})
    assert r.status_code == 400 and "image tokens but no images" in r.text


# ~25 s, a server of its own; Gemma 3's image path is tested offline (test_gemma3_vlm.py), the API layer above on Idefics3
@pytest.mark.slow
def test_gemma3_with_its_vision_tower_through_the_sdks(tiny_gemma3_vlm, gemma3_vlm_reference, tmp_path):
    """Gemma 3's image placeholders attend to each other both ways: a chat with an image, streamed and not, and an
    Anthropic `image` block, served, equal transformers' greedy continuation."""
    image = random_image(30, 50, 40)
    n, text = _expected(gemma3_vlm_reference, "What is this?", [image])
    with running_server("--model", str(tiny_gemma3_vlm), "--served-model-name", "m", "--dtype", "float32",
                        "--kv-cache-memory", "32MiB", "--max-model-len", "256", log=tmp_path / "server.log") as base:
        client = _openai(base)
        done = _chat(client, png_data_url(image), "What is this?")
        assert done.choices[0].message.content == text
        assert done.usage.prompt_tokens == n
        streamed = list(_chat(client, png_data_url(image), "What is this?", stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
        data = png_data_url(image).split(",", 1)[1]
        reply = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=120).messages.create(
            model="m", max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
                {"type": "text", "text": "What is this?"}]}])
        assert reply.content[0].text == text
        assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == n
