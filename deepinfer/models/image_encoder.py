"""The vision half of a vision-language checkpoint (tower and projector), as one module that builds and loads
without the text model: the whole model holds one (`image_encoder`), an encode worker builds it alone
(`models.registry.build_image_encoder`) and reads only its tensors (`WEIGHT_PREFIXES`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn


class ImageEncoder(nn.Module):
    """Contract for a model's vision half: an `ImageTower` (`multimodal/encoder.py`: `image_token_id`,
    `tokens_per_tile`, `tile_shape()`, `encode_tiles(pixels, pixel_mask)`), and `own_key(checkpoint name)`: the
    parameter a checkpoint tensor fills, None for the text model's. `WEIGHT_PREFIXES`: the checkpoint names the
    vision half's tensors start with (all the spellings its checkpoints use), so an encode worker reads no
    others."""

    WEIGHT_PREFIXES: tuple[str, ...] = ()

    def own_key(self, name: str) -> str | None:
        raise NotImplementedError

    def take_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Copy the checkpoint's vision and projector tensors in; yield every other one (the text model's). Once
        `weights` is exhausted, ValueError if a vision tensor was missing (one that does not fit: at once)."""
        own = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            key = self.own_key(name)
            if key is None:
                yield name, tensor
                continue
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


class WithImageEncoder:
    """For a text model class whose checkpoint also holds a vision half (`class X(WithImageEncoder, TextModel)`):
    the vision half as `image_encoder`, its tiles' encoding (`tile_shape`, `encode_tiles`: what the runner's
    `TileEncoder` calls), and loading that takes the vision tensors out of the checkpoint stream before the text
    model sees the rest, renamed by `text_weight_name`."""

    image_encoder: ImageEncoder

    def _attach_image_encoder(self, encoder: ImageEncoder) -> None:
        self.image_encoder = encoder
        self.image_token_id, self.tokens_per_tile = encoder.image_token_id, encoder.tokens_per_tile

    @staticmethod
    def text_weight_name(name: str) -> str:
        """A checkpoint's text-model tensor name as the text model's `load_weights` reads it."""
        return name

    def tile_shape(self) -> tuple[int, int, int]:
        return self.image_encoder.tile_shape()

    def encode_tiles(self, pixels: torch.Tensor, pixel_mask: torch.Tensor | None) -> torch.Tensor:
        return self.image_encoder.encode_tiles(pixels, pixel_mask)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((self.text_weight_name(name), tensor)  # type: ignore[misc]
                             for name, tensor in self.image_encoder.take_weights(weights))

    def _params_loaded_elsewhere(self) -> set[str]:
        return {n for n, _ in self.named_parameters() if n.startswith("image_encoder.")}  # type: ignore[attr-defined]
