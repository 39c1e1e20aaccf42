"""Gemma 3 with its vision tower (`Gemma3ForConditionalGeneration`: the 4B, 12B and 27B checkpoints).

- **An image is one tile** of `image_size` pixels a side (896: the processor resizes it). The SigLIP tower
  (`models/siglip.py`) encodes it, every patch kept. (Pan & scan crops, a processor option off by default, would
  be more tiles, each between its own markers; not tested.)
- **The projector** average-pools the tower's patch grid (64 x 64) down to `mm_tokens_per_image` vectors
  (16 x 16), RMS-norms them (Gemma's 1 + w, in float32) and multiplies by a [vision hidden, text hidden] matrix.
- **The vectors replace the embeddings** of the image's `<image_soft_token>` placeholders after the text
  embedding's sqrt(hidden) scaling: they are not scaled.
- **A run of placeholders attends to itself both ways** in the text model (transformers builds that mask from
  `token_type_ids`; text tokens stay causal, and an image never sees a later one). Here the model says so
  (`bidirectional_image_tokens`): the scheduler never ends a prefill chunk inside a run, and the runner gives
  each placeholder the run's last position as the last key it attends to (`AttentionBatch.horizons`). Sliding
  layers keep their window on top: a key is seen if it is no more than `window - 1` positions back.

The rest is `Gemma3ForCausalLM`. Checkpoints spell the halves two ways (`language_model.model.*`,
`vision_tower.vision_model.*`, `multi_modal_projector.*` as published; `model.language_model.*`,
`model.vision_tower.*` as transformers 5 names its modules); both load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.attention import AttentionBackend
from deepinfer.layers.norm import GemmaRMSNorm
from deepinfer.models.gemma3 import Gemma3ForCausalLM
from deepinfer.models.image_encoder import ImageEncoder, WithImageEncoder
from deepinfer.models.siglip import VisionTransformer


class Gemma3Projector(nn.Module):
    """Patch grid -> average pool -> RMSNorm (1 + w) -> projection to the text model's width."""

    def __init__(self, cfg) -> None:
        super().__init__()
        vcfg = cfg.vision_config
        self.side = vcfg.image_size // vcfg.patch_size
        per_side = round(cfg.mm_tokens_per_image ** 0.5)
        if per_side * per_side != cfg.mm_tokens_per_image or self.side % per_side:
            raise ValueError(f"Gemma 3: mm_tokens_per_image={cfg.mm_tokens_per_image} must be a square whose side "
                             f"divides the {self.side} patches a side of a tile")
        self.kernel = self.side // per_side
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vcfg.hidden_size, cfg.text_config.hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(vcfg.hidden_size, eps=vcfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles, _, d = x.shape
        grid = x.transpose(1, 2).reshape(tiles, d, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).to(x.dtype)


class Gemma3ImageEncoder(ImageEncoder):
    """The vision half of a Gemma 3 checkpoint: SigLIP tower and projector (`models/image_encoder.py`)."""

    WEIGHT_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
    _KEYS = (("vision_tower.vision_model.", "vision_model."), ("vision_tower.", "vision_model."),
             ("multi_modal_projector.", "projector."))

    def __init__(self, cfg) -> None:
        super().__init__()
        vcfg = cfg.vision_config
        if getattr(vcfg, "vision_use_head", False):
            raise ValueError("Gemma 3: a vision tower with a pooling head (vision_use_head=True) is not supported")
        self.config = cfg
        self.image_token_id, self.tokens_per_tile = self.image_facts(cfg)
        self.vision_model = VisionTransformer(vcfg)
        self.projector = Gemma3Projector(cfg)

    @staticmethod
    def image_facts(cfg) -> tuple[int, int]:
        """(image token id, placeholder tokens per image) of a config: what a router needs, with no weights."""
        return int(cfg.image_token_id), int(cfg.mm_tokens_per_image)

    def own_key(self, name: str) -> str | None:
        name = name.removeprefix("model.")
        for prefix, target in self._KEYS:
            if name.startswith(prefix):
                return target + name[len(prefix):]
        return None

    def tile_shape(self) -> tuple[int, int, int]:
        vcfg = self.config.vision_config
        return int(vcfg.num_channels), int(vcfg.image_size), int(vcfg.image_size)

    def encode_tiles(self, pixels: torch.Tensor, pixel_mask: torch.Tensor | None) -> torch.Tensor:
        """Tiles [T, C, H, W] (the processor pads none: `pixel_mask` is not read) -> [T, mm_tokens_per_image,
        text hidden]."""
        return self.projector(self.vision_model(pixels.to(self.projector.mm_input_projection_weight.device)))


class Gemma3ForConditionalGeneration(WithImageEncoder, Gemma3ForCausalLM):
    """Gemma 3 image-text checkpoints: the text model of `Gemma3ForCausalLM` with `image_encoder`."""

    image_encoder_class = Gemma3ImageEncoder
    image_facts = staticmethod(Gemma3ImageEncoder.image_facts)
    # read by the scheduler and the runner (module docstring)
    bidirectional_image_tokens = True

    def __init__(self, cfg, backend: AttentionBackend, max_positions: int, dtype: torch.dtype) -> None:
        text = cfg.get_text_config()
        top_tie = getattr(cfg, "tie_word_embeddings", None)
        if top_tie is not None:  # transformers ties by the top-level flag where the config has one
            text.tie_word_embeddings = bool(top_tie)
        image_encoder = Gemma3ImageEncoder(cfg)  # (checks the config before the text model is built)
        super().__init__(text, backend, max_positions, dtype)
        self._attach_image_encoder(image_encoder)

    @staticmethod
    def text_weight_name(name: str) -> str:
        for prefix, target in (("language_model.lm_head.", "lm_head."), ("language_model.model.", "model."),
                               ("model.language_model.", "model."), ("language_model.", "model.")):
            if name.startswith(prefix):
                return target + name[len(prefix):]
        return name
