"""Tiny random vision-language models saved with their processors, for the vision tests.

- Idefics3 (SmolVLM's architecture): tiles of 32 x 32 pixels in patches of 8 (a 4 x 4 grid), pixel shuffle by
  2: 4 image tokens per tile; images are split into tiles of up to 2 x 2 plus the whole image downscaled. The
  text model is a 2-layer Llama with GQA.
- Gemma 3: an image is one 64 x 64 tile in patches of 8 (8 x 8), pooled to 4 x 4: 16 image tokens, which
  attend to each other both ways. The text model has sliding (window 8, shorter than an image's run) and
  global layers.

Both over the default model's tokenizer, to which the processor's special tokens are added."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

TILE, PATCH, SCALE = 32, 8, 2
TOKENS_PER_TILE = (TILE // PATCH) ** 2 // SCALE ** 2

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}")


def build_vlm(path: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    specials = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    specials += [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tok.add_special_tokens({"additional_special_tokens": specials})
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                initializer_range=0.08)
    vision = dict(hidden_size=32, intermediate_size=48, num_attention_heads=2, num_hidden_layers=2, image_size=TILE,
                  patch_size=PATCH, initializer_range=0.08)
    cfg = Idefics3Config(text_config=text, vision_config=vision, scale_factor=SCALE, tie_word_embeddings=False,
                         image_token_id=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # LayerNorm weights start at 1 and biases at 0: make them matter
        for name, param in model.named_parameters():
            if "layer_norm" in name or "post_layernorm" in name:
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
    model.save_pretrained(path)
    images = Idefics3ImageProcessorPil(size={"longest_edge": 2 * TILE}, max_image_size={"longest_edge": TILE},
                                       do_image_splitting=True)
    Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=TOKENS_PER_TILE,
                      chat_template=CHAT_TEMPLATE).save_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


GEMMA3_IMAGE, GEMMA3_PATCH, GEMMA3_TOKENS = 64, 8, 16
GEMMA3_WINDOW = 8
GEMMA3_CHAT_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<start_of_image>{% else %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}"
    "<start_of_turn>model\n{% endif %}")


def build_gemma3_vlm(path: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    from transformers import (
        AutoTokenizer,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
    )

    named = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), extra_special_tokens=named)
    text = dict(vocab_size=len(tok), hidden_size=48, intermediate_size=80, num_attention_heads=4, num_key_value_heads=1,
                head_dim=16, num_hidden_layers=3, layer_types=["sliding_attention", "full_attention",
                                                               "sliding_attention"],
                sliding_window=GEMMA3_WINDOW, query_pre_attn_scalar=20, max_position_embeddings=512,
                rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vision = dict(hidden_size=32, intermediate_size=48, num_attention_heads=2, num_hidden_layers=2,
                  image_size=GEMMA3_IMAGE, patch_size=GEMMA3_PATCH, vision_use_head=False)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA3_TOKENS,
                       boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id,
                       image_token_index=tok.image_token_id, initializer_range=0.1)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # norms and the projection start at zero: make them matter
        for name, param in model.named_parameters():
            if "norm" in name or "mm_input_projection" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    images = Gemma3ImageProcessorPil(size={"height": GEMMA3_IMAGE, "width": GEMMA3_IMAGE})
    Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=GEMMA3_TOKENS,
                    chat_template=GEMMA3_CHAT_TEMPLATE).save_pretrained(path)
    tok.chat_template = GEMMA3_CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


def load_vision_half(path: Path) -> tuple[torch.nn.Module, list[str]]:
    """What an encode worker builds for the checkpoint at `path`: its vision half alone (`build_image_encoder`),
    loaded from the tensors its `WEIGHT_PREFIXES` select; and the names of the tensors read."""
    from transformers import AutoConfig

    from deepinfer.models.registry import build_image_encoder
    from deepinfer.weights import resolve_model

    files = resolve_model(str(path))
    encoder = build_image_encoder(AutoConfig.from_pretrained(str(path)), torch.float32, torch.device("cpu"))
    read: list[str] = []

    def recorded():
        for name, tensor in files.iter_weights(torch.float32, prefixes=encoder.WEIGHT_PREFIXES):
            read.append(name)
            yield name, tensor

    encoder.load_weights(recorded())
    return encoder, read


def random_image(seed: int, height: int, width: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def png_data_url(image) -> str:
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
