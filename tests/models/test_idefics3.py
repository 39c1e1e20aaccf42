"""Images in prompts: a tiny random Idefics3 (SmolVLM's architecture) token-identical to transformers' model for
greedy decoding, through batching, chunked prefill across an image, preemption and the prefix cache (whose block
names must tell two images apart); the vision tower alone on tiles with padding; bad image inputs refused."""

from __future__ import annotations

import time

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.multimodal.processor import ImageError
from tests.models.vlm_tiny import TOKENS_PER_TILE, load_vision_half, png_data_url, random_image

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _chat_text(processor, images: int, question: str) -> str:
    content = [{"type": "image"}] * images + [{"type": "text", "text": question}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def _hf(vlm_reference, text: str, images: list, max_new_tokens: int = 10) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy continuation) from transformers."""
    model, processor = vlm_reference
    enc = processor(text=text, images=[images] if images else None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    n = enc["input_ids"].shape[1]
    return enc["input_ids"][0].tolist(), out[0, n:].tolist()


def _cases(vlm_reference) -> list[tuple[str, list]]:
    _, processor = vlm_reference
    return [
        (_chat_text(processor, 1, "What is in this picture?"), [random_image(0, 40, 70)]),
        (_chat_text(processor, 1, "Describe it."), [random_image(1, 50, 30)]),
        (_chat_text(processor, 2, "Compare the two."), [random_image(2, 20, 30), random_image(3, 64, 64)]),
        (_chat_text(processor, 0, "No picture this time."), []),
    ]


def _prompt(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}


def _assert_all_free(llm: LLM) -> None:
    pool = llm.engine.core.kv.pool
    assert pool.num_free == pool.num_blocks
    assert not llm.engine.core.kv.block_tables


def test_greedy_matches_transformers_in_one_batch(tiny_vlm, vlm_reference):
    cases = _cases(vlm_reference)
    llm = LLM(str(tiny_vlm), dtype="float32", kv_cache_memory="64MiB")
    outs = llm.generate([_prompt(t, i) for t, i in cases], GREEDY)
    for (text, images), out in zip(cases, outs, strict=True):
        ids, expected = _hf(vlm_reference, text, images)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == expected
    # each image is resized to 64 pixels on its longest side: 2 x 2 tiles and the whole image, 5 tiles an image
    assert outs[2].prompt_token_ids.count(llm.engine.core.runner.model.image_token_id) == 10 * TOKENS_PER_TILE
    _assert_all_free(llm)


def test_chunked_prefill_and_preemption_across_images(tiny_vlm, vlm_reference):
    cases = _cases(vlm_reference)
    probe = LLM(str(tiny_vlm), dtype="float32", kv_cache_memory="64MiB")
    per_block = probe.engine.core.runner.kv_bytes_per_block
    del probe
    # chunks of 16 tokens end inside images' placeholder runs; 10 blocks cannot hold the four requests at once
    llm = LLM(str(tiny_vlm), dtype="float32", kv_cache_memory=str(10 * per_block), max_model_len=160,
              max_num_batched_tokens=16, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([_prompt(t, i) for t, i in cases], params)
    assert llm.engine.core.scheduler.num_preemptions > 0
    for (text, images), out in zip(cases, outs, strict=True):
        assert out.outputs[0].token_ids == _hf(vlm_reference, text, images, 20)[1]
    _assert_all_free(llm)


def test_prefix_cache_tells_images_apart(tiny_vlm, vlm_reference):
    _, processor = vlm_reference
    text = _chat_text(processor, 1, "What is in this picture?")
    first, second = random_image(10, 40, 70), random_image(11, 40, 70)  # same size: the same prompt tokens
    llm = LLM(str(tiny_vlm), dtype="float32", kv_cache_memory="64MiB")
    a = llm.generate(_prompt(text, [first]), GREEDY)[0]
    b = llm.generate(_prompt(text, [second]), GREEDY)[0]
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.outputs[0].token_ids == _hf(vlm_reference, text, [first])[1]
    assert b.outputs[0].token_ids == _hf(vlm_reference, text, [second])[1]
    assert a.outputs[0].token_ids != b.outputs[0].token_ids
    # only the blocks before the first image token are shared
    first_image_token = b.prompt_token_ids.index(llm.engine.core.runner.model.image_token_id)
    assert b.num_cached_tokens == first_image_token // 16 * 16
    again = llm.generate(_prompt(text, [first.copy()]), GREEDY)[0]  # the same pixels, another object
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 16 * 16
    assert again.outputs[0].token_ids == a.outputs[0].token_ids
    _assert_all_free(llm)


def test_chat_with_image_urls(tiny_vlm, vlm_reference):
    _, processor = vlm_reference
    image = random_image(4, 45, 45)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(image)}},
                                             {"type": "text", "text": "What is this?"}]}]
    llm = LLM(str(tiny_vlm), dtype="float32", kv_cache_memory="64MiB")
    out = llm.chat(messages, GREEDY)[0]
    text = _chat_text(processor, 1, "What is this?")
    ids, expected = _hf(vlm_reference, text, [image])
    # the chat template's text goes through the processor without special tokens added (it has its own)
    assert out.prompt_token_ids == processor(text=text, images=[[image]], add_special_tokens=False)["input_ids"][0]
    assert out.outputs[0].token_ids == expected


def test_vision_tower_on_padded_tiles(tiny_vlm, vlm_reference):
    """Tiles with padding (pixels outside the image): padded patches are no keys and the kept ones get their
    positions over the kept region, as transformers' Idefics3 computes them."""
    model, _ = vlm_reference
    llm = LLM(str(tiny_vlm), dtype="float32", kv_cache_memory="64MiB")
    ours = llm.engine.core.runner.model
    torch.manual_seed(5)
    pixels = torch.randn(3, 3, 32, 32)
    mask = torch.ones(3, 32, 32, dtype=torch.bool)
    mask[1, 20:, :] = False  # a wide tile: its bottom rows are padding
    mask[2, :, 12:] = False  # a tall one
    with torch.no_grad():
        expected = model.model.get_image_features(pixels[None], mask[None].long()).pooler_output
        got = ours.encode_tiles(pixels, mask)
    assert torch.allclose(got.reshape(-1, got.shape[-1]), torch.cat(expected), atol=1e-5, rtol=1e-4)
    unpadded = ours.encode_tiles(pixels, None)
    assert not torch.allclose(unpadded[1], got[1], atol=1e-3)  # the mask changed what tile 1 encodes


