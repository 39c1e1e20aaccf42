"""Gemma 3 with its vision tower: a tiny random `Gemma3ForConditionalGeneration` (`tests/models/vlm_tiny.py`)
against transformers' model, float32. Its image placeholders attend to each other both ways, so the tests check
first-token log-probabilities as well as greedy tokens (the tokens of a random model move little), through
chunked prefill that must never end a chunk inside an image, prefix hits that start one inside an image, both
checkpoint spellings of the weights, and the vision half built alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from tests.models.vlm_tiny import GEMMA3_TOKENS, load_vision_half, png_data_url, random_image

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5)


def _chat_text(processor, images: int, question: str) -> str:
    content = [{"type": "image"}] * images + [{"type": "text", "text": question}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def _cases(processor) -> list[tuple[str, list]]:
    return [
        (_chat_text(processor, 1, "What is in this picture?"), [random_image(0, 40, 70)]),
        (_chat_text(processor, 2, "Compare the two."), [random_image(1, 30, 30), random_image(2, 64, 50)]),
        (_chat_text(processor, 0, "No picture this time."), []),
    ]


def _prompt(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}


def _hf(reference, text: str, images: list, max_new_tokens: int = 10) -> tuple[list[int], list[int], torch.Tensor]:
    """(prompt ids, greedy continuation, log-probabilities of the first new token) from transformers; the
    processor's token_type_ids give it the two-way mask over each image."""
    model, processor = reference
    enc = processor(text=text, images=[images] if images else None, return_tensors="pt")
    assert "token_type_ids" in enc
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        first = model(**enc).logits[0, -1].log_softmax(-1)
    n = enc["input_ids"].shape[1]
    return enc["input_ids"][0].tolist(), out[0, n:].tolist(), first


def _max_logprob_gap(out, first: torch.Tensor) -> float:
    top = out.outputs[0].logprobs[0]
    return max(abs(lp.logprob - float(first[t])) for t, lp in top.items())


def _assert_matches(out, reference, text: str, images: list) -> None:
    ids, tokens, first = _hf(reference, text, images)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == tokens
    assert _max_logprob_gap(out, first) < 1e-4


def _assert_all_free(llm: LLM) -> None:
    pool = llm.engine.core.kv.pool
    assert pool.num_free == pool.num_blocks
    assert not llm.engine.core.kv.block_tables


def test_greedy_and_first_logprobs_match_transformers(tiny_gemma3_vlm, gemma3_vlm_reference, monkeypatch):
    _, processor = gemma3_vlm_reference
    cases = _cases(processor)
    llm = LLM(str(tiny_gemma3_vlm), dtype="float32", kv_cache_memory="64MiB")
    outs = llm.generate([_prompt(t, i) for t, i in cases], GREEDY)
    for (text, images), out in zip(cases, outs, strict=True):
        _assert_matches(out, gemma3_vlm_reference, text, images)
    image_token = llm.engine.core.runner.model.image_token_id
    assert outs[1].prompt_token_ids.count(image_token) == 2 * GEMMA3_TOKENS
    _assert_all_free(llm)

    # the same engine with the images' tokens causal (as text): what the comparison above would miss
    from deepinfer.models.gemma3_vlm import Gemma3ForConditionalGeneration

    monkeypatch.setattr(Gemma3ForConditionalGeneration, "bidirectional_image_tokens", False)
    causal = LLM(str(tiny_gemma3_vlm), dtype="float32", kv_cache_memory="64MiB")
    gaps = [_max_logprob_gap(o, _hf(gemma3_vlm_reference, t, i)[2])
            for (t, i), o in zip(cases, causal.generate([_prompt(t, i) for t, i in cases], GREEDY), strict=True)]
    assert gaps[0] > 1e-3 and gaps[1] > 1e-3
    assert gaps[2] < 1e-4  # no image: nothing changes


@pytest.mark.parametrize("scheduler", ["compute", "tokens"])
def test_chunks_never_end_inside_an_image(tiny_gemma3_vlm, gemma3_vlm_reference, scheduler):
    """Steps of 24 tokens would end chunks inside the 16-token runs: they end before them instead. Then the same
    image with another question hits the one block of 16 the two prompts share, which ends inside the image:
    that chunk starts there, its placeholders attending to the cached ones before and their own after."""
    _, processor = gemma3_vlm_reference
    cases = _cases(processor)
    llm = LLM(str(tiny_gemma3_vlm), dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=24,
              max_num_seqs=4, block_size=16, scheduler=scheduler)
    sched = llm.engine.core.scheduler
    chunks: list[tuple[tuple[tuple[int, int], ...], int, int]] = []
    schedule = sched.schedule

    def recorded():
        out = schedule()
        for item in out.scheduled:
            mm = item.request.multi_modal
            if mm is not None and item.start < item.request.num_prompt_tokens:
                chunks.append((mm.runs, item.start, item.start + item.num_new_tokens))
        return out

    sched.schedule = recorded
    outs = llm.generate([_prompt(t, i) for t, i in cases], GREEDY)
    for (text, images), out in zip(cases, outs, strict=True):
        _assert_matches(out, gemma3_vlm_reference, text, images)
    assert any(end == first for runs, _, end in chunks for first, _ in runs)  # cut back to an image's start
    text, images = _chat_text(processor, 1, "And its colours?"), cases[0][1]
    before = len(chunks)
    again = llm.generate(_prompt(text, images), GREEDY)[0]
    assert again.num_cached_tokens == 16
    runs, start, _ = chunks[before]
    assert start == 16 and runs[0][0] < start <= runs[0][1]
    _assert_matches(again, gemma3_vlm_reference, text, images)
    assert all(not (first < end <= last) for runs, _, end in chunks for first, last in runs)
    _assert_all_free(llm)


