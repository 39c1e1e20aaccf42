"""The vision tower as the engine and an encode worker run it: timed per tile, through a cache of encoded tiles.

    ModelRunner (a prefill chunk reaches a tile) ──┐
    encode worker (POST /internal/encode) ─────────┴─▶ TileEncoder ─▶ cache hit? ─▶ model.encode_tiles (timed)

`seconds`, the tower's measured time per tile, prices image tiles wherever they are weighed: the `compute`
scheduler's tiles per step, an engine's queued prefill seconds, the router's estimated prefill finish and its
choice of encode worker.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from deepinfer.kvcache.host import ByteLRU
from deepinfer.multimodal.inputs import EncodedTiles, MultiModalInputs

# weight of the newest timing in the moving average of seconds per tile
SECONDS_SMOOTHING = 0.3


class ImageTower(Protocol):
    """What a vision-language model (or its vision half alone) offers: tiles to text-model embeddings."""

    image_token_id: int
    tokens_per_tile: int

    def tile_shape(self) -> tuple[int, int, int]: ...

    def encode_tiles(self, pixels: torch.Tensor, pixel_mask: torch.Tensor | None) -> torch.Tensor: ...


class TileEncoder:
    """Runs `model.encode_tiles` (looked up at each call), timed per tile (`seconds`, a moving average; None until
    the first tiles), through `cache`: encoded tiles by digest, for later requests with the same image
    (`--image-cache-memory`)."""

    def __init__(self, model: ImageTower, cache_bytes: int) -> None:
        self.model = model
        self.cache = ByteLRU(cache_bytes)
        self.seconds: float | None = None

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        started = time.perf_counter()
        out = self.model.encode_tiles(pixels, mask)
        if out.device.type == "cuda":
            torch.cuda.synchronize(out.device)
        per_tile = (time.perf_counter() - started) / max(int(pixels.shape[0]), 1)
        self.seconds = per_tile if self.seconds is None else (
            (1 - SECONDS_SMOOTHING) * self.seconds + SECONDS_SMOOTHING * per_tile)
        return out

    def profile(self) -> None:
        """Encode one blank tile, so `seconds` is known before the first image arrives."""
        self(torch.zeros(1, *self.model.tile_shape()), None)

    def encode(self, inputs: MultiModalInputs) -> MultiModalInputs:
        """`inputs` with every tile encoded (those in the cache taken from it); ValueError for inputs another model's
        processor made."""
        if inputs.embeddings is not None:
            return inputs
        if inputs.tokens_per_tile != self.model.tokens_per_tile:
            raise ValueError(f"the model encodes a tile as {self.model.tokens_per_tile} tokens, the inputs say "
                             f"{inputs.tokens_per_tile}")
        rows = EncodedTiles(inputs).rows(0, len(inputs.positions), self, self.cache)
        return inputs.encoded(rows.reshape(inputs.num_tiles, inputs.tokens_per_tile, -1))


def tile_stats(tiles: TileEncoder) -> dict[str, float]:
    """An engine's or encode worker's stats of its tower: seconds per tile (0: not measured yet) and its cache."""
    cache = tiles.cache
    return {"tile_seconds": tiles.seconds or 0.0, "image_cache_hits": cache.hits, "image_cache_misses": cache.misses,
            "image_cache_bytes": cache.nbytes}