def test_bad_image_inputs_are_refused(tiny_vlm, vlm_reference, tiny_models):
    _, processor = vlm_reference
    llm = LLM(str(tiny_vlm), dtype="float32", kv_cache_memory="64MiB")
    text = _chat_text(processor, 1, "What is this?")
    image_token = llm.engine.core.runner.model.image_token_id
    with pytest.raises(ValueError, match="image tokens but no images"):
        llm.generate([[5, image_token, 6]], GREEDY)
    with pytest.raises(ImageError, match="1 image markers .* for 2 images"):
        llm.generate(_prompt(text, [random_image(0, 8, 8), random_image(1, 8, 8)]), GREEDY)
    with pytest.raises(ImageError, match="not valid base64"):
        llm.generate(_prompt(text, ["data:image/png;base64,@@@"]), GREEDY)
    with pytest.raises(ImageError, match="cannot read the image"):
        llm.generate(_prompt(text, ["data:image/png;base64,aGVsbG8="]), GREEDY)
    with pytest.raises(ValueError, match="'image' only"):
        llm.generate({"prompt": text, "multi_modal_data": {"audio": b"x"}}, GREEDY)
    assert not llm.engine.core.scheduler.waiting and not llm.engine.core.kv.block_tables
    text_only = LLM(str(tiny_models["llama"]), dtype="float32", kv_cache_memory="16MiB")
    with pytest.raises(ValueError, match="takes no images"):
        text_only.generate(_prompt("hi <image>", [random_image(0, 8, 8)]), GREEDY)