def test_an_image_a_step_cannot_hold_is_refused(tiny_gemma3_vlm, gemma3_vlm_reference, caplog):
    _, processor = gemma3_vlm_reference
    text, images = _cases(processor)[0]
    with caplog.at_level("WARNING", logger="deepinfer.engine.core"):
        llm = LLM(str(tiny_gemma3_vlm), dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=18,
                  max_num_seqs=4)
    assert "every prompt with an image will be refused" in caplog.text  # said at start-up, not first at a request
    with pytest.raises(ValueError, match="16 placeholder tokens must be prefilled in one step"):
        llm.generate(_prompt(text, images), GREEDY)
    text_only = _cases(processor)[2][0]
    assert llm.generate(_prompt(text_only, []), GREEDY)[0].outputs[0].token_ids == \
        _hf(gemma3_vlm_reference, text_only, [])[1]
    _assert_all_free(llm)


def _respelled(src: Path, dst: Path, rename) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({rename(k): v for k, v in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _published(name: str) -> str:
    """The names of the published checkpoints (google/gemma-3-4b-it): the tower under `vision_model`."""
    return name.replace("vision_tower.", "vision_tower.vision_model.", 1) if name.startswith("vision_tower.") \
        and not name.startswith("vision_tower.vision_model.") else name


def _transformers5(name: str) -> str:
    """transformers 5's module names: everything under `model.`, the LM head apart."""
    for old, new in (("language_model.lm_head.", "lm_head."), ("language_model.model.", "model.language_model."),
                     ("vision_tower.vision_model.", "model.vision_tower."), ("vision_tower.", "model.vision_tower."),
                     ("multi_modal_projector.", "model.multi_modal_projector.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def test_both_weight_spellings_load_and_chat_takes_image_urls(tiny_gemma3_vlm, gemma3_vlm_reference, tmp_path):
    _, processor = gemma3_vlm_reference
    image = random_image(4, 45, 60)
    text = _chat_text(processor, 1, "What is this?")
    ids, tokens, _ = _hf(gemma3_vlm_reference, text, [image])
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(image)}},
                                             {"type": "text", "text": "What is this?"}]}]
    for name, rename in (("published", _published), ("transformers5", _transformers5)):
        path = _respelled(tiny_gemma3_vlm, tmp_path / name, rename)
        with open(path / "config.json") as f:
            assert json.load(f)["architectures"] == ["Gemma3ForConditionalGeneration"]
        llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB")
        out = llm.chat(messages, GREEDY)[0]
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == tokens


def test_the_vision_half_alone_matches_transformers(tiny_gemma3_vlm, gemma3_vlm_reference):
    """What an encode worker builds: the tower and projector only, reading only their tensors, equal to
    transformers' image features and to the whole model's encoding."""
    model, _ = gemma3_vlm_reference
    encoder, read = load_vision_half(tiny_gemma3_vlm)
    assert read and all(n.startswith(("vision_tower.", "multi_modal_projector.")) for n in read)
    torch.manual_seed(3)
    pixels = torch.randn(2, *encoder.tile_shape())
    whole = LLM(str(tiny_gemma3_vlm), dtype="float32", kv_cache_memory="16MiB").engine.core.runner.model
    with torch.no_grad():
        got = encoder.encode_tiles(pixels, None)
        expected = model.model.get_image_features(pixels).pooler_output
        assert torch.equal(got, whole.encode_tiles(pixels, None))
    assert got.shape == (2, GEMMA3_TOKENS, model.config.text_config.hidden_size)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-4)


def _uncached_logits(model, processor, text: str, images: list, continuation: list[int]) -> torch.Tensor:
    """transformers' last-position logits (float32) for the prompt and `continuation`, in one uncached forward."""
    enc = processor(text=text, images=[images] if images else None, return_tensors="pt")
    ids = torch.cat([enc["input_ids"], torch.tensor([continuation], dtype=torch.long)], 1)
    types = torch.cat([enc["token_type_ids"], torch.zeros(1, len(continuation), dtype=enc["token_type_ids"].dtype)], 1)
    rest = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask", "token_type_ids")}
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=types, **rest).logits[0, -1].float()


