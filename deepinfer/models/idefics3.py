"""Idefics3 / SmolVLM: a SigLIP-style vision transformer, a pixel-shuffle connector, and a Llama text model.

An image arrives as tiles (the HF processor splits it into a grid of `image_size` squares plus one
downscaled whole image); each tile is encoded on its own (`encode_tiles`): patches embedded by a strided
convolution, a learned position per patch, bidirectional encoder layers, a final LayerNorm; then every
`scale_factor` x `scale_factor` neighbourhood of patch outputs is folded into one vector (pixel shuffle)
and projected to the text model's width. A tile gives `(image_size / patch_size / scale_factor) ** 2`
vectors, which replace the embeddings of that many `<image>` tokens of the prompt, in order
(`LlamaForCausalLM.hidden_states(..., input_embeds=...)`); the rest is the Llama forward.

Patches a tile pads (`patch_mask` False) are no keys for attention, and the patches kept get positions
bucketed over the kept region's fraction of the tile, as transformers' Idefics3 does, so a padded tile
encodes like the same tile alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.attention import AttentionBackend
from deepinfer.models.llama import LlamaForCausalLM


class VisionEmbeddings(nn.Module):
    def __init__(self, vcfg) -> None:
        super().__init__()
        self.patch_size = vcfg.patch_size
        self.side = vcfg.image_size // vcfg.patch_size  # patches per side of a full tile
        self.patch_embedding = nn.Conv2d(vcfg.num_channels, vcfg.hidden_size, vcfg.patch_size, vcfg.patch_size)
        self.position_embedding = nn.Embedding(self.side * self.side, vcfg.hidden_size)

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """pixels [tiles, C, H, W], patch_mask [tiles, H / p, W / p] (bool) -> [tiles, patches, hidden]."""
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return x + self.position_embedding(self.position_ids(patch_mask))

    def position_ids(self, patch_mask: torch.Tensor) -> torch.Tensor:
        """Each kept patch's position: its row and column as fractions of the kept rows / columns, bucketed
        into the `side` x `side` grid the positions were trained on (padded patches take position 0)."""
        tiles, rows, cols = patch_mask.shape
        dev = patch_mask.device
        edges = torch.arange(1 / self.side, 1.0, 1 / self.side, device=dev)
        kept_rows = patch_mask[:, :, 0].sum(dim=1)
        kept_cols = patch_mask[:, 0, :].sum(dim=1)
        frac_r = (torch.arange(rows, dtype=torch.float32, device=dev)[None, :] * (1.0 / kept_rows)[:, None]).clamp(max=1 - 1e-6)
        frac_c = (torch.arange(cols, dtype=torch.float32, device=dev)[None, :] * (1.0 / kept_cols)[:, None]).clamp(max=1 - 1e-6)
        r = torch.bucketize(frac_r, edges, right=True)
        c = torch.bucketize(frac_c, edges, right=True)
        ids = (r[:, :, None] * self.side + c[:, None, :]).reshape(tiles, -1)
        return torch.where(patch_mask.reshape(tiles, -1), ids, torch.zeros_like(ids))


class VisionAttention(nn.Module):
    def __init__(self, vcfg) -> None:
        super().__init__()
        d = vcfg.hidden_size
        self.num_heads = vcfg.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        tiles, n, d = x.shape
        q, k, v = (p(x).view(tiles, n, self.num_heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(tiles, n, d))


class VisionMLP(nn.Module):
    def __init__(self, vcfg) -> None:
        super().__init__()
        if vcfg.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"unsupported vision activation {vcfg.hidden_act!r}")
        self.approximate = "tanh" if vcfg.hidden_act == "gelu_pytorch_tanh" else "none"
        self.fc1 = nn.Linear(vcfg.hidden_size, vcfg.intermediate_size)
        self.fc2 = nn.Linear(vcfg.intermediate_size, vcfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class VisionLayer(nn.Module):
    def __init__(self, vcfg) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(vcfg.hidden_size, eps=vcfg.layer_norm_eps)
        self.self_attn = VisionAttention(vcfg)
        self.layer_norm2 = nn.LayerNorm(vcfg.hidden_size, eps=vcfg.layer_norm_eps)
        self.mlp = VisionMLP(vcfg)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), key_mask)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, vcfg) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(vcfg) for _ in range(vcfg.num_hidden_layers))


class VisionTransformer(nn.Module):
    def __init__(self, vcfg) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(vcfg)
        self.encoder = VisionEncoder(vcfg)
        self.post_layernorm = nn.LayerNorm(vcfg.hidden_size, eps=vcfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels, patch_mask)
        key_mask = None if bool(patch_mask.all()) else patch_mask.reshape(patch_mask.shape[0], -1)
        for layer in self.encoder.layers:
            x = layer(x, key_mask)
        return self.post_layernorm(x)


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


class Idefics3ImageEncoder(nn.Module):
    """The vision half of an Idefics3 checkpoint: tower and connector, `encode_tiles`. The full model holds one
    (`image_encoder`); an encode worker builds it alone (`models.registry.build_image_encoder`) and reads none of the
    text model's weights."""

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

    def take_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Copy the checkpoint's vision and connector tensors in; yield every other one (the text model's). Once
        `weights` is exhausted, ValueError if a vision tensor was missing (one that does not fit: at once)."""
        own = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if not name.startswith(self.WEIGHT_PREFIXES):
                yield name, tensor
                continue
            key = name.removeprefix("model.")
            if key not in own or own[key].shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} does not match the vision model")
            with torch.no_grad():
                own[key].copy_(tensor)
            loaded.add(key)
        missing = set(own) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} vision tensors, e.g. {sorted(missing)[:3]}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Its own tensors of a whole checkpoint (the others are passed over)."""
        for _ in self.take_weights(weights):
            pass


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    """Idefics3 and SmolVLM checkpoints (`model.vision_model`, `model.connector`, `model.text_model`, `lm_head`)."""

    image_encoder_class = Idefics3ImageEncoder
    image_facts = staticmethod(Idefics3ImageEncoder.image_facts)

    def __init__(self, cfg, backend: AttentionBackend, max_positions: int, dtype: torch.dtype) -> None:
        text = cfg.get_text_config()
        # transformers ties the LM head to the embedding by the top-level flag, whatever text_config says
        text.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        image_encoder = Idefics3ImageEncoder(cfg)  # (checks the config before the text model is built)
        super().__init__(text, backend, max_positions, dtype)
        self.image_encoder = image_encoder
        self.image_token_id, self.tokens_per_tile = image_encoder.image_token_id, image_encoder.tokens_per_tile

    def tile_shape(self) -> tuple[int, int, int]:
        return self.image_encoder.tile_shape()

    def encode_tiles(self, pixels: torch.Tensor, pixel_mask: torch.Tensor | None) -> torch.Tensor:
        return self.image_encoder.encode_tiles(pixels, pixel_mask)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name.replace("model.text_model.", "model.", 1), tensor)
                             for name, tensor in self.image_encoder.take_weights(weights))

    def _params_loaded_elsewhere(self) -> set[str]:
        return {n for n, _ in self.named_parameters() if n.startswith("image_encoder.")}
