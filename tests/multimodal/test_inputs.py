"""MultiModalInputs and the image loader on their own: block keys, spans, the wire and pipe forms, the encoded-tile
cache, and the limits on what an image may be."""

from __future__ import annotations

import base64
import io
import pickle

import pytest
import torch

from deepinfer.kvcache.host import ByteLRU
from deepinfer.multimodal import processor as images
from deepinfer.multimodal.inputs import EncodedTiles, MultiModalInputs
from deepinfer.multimodal.processor import ImageError, load_image, split_images


def _inputs(tiles: int = 3, per: int = 4, start: int = 10) -> MultiModalInputs:
    torch.manual_seed(0)
    # tile t's placeholders at start + 6t .. start + 6t + per - 1 (two text tokens between tiles)
    positions = tuple(start + 6 * t + j for t in range(tiles) for j in range(per))
    return MultiModalInputs(torch.randn(tiles, 3, 8, 8), None, positions, per)


def test_block_keys_name_the_block_each_tile_starts_in():
    mm = _inputs()  # tiles start at 10, 16, 22
    keys = mm.block_keys(16)
    assert keys == {0: mm.tile_hashes[0], 1: mm.tile_hashes[1] + mm.tile_hashes[2]}
    assert len(set(mm.tile_hashes)) == 3
    same = MultiModalInputs(mm.pixel_values.clone(), None, mm.positions, 4)
    assert same.tile_hashes == mm.tile_hashes  # a digest of the pixels, not of the object
    other = mm.pixel_values.clone()
    other[1, 0, 0, 0] += 1e-3
    assert MultiModalInputs(other, None, mm.positions, 4).tile_hashes[1] != mm.tile_hashes[1]
    assert mm.span(0, 12) == (0, 2) and mm.span(12, 17) == (2, 5) and mm.span(40, 50) == (12, 12)


def test_tiles_to_encode_from_a_prompt_position():
    mm = _inputs()  # tiles at 10-13, 16-19, 22-25
    assert [mm.tiles_to_encode(p) for p in (0, 13, 14, 20, 26)] == [3, 3, 2, 1, 0]  # 13: tile 0 is still needed
    assert mm.tiles_to_encode(0, {mm.tile_hashes[1]}, [mm.tile_hashes[2]]) == 1  # found elsewhere
    assert mm.encoded(torch.zeros(3, 4, 2)).tiles_to_encode(0) == 0  # an encode worker did them


def test_wire_and_pipe_forms_keep_everything():
    mm = _inputs()
    mask = torch.ones(3, 8, 8, dtype=torch.bool)
    mask[2, 4:] = False
    masked = MultiModalInputs(mm.pixel_values, mask, mm.positions, 4, num_images=2)
    for copy in (MultiModalInputs.from_wire(masked.to_wire()), pickle.loads(pickle.dumps(masked))):
        assert torch.equal(copy.pixel_values, masked.pixel_values) and torch.equal(copy.pixel_mask, mask)
        assert copy.positions == masked.positions and copy.tile_hashes == masked.tile_hashes
        assert copy.num_images == 2
    encoded = masked.encoded(torch.randn(3, 4, 5, dtype=torch.bfloat16))
    back = MultiModalInputs.from_wire(encoded.to_wire())
    assert back.pixel_values is None and back.tile_hashes == masked.tile_hashes
    assert torch.equal(back.embeddings, encoded.embeddings.float())  # bf16 widens exactly
    with pytest.raises(ValueError, match="embeddings of shape"):
        masked.encoded(torch.randn(3, 5, 5))


@pytest.mark.parametrize("damage", [
    lambda w: w.pop("positions"),
    lambda w: w["pixel_values"].update(data="@@"),
    lambda w: w["pixel_values"].update(shape=[5, 3, 8, 8]),
    lambda w: w["pixel_values"].update(dtype="object"),
    lambda w: w.update(tile_hashes=["zz"]),
    lambda w: w.update(tile_hashes=[]) or w.pop("pixel_values"),
])
def test_a_malformed_wire_form_is_a_value_error(damage):
    wire = _inputs().to_wire()
    damage(wire)
    with pytest.raises(ValueError):
        MultiModalInputs.from_wire(wire)