def test_bfloat16_greedy_matches_transformers_in_bfloat16(tiny_gemma3_vlm, gemma3_vlm_reference):
    """The same cases in bfloat16 (the default dtype on CPUs with AVX-512 BF16 / AMX; emulated, and still quick,
    elsewhere) against transformers' model in bfloat16: the same 9 greedy tokens, up to where transformers' own
    logits hold a tie at bfloat16's resolution. This random model's logits are flat (~2.9 apart by one bf16 step,
    0.0156), so two correct products that sum in another order can pick either of two tied tokens: transformers'
    uncached forward over the prompt and the first 9 tokens of the two-image case gives 33735 and 36530 the same
    logit (2.9531) and its argmax takes 33735, as deepinfer does, while its cached `generate` takes 36530 (in
    float32 the two part, 2.9669 for 36530 against 2.9505, and there deepinfer matches:
    `test_greedy_and_first_logprobs_match_transformers`, 10 tokens); on an AMX Xeon (session 52) the one-image
    case's 8th token had 42015 at 2.9219 and 3444 at 2.9062 in transformers, one bf16 step apart, where deepinfer's
    AMX tiles rounded both to the same value and took 3444. So where the tokens part, transformers' uncached logits
    must rank both within one bf16 step of each other (a wrong kernel misses by far more, and from the first tokens),
    and at least 6 tokens must agree before that."""
    from transformers import AutoModelForImageTextToText

    _, processor = gemma3_vlm_reference
    hf = AutoModelForImageTextToText.from_pretrained(str(tiny_gemma3_vlm), dtype=torch.bfloat16).eval()
    hf.generation_config.eos_token_id = None
    cases = _cases(processor)
    llm = LLM(str(tiny_gemma3_vlm), dtype="bfloat16", kv_cache_memory="32MiB")
    outs = llm.generate([_prompt(t, i) for t, i in cases], SamplingParams(temperature=0.0, max_tokens=9,
                                                                          ignore_eos=True))
    for (text, images), out in zip(cases, outs, strict=True):
        ids, tokens, _ = _hf((hf, processor), text, images, max_new_tokens=9)
        assert out.prompt_token_ids == ids
        ours = list(out.outputs[0].token_ids)
        part = next((i for i, (a, b) in enumerate(zip(ours, tokens, strict=True)) if a != b), None)
        if part is None:
            continue
        assert part >= 6, (part, ours, tokens)
        logits = _uncached_logits(hf, processor, text, images, ours[:part])
        top = float(logits.max())
        step = 2.0 ** (torch.frexp(torch.tensor(top)).exponent.item() - 8)  # one bf16 step at the top logit
        assert top - float(logits[ours[part]]) <= step and top - float(logits[tokens[part]]) <= step, \
            (part, ours[part], tokens[part], top, float(logits[ours[part]]), float(logits[tokens[part]]))
    _assert_all_free(llm)


# google/gemma-3-4b-it's published config.json (transformers 4.50), the fields it sets
GEMMA3_4B_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"head_dim": 256, "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_attention_heads": 8, "num_hidden_layers": 34, "num_key_value_heads": 4,
                    "query_pre_attn_scalar": 256, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}


def test_the_published_4b_config_builds_and_takes_every_tensor_of_its_shape(tmp_path):
    """No weights are reachable here, so the real size is checked on the meta device: gemma-3-4b-it's config
    builds, and every tensor transformers' model of it has (its names, at their shapes) loads into a parameter,
    none left out; an image is 256 tokens pooled 4 x 4 from 64 x 64 patches."""
    from transformers import AutoConfig
    from transformers import Gemma3ForConditionalGeneration as HFGemma3

    from deepinfer.layers.torch_attention import TorchAttentionBackend
    from deepinfer.models.registry import build_model

    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_4B_CONFIG))
    cfg = AutoConfig.from_pretrained(str(tmp_path))
    meta = torch.device("meta")
    with meta:
        reference = HFGemma3(cfg)
    ours = build_model(cfg, TorchAttentionBackend(torch.device("cpu")), 8192, torch.bfloat16, meta)
    assert (ours.image_token_id, ours.tokens_per_tile, ours.image_encoder.projector.kernel) == (262144, 256, 4)
    assert ours.tile_shape() == (3, 896, 896)
    tensors = reference.state_dict()
    assert len(tensors) > 800
    ours.load_weights(tensors.items())  # raises on a name or shape that does not fit, or a parameter left out
    with pytest.raises(ValueError, match="missing"):
        ours.load_weights((n, t) for n, t in tensors.items() if "mm_input_projection" not in n)