@pytest.mark.parametrize("seconds_per_tile, calls", [(1e6, [1] * 10), (1e-9, [10])])
def test_a_step_starts_as_many_tiles_as_its_time_budget_holds(tiny_vlm, vlm_reference, seconds_per_tile, calls):
    """Under the `compute` scheduler the vision tower's time counts: with a tile longer than any step budget each
    step starts one tile (the prompt's chunks end before the next one), with a free one a step starts them all;
    the output is the same."""
    _, processor = vlm_reference
    text, images = _chat_text(processor, 2, "Compare the two."), [random_image(2, 20, 30), random_image(3, 64, 64)]
    llm = LLM(str(tiny_vlm), dtype="float32", kv_cache_memory="64MiB", scheduler="compute", enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    encode, seen = model.encode_tiles, []
    model.encode_tiles = lambda pixels, mask: (seen.append(pixels.shape[0]), encode(pixels, mask))[1]
    llm.engine.core.scheduler.tile_seconds = lambda: seconds_per_tile
    out = llm.generate(_prompt(text, images), GREEDY)[0]
    assert out.outputs[0].token_ids == _hf(vlm_reference, text, images)[1]
    assert seen == calls


@pytest.mark.parametrize("cache", ["256MiB", "0"])
def test_a_second_request_with_the_same_image_takes_its_encoded_tiles(tiny_vlm, vlm_reference, cache):
    """--image-cache-memory: with prefix caching off (or the blocks evicted) the same image's tiles come from the
    encoded-tile cache, not the vision tower; with 0 they are encoded again. The output is the same."""
    _, processor = vlm_reference
    image = random_image(6, 40, 70)
    llm = LLM(str(tiny_vlm), dtype="float32", kv_cache_memory="64MiB", enable_prefix_caching=False,
              image_cache_memory=cache)
    model = llm.engine.core.runner.model
    encode, seen = model.encode_tiles, []
    model.encode_tiles = lambda pixels, mask: (seen.append(pixels.shape[0]), encode(pixels, mask))[1]
    first = llm.generate(_prompt(_chat_text(processor, 1, "What is this?"), [image.copy()]), GREEDY)[0]
    assert sum(seen) == 5  # 2 x 2 tiles and the whole image
    text = _chat_text(processor, 1, "And now?")  # another prompt: no KV to share, the same tiles
    second = llm.generate(_prompt(text, [image]), GREEDY)[0]
    assert second.outputs[0].token_ids == _hf(vlm_reference, text, [image])[1]
    assert first.num_cached_tokens == second.num_cached_tokens == 0
    stats = llm.engine.stats()
    if cache == "0":
        assert sum(seen) == 10 and stats["image_cache_hits"] == 0
    else:
        assert sum(seen) == 5 and stats["image_cache_hits"] == 5 and stats["image_cache_bytes"] > 0


def test_the_vision_tower_is_timed_at_start_up_and_its_tiles_priced_apart(tiny_vlm, vlm_reference):
    """A router balances prefill workers by their queued prefill seconds, and an image tile can cost as much as
    thousands of text tokens: the tiles still to encode count at the tower's measured seconds per tile (timed on a
    blank tile at start-up, before any image came), tiles in the encoded-tile cache do not, and the step times
    the text cost model learns from leave the tower's time out."""
    _, processor = vlm_reference
    llm = LLM(str(tiny_vlm), dtype="float32", kv_cache_memory="64MiB", enable_prefix_caching=False)
    eng, tiles = llm.engine, llm.engine.core.runner.tiles
    assert tiles.seconds is not None and tiles.seconds > 0
    assert eng.stats()["tile_seconds"] == tiles.seconds
    text, images = _chat_text(processor, 2, "Compare the two."), [random_image(2, 20, 30), random_image(3, 64, 64)]
    ids, mm = llm._with_images(_prompt(text, images))
    assert mm.num_tiles == 10
    observed = []
    observe = eng.core.cost_model.observe
    eng.core.cost_model.observe = lambda work, seconds: (observed.append(seconds), observe(work, seconds))
    model = llm.engine.core.runner.model
    encode = model.encode_tiles
    model.encode_tiles = lambda pixels, mask: (time.sleep(0.3), encode(pixels, mask))[1]

    tiles.seconds = 100.0
    eng.add_request(text, GREEDY, prompt_token_ids=ids, multi_modal=mm)
    assert 1000 <= eng.stats()["prefill_queued_seconds"] < 1001  # 10 tiles, and a short prompt's text
    while eng.has_unfinished():
        eng.step()
    assert eng.stats()["prefill_queued_seconds"] == 0
    assert observed and max(observed) < 0.3  # every step encoded its tiles in >= 0.3 s: not in what was learnt

    tiles.seconds = 100.0
    eng.add_request(text, GREEDY, prompt_token_ids=ids, multi_modal=mm)
    assert eng.stats()["prefill_queued_seconds"] < 1  # its tiles are in the encoded-tile cache now
    while eng.has_unfinished():
        eng.step()


def test_the_vision_half_alone_reads_no_text_weights_and_encodes_alike(tiny_vlm, tiny_models):
    """An encode worker builds the tower and connector only (`build_image_encoder`) and reads only their tensors; it
    encodes tiles to the same bits as the whole model. A text model has no vision half to build."""
    from transformers import AutoConfig

    from deepinfer.models.registry import build_image_encoder

    encoder, read = load_vision_half(tiny_vlm)
    assert read and all(n.startswith(("model.vision_model.", "model.connector.")) for n in read)
    whole = LLM(str(tiny_vlm), dtype="float32", kv_cache_memory="16MiB").engine.core.runner.model
    assert sum(p.numel() for p in encoder.parameters()) < sum(p.numel() for p in whole.parameters())
    torch.manual_seed(7)
    pixels = torch.randn(2, *encoder.tile_shape())
    with torch.no_grad():
        assert torch.equal(encoder.encode_tiles(pixels, None), whole.encode_tiles(pixels, None))
    with pytest.raises(ValueError, match="missing"):  # a checkpoint without its vision tensors
        encoder.load_weights(iter(()))
    with pytest.raises(ValueError, match="not a vision-language model"):
        build_image_encoder(AutoConfig.from_pretrained(str(tiny_models["llama"])), torch.float32, torch.device("cpu"))
