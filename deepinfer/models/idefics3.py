"""Idefics3 / SmolVLM: a SigLIP-style vision transformer, a pixel-shuffle connector, and a Llama text model.

An image arrives as tiles (the HF processor splits it into a grid of `image_size` squares plus one
downscaled whole image); each tile is encoded on its own (`encode_tiles`): patches embedded by a strided
convolution, a learned position per patch, bidirectional encoder layers, a final LayerNorm; then every
`scale_factor` x `scale_factor` neighbourhood of patch outputs is folded into one vector (pixel shuffle)
and projected to the text model's width. A tile gives `(image_size / patch_size / scale_factor) ** 2`
vectors, which replace the embeddings of that many `<image>` tokens of the prompt, in order
(`LlamaForCausalLM.hidden_states(..., input_embeds=...)`); the rest is the Llama forward.

Patches a tile pads (`patch_mask` False) are no keys for attention, and the patches kept get positions
bucketed over the kept region's fraction of the tile (`models/siglip.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.layers.attention import AttentionBackend
from deepinfer.models.image_encoder import ImageEncoder, WithImageEncoder
from deepinfer.models.llama import LlamaForCausalLM
from deepinfer.models.siglip import VisionTransformer


class ModalityProjection(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False)


class Connector(nn.Module):
    """Pixel shuffle (each scale x scale block of patches concatenated into one vector) and a projection."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.scale = cfg.scale_factor
        self.modality_projection = ModalityProjection(cfg.vision_config.hidden_size * self.scale ** 2,
                                                      cfg.text_config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles, n, d = x.shape
        side, s = int(n ** 0.5), self.scale
        # each s x s block of the side x side patch grid becomes one vector of s * s patches (the
        # folding order of transformers' pixel_shuffle, which the checkpoints were trained with)
        x = x.view(tiles, side, side // s, d * s).transpose(1, 2)
        x = x.reshape(tiles, side // s, side // s, d * s * s).transpose(1, 2)
        return self.modality_projection.proj(x.reshape(tiles, n // (s * s), d * s * s))


class Idefics3ImageEncoder(ImageEncoder):
    """The vision half of an Idefics3 checkpoint: tower and connector (`models/image_encoder.py`)."""

    WEIGHT_PREFIXES = ("model.vision_model.", "model.connector.")

    def __init__(self, cfg) -> None:
        super().__init__()
        vcfg = cfg.vision_config
        if vcfg.image_size % vcfg.patch_size or (vcfg.image_size // vcfg.patch_size) % cfg.scale_factor:
            raise ValueError("Idefics3: image_size / patch_size must be a whole multiple of scale_factor")
        self.config = cfg
        self.image_token_id, self.tokens_per_tile = self.image_facts(cfg)
        self.patch_size = vcfg.patch_size
        self.vision_model = VisionTransformer(vcfg)
        self.connector = Connector(cfg)

    @staticmethod
    def image_facts(cfg) -> tuple[int, int]:
        """(image token id, placeholder tokens per tile) of a config: what a router needs, with no weights."""
        vcfg = cfg.vision_config
        return int(cfg.image_token_id), (vcfg.image_size // vcfg.patch_size // cfg.scale_factor) ** 2

    def tile_shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of the tiles `encode_tiles` takes."""
        vcfg = self.config.vision_config
        return int(vcfg.num_channels), int(vcfg.image_size), int(vcfg.image_size)

    def encode_tiles(self, pixels: torch.Tensor, pixel_mask: torch.Tensor | None) -> torch.Tensor:
        """Tiles [T, C, H, W] (and their pixel mask [T, H, W], True where the image is) -> the text-model
        embeddings of their image tokens [T, tokens_per_tile, hidden]."""
        p, dev = self.patch_size, self.connector.modality_projection.proj.weight.device
        pixels = pixels.to(dev)
        if pixel_mask is None:
            patch_mask = torch.ones(pixels.shape[0], pixels.shape[2] // p, pixels.shape[3] // p, dtype=torch.bool,
                                    device=dev)
        else:  # a patch counts if any of its pixels is the image's
            patch_mask = pixel_mask.to(dev).unfold(1, p, p).unfold(2, p, p).sum(dim=(-1, -2)) > 0
        return self.connector(self.vision_model(pixels, patch_mask))

    def own_key(self, name: str) -> str | None:
        return name.removeprefix("model.") if name.startswith(self.WEIGHT_PREFIXES) else None


class Idefics3ForConditionalGeneration(WithImageEncoder, LlamaForCausalLM):
    """Idefics3 and SmolVLM checkpoints (`model.vision_model`, `model.connector`, `model.text_model`, `lm_head`)."""

    image_encoder_class = Idefics3ImageEncoder
    image_facts = staticmethod(Idefics3ImageEncoder.image_facts)

    def __init__(self, cfg, backend: AttentionBackend, max_positions: int, dtype: torch.dtype) -> None:
        text = cfg.get_text_config()
        # transformers ties the LM head to the embedding by the top-level flag, whatever text_config says
        text.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        image_encoder = Idefics3ImageEncoder(cfg)  # (checks the config before the text model is built)
        super().__init__(text, backend, max_positions, dtype)
        self._attach_image_encoder(image_encoder)

    @staticmethod
    def text_weight_name(name: str) -> str:
        return name.replace("model.text_model.", "model.", 1)
