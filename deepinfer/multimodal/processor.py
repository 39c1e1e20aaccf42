"""From API content to engine inputs: images read from their URLs, chat messages with image parts, and the
model's own HF processor (transformers' `AutoProcessor`: tiling, resizing, normalising, and expanding each
image marker of the prompt text into the model's placeholder tokens) turning text + images into token ids
and `MultiModalInputs`.

Images come as `data:` URLs (base64), http(s) URLs (fetched with a size and time limit) or PIL images (the
offline `LLM`). A chat message's image part (OpenAI `image_url`, Responses `input_image`, Anthropic `image`
blocks are converted to the first by their API modules) becomes `{"type": "image"}` for the chat template,
which writes the model's image marker there.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from deepinfer.multimodal.inputs import MultiModalInputs

MAX_IMAGE_BYTES = 20 * 2**20  # an image URL's bytes, decoded (OpenAI's limit per image)
MAX_IMAGE_PIXELS = 64 * 2**20  # decoded width x height: a small file can still claim a huge canvas
FETCH_TIMEOUT_S = 10.0


class ImageError(ValueError):
    """An image that cannot be read (bad URL, bad encoding, not an image, too large)."""


def load_image(source: Any, allowed_domains: Sequence[str] = ()):
    """A PIL image (RGB) from a PIL image, raw bytes, a `data:` URL or an http(s) URL (of a host in
    `allowed_domains` or a subdomain of one, when that is not empty)."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if isinstance(source, bytes | bytearray):
        data = bytes(source)
    elif isinstance(source, str) and source.startswith("data:"):
        data = _data_url_bytes(source)
    elif isinstance(source, str) and source.startswith(("http://", "https://")):
        _check_host(source, allowed_domains)
        data = _fetch(source)
    else:
        raise ImageError("an image must be a data: URL (base64) or an http(s) URL")
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"the image has {len(data)} bytes, more than {MAX_IMAGE_BYTES}")
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise ImageError(f"the image is {image.width} x {image.height} pixels, more than {MAX_IMAGE_PIXELS}")
        return image.convert("RGB")
    except ImageError:
        raise
    except Exception as e:  # PIL's UnidentifiedImageError, truncated files, decompression bombs
        raise ImageError(f"cannot read the image: {e}") from e


def _check_host(url: str, allowed_domains: Sequence[str]) -> None:
    if not allowed_domains:
        return
    host = (urlsplit(url).hostname or "").lower().rstrip(".")
    if not any(host == d or host.endswith("." + d) for d in (d.lower().strip(".") for d in allowed_domains)):
        raise ImageError(f"image URLs from {host or 'this URL'} are not fetched (--allowed-media-domains)")


def _data_url_bytes(url: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or ";base64" not in head:
        raise ImageError("an image data: URL must be base64 (data:image/png;base64,...)")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageError(f"the image is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"the image data: URL is not valid base64: {e}") from e


def _fetch(url: str) -> bytes:
    import httpx

    try:
        with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_S, follow_redirects=True) as r:
            if r.status_code != 200:
                raise ImageError(f"fetching the image gave HTTP {r.status_code}")
            chunks, size = [], 0
            for chunk in r.iter_bytes():
                size += len(chunk)
                if size > MAX_IMAGE_BYTES:
                    raise ImageError(f"the image at the URL is larger than {MAX_IMAGE_BYTES} bytes")
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError as e:
        raise ImageError(f"cannot fetch the image: {e}") from e


def split_images(messages: list[dict]) -> tuple[list[dict], list[Any]]:
    """Chat messages whose content lists may hold image parts -> (the messages for the chat template, each
    image part as `{"type": "image"}`, and the image sources in order: URLs or PIL images). Text parts
    (`text`, `input_text`, `output_text`) stay as they are."""
    out, images = [], []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list) or not any(_image_source(p) is not None for p in content):
            out.append(m)
            continue
        parts = []
        for part in content:
            source = _image_source(part)
            if source is None:
                parts.append(part)
            else:
                images.append(source)
                parts.append({"type": "image"})
        out.append({**m, "content": parts})
    return out, images


def _image_source(part: Any) -> Any:
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if kind == "image_url":
        value = part.get("image_url")
        return value.get("url") if isinstance(value, dict) else value
    if kind == "image_pil":  # vLLM's offline content part
        return part.get("image_pil")
    return None


class MultiModalProcessor:
    """A vision-language model's HF processor: prompt text with one image marker per image, and the images
    -> (prompt token ids, MultiModalInputs)."""

    def __init__(self, directory: Path, image_token_id: int, tokens_per_tile: int) -> None:
        from transformers import AutoProcessor

        self.hf = AutoProcessor.from_pretrained(str(directory))
        self.image_token_id = image_token_id
        self.tokens_per_tile = tokens_per_tile
        self.marker: str = getattr(self.hf, "image_token", "<image>")

    def __call__(self, text: str, images: list[Any], add_special_tokens: bool = False,
                 allowed_domains: Sequence[str] = ()) -> tuple[list[int], MultiModalInputs | None]:
        """`allowed_domains`: the hosts http(s) image URLs may name (`load_image`; empty: any)."""
        loaded = [load_image(i, allowed_domains) for i in images]
        markers = text.count(self.marker)
        if markers != len(loaded):
            raise ImageError(f"the prompt has {markers} image markers ({self.marker}) for {len(loaded)} images")
        if not loaded:
            return list(self.hf.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]), None
        enc = self.hf(text=text, images=[loaded], return_tensors="pt", add_special_tokens=add_special_tokens)
        ids = enc["input_ids"][0].tolist()
        # one prompt's tiles: Idefics3 batches them per prompt [1, tiles, C, H, W], Gemma 3 flat [tiles, C, H, W]
        pixels = enc["pixel_values"]
        pixels = (pixels[0] if pixels.dim() == 5 else pixels).float()
        mask = enc.get("pixel_attention_mask")
        mask = None if mask is None or bool(mask.all()) else (mask[0] if mask.dim() == 4 else mask).bool()
        positions = tuple(i for i, t in enumerate(ids) if t == self.image_token_id)
        return ids, MultiModalInputs(pixels, mask, positions, self.tokens_per_tile, len(loaded))