def test_encoded_tiles_encode_once_and_drop_what_was_passed():
    mm = _inputs()
    calls = []

    def embed(pixels):
        return pixels.reshape(pixels.shape[0], -1)[:, :20].reshape(pixels.shape[0], 4, 5)

    def encode(pixels, mask):
        calls.append(pixels.shape[0])
        return embed(pixels)

    tiles = EncodedTiles(mm)
    a = tiles.rows(0, 6, encode)  # tile 0 whole, tile 1 half: both encoded in one call, tile 0 dropped
    assert calls == [2] and set(tiles.tiles) == {1} and a.shape == (6, 5)
    b = tiles.rows(6, 12, encode)  # tile 1's rest from the cache, tile 2 encoded
    assert calls == [2, 1] and not tiles.tiles
    whole = embed(mm.pixel_values).reshape(12, 5)
    assert torch.equal(torch.cat([a, b]), whole)
    pre = EncodedTiles(mm.encoded(embed(mm.pixel_values)))  # an encode worker's embeddings: nothing to encode
    assert torch.equal(pre.rows(3, 9, encode), whole[3:9]) and calls == [2, 1]


def _png(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


def test_image_limits(monkeypatch):
    url = "data:image/png;base64," + base64.b64encode(_png(40, 30)).decode()
    assert load_image(url).size == (40, 30)
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 1000)  # a small file can claim a large canvas
    with pytest.raises(ImageError, match="pixels"):
        load_image(url)
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 100)
    with pytest.raises(ImageError, match="larger than"):
        load_image(url)
    with pytest.raises(ImageError, match="base64"):
        load_image("data:image/png,rawbytes")
    with pytest.raises(ImageError, match="data: URL"):
        load_image("file:///etc/passwd")


def test_split_images_keeps_text_messages_and_orders_images():
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:a"}},
                                             {"type": "text", "text": "and"},
                                             {"type": "image_url", "image_url": "data:b"}]}]
    out, found = split_images(messages)
    assert found == ["data:a", "data:b"]
    assert out[0] is messages[0]
    assert out[1]["content"] == [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]


def test_encoded_tiles_go_through_a_shared_cache():
    """A second request with the same pixels takes the first's encodings from the cache (the host tier's LRU map,
    keyed by tile digest); a cache too small for a tile keeps none."""
    mm, calls = _inputs(), []

    def encode(pixels, mask):
        calls.append(pixels.shape[0])
        return pixels.reshape(pixels.shape[0], -1)[:, :20].reshape(pixels.shape[0], 4, 5)

    cache = ByteLRU(3 * 4 * 5 * 4)  # three float32 tiles of 4 x 5
    first = EncodedTiles(mm).rows(0, 12, encode, cache)
    again = EncodedTiles(MultiModalInputs(mm.pixel_values.clone(), None, mm.positions, 4)).rows(0, 12, encode, cache)
    assert calls == [3] and torch.equal(first, again) and (cache.hits, cache.nbytes) == (3, 240)
    too_small = ByteLRU(0)
    EncodedTiles(mm).rows(0, 12, encode, too_small)
    assert calls == [3, 3] and len(too_small) == 0


def test_allowed_media_domains_bound_what_is_fetched():
    """--allowed-media-domains: a URL of another host is refused before any connection; the listed hosts and their
    subdomains are fetched (here a local server); data: URLs are always taken."""
    import http.server
    import threading

    from deepinfer.config import LimitsConfig

    payload = _png(12, 10)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/x.png"
    try:
        assert load_image(url, ("127.0.0.1",)).size == (12, 10)
        assert load_image(url).size == (12, 10)  # no list: any host
        with pytest.raises(ImageError, match="127.0.0.1 are not fetched"):
            load_image(url, ("example.com",))
        with pytest.raises(ImageError, match="evil-example.com"):
            load_image("http://evil-example.com/a.png", ("example.com",))  # a suffix is not a subdomain
        data = "data:image/png;base64," + base64.b64encode(payload).decode()
        assert load_image(data, ("example.com",)).size == (12, 10)
    finally:
        httpd.shutdown()
    assert LimitsConfig(allowed_media_domains='["example.com", "cdn.example.org"]').allowed_media_domains == (
        "example.com", "cdn.example.org")
    assert LimitsConfig().allowed_media_domains == ()
