"""A prompt's images as the engine carries them: pixel tiles, where their tokens sit, and their names.

A vision-language model's processor expands each image of a prompt into tiles and each tile into
`tokens_per_tile` placeholder tokens (`<image>`); `MultiModalInputs` holds the tiles' pixels in prompt
order and the positions of every placeholder token. Position `positions[i]` takes row `i % tokens_per_tile`
of tile `i // tokens_per_tile`'s encoding (`EncodedTiles` computes and keeps what a prefill chunk needs).

Two prompts with the same tokens but different images have different KV, so the tiles' content enters the
block names: a block's hash also covers the digest of every tile whose first placeholder lies in it
(`block_keys`), and the chain carries it to every later block.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import hashlib
from bisect import bisect_left
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from deepinfer.kvcache.host import ByteLRU

DIGEST_SIZE = 16


def _plain(t: torch.Tensor) -> torch.Tensor:
    """On the CPU, in a dtype numpy has (bfloat16 widens to float32, exactly)."""
    t = t.detach().cpu()
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def tile_digest(pixels: torch.Tensor, mask: torch.Tensor | None) -> bytes:
    """A tile's name: BLAKE2b of its float32 pixels (and its pixel mask, if it has padding)."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    h.update(str(tuple(pixels.shape)).encode())
    h.update(pixels.to(torch.float32).contiguous().numpy().tobytes())
    if mask is not None and not bool(mask.all()):
        h.update(mask.to(torch.uint8).contiguous().numpy().tobytes())
    return h.digest()


_TENSORS = ("pixel_values", "pixel_mask", "embeddings")


@dataclass(frozen=True)
class MultiModalInputs:
    """`pixel_values` [tiles, C, H, W] (float32, the processor's output) and `pixel_mask` [tiles, H, W]
    (True where the image is; None: no padding), or the tiles already encoded, `embeddings` [tiles,
    tokens_per_tile, hidden] (an encode worker's output: the engine then runs no vision tower); `positions`: the
    prompt positions of the placeholder tokens, ascending, `tokens_per_tile` per tile; `num_images`: how many
    images the tiles came from; `tile_hashes`: each tile's digest (computed from the pixels when not given)."""

    pixel_values: torch.Tensor | None
    pixel_mask: torch.Tensor | None
    positions: tuple[int, ...]
    tokens_per_tile: int
    num_images: int = 1
    tile_hashes: tuple[bytes, ...] = field(default=())
    embeddings: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.pixel_values is None and self.embeddings is None:
            raise ValueError("image inputs need their pixels or their embeddings")
        if not self.tile_hashes:
            if self.pixel_values is None:
                raise ValueError("encoded image inputs need their tiles' digests")
            masks = [None] * self.num_tiles if self.pixel_mask is None else list(self.pixel_mask)
            object.__setattr__(self, "tile_hashes", tuple(tile_digest(p, m) for p, m in zip(
                self.pixel_values, masks, strict=True)))
        if len(self.tile_hashes) != self.num_tiles:
            raise ValueError(f"{len(self.tile_hashes)} tile digests for {self.num_tiles} tiles")

    def __getstate__(self) -> dict:
        # plain arrays across a process pipe: a tensor would go through torch's shared-memory reduction
        state = dict(self.__dict__)
        for name in _TENSORS:
            if state[name] is not None:
                state[name] = _plain(state[name]).numpy()
        return state

    def __setstate__(self, state: dict) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, torch.from_numpy(value) if key in _TENSORS and value is not None else value)

    def encoded(self, embeddings: torch.Tensor) -> MultiModalInputs:
        """These inputs with their tiles' embeddings instead of their pixels."""
        if embeddings.shape[:2] != (self.num_tiles, self.tokens_per_tile):
            raise ValueError(f"embeddings of shape {tuple(embeddings.shape)} for {self.num_tiles} tiles of "
                             f"{self.tokens_per_tile} tokens")
        return dataclasses.replace(self, pixel_values=None, pixel_mask=None, embeddings=embeddings)

    def to_wire(self) -> dict[str, Any]:
        """A JSON-able form (arrays as base64 of their bytes), for the cluster's HTTP calls."""
        body: dict[str, Any] = {"positions": list(self.positions), "tokens_per_tile": self.tokens_per_tile,
                                "num_images": self.num_images, "tile_hashes": [h.hex() for h in self.tile_hashes]}
        for name in _TENSORS:
            t = getattr(self, name)
            if t is not None:
                a = _plain(t).contiguous().numpy()
                body[name] = {"dtype": str(a.dtype), "shape": list(a.shape),
                              "data": base64.b64encode(a.tobytes()).decode()}
        return body

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> MultiModalInputs:
        """`to_wire`'s inverse; ValueError for a malformed body."""
        try:
            arrays = {}
            for name in _TENSORS:
                spec = body.get(name)
                if spec is not None:
                    if spec["dtype"] not in ("float32", "bool"):
                        raise ValueError(f"{name}: dtype {spec['dtype']!r}")
                    a = np.frombuffer(base64.b64decode(spec["data"], validate=True), dtype=spec["dtype"])
                    arrays[name] = torch.from_numpy(a.reshape(spec["shape"]).copy())
            return cls(arrays.get("pixel_values"), arrays.get("pixel_mask"), tuple(int(p) for p in body["positions"]),
                       int(body["tokens_per_tile"]), int(body.get("num_images", 1)),
                       tuple(bytes.fromhex(h) for h in body["tile_hashes"]), arrays.get("embeddings"))
        except (KeyError, TypeError, ValueError, binascii.Error) as e:
            raise ValueError(f"malformed image inputs: {e}") from e

    @property
    def num_tiles(self) -> int:
        return int((self.pixel_values if self.pixel_values is not None else self.embeddings).shape[0])

    def check(self, prompt_token_ids: list[int], image_token_id: int, tokens_per_tile: int) -> None:
        """Raise ValueError unless these inputs fit the prompt and the model."""
        if tokens_per_tile != self.tokens_per_tile:
            raise ValueError(f"the model encodes a tile as {tokens_per_tile} tokens, the inputs say "
                             f"{self.tokens_per_tile}")
        if len(self.positions) != self.num_tiles * tokens_per_tile:
            raise ValueError(f"{self.num_tiles} image tiles need {self.num_tiles * tokens_per_tile} image tokens "
                             f"in the prompt, it has {len(self.positions)}")
        expected = [i for i, t in enumerate(prompt_token_ids) if t == image_token_id]
        if list(self.positions) != expected:
            raise ValueError("the image tokens' positions do not match the prompt's image tokens")

    def block_keys(self, block_size: int) -> dict[int, bytes]:
        """Block index -> the digests of the tiles whose first placeholder token is in that block."""
        keys: dict[int, bytes] = {}
        for t, digest in enumerate(self.tile_hashes):
            block = self.positions[t * self.tokens_per_tile] // block_size
            keys[block] = keys.get(block, b"") + digest
        return keys

    def tile_last_positions(self) -> tuple[int, ...]:
        """Each tile's last placeholder position, in tile order."""
        per = self.tokens_per_tile
        return self.positions[per - 1::per]

    def tiles_to_encode(self, start: int, *cached: Container[bytes]) -> int:
        """How many tiles a prefill from prompt position `start` still has to run through the vision tower: those
        whose last placeholder is at or after `start` (the ones before lie in KV already computed or found),
        less those encoded elsewhere (`embeddings`) or named in any of `cached` (the runner's tile cache, a
        request's tiles held encoded). A tile whose placeholders straddle `start` counts: a chunk that starts
        inside it needs all of it."""
        if self.embeddings is not None:
            return 0
        return sum(1 for last, digest in zip(self.tile_last_positions(), self.tile_hashes, strict=True)
                   if last >= start and not any(digest in c for c in cached))

    @functools.cached_property
    def runs(self) -> tuple[tuple[int, int], ...]:
        """The placeholders' maximal runs of consecutive positions, as (first, last) positions in prompt order
        (what Gemma 3 lets attend to itself both ways)."""
        runs: list[tuple[int, int]] = []
        for p in self.positions:
            if runs and runs[-1][1] == p - 1:
                runs[-1] = (runs[-1][0], p)
            else:
                runs.append((p, p))
        return tuple(runs)

    def run_cut(self, start: int, end: int) -> tuple[int, int] | None:
        """The run that a chunk of positions [start, end) ends inside of (it holds end - 1 and goes on past it),
        None if the chunk ends at a run's end or outside every run."""
        for first, last in self.runs:
            if first < end <= last:
                return first, last
            if first >= end:
                break
        return None

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The placeholder ordinals [a, b) whose positions are in [start, end)."""
        return bisect_left(self.positions, start), bisect_left(self.positions, end)


class EncodedTiles:
    """A request's encoded tiles while its prefill needs them: encoded when a chunk first covers one of a
    tile's placeholders, dropped once a chunk has covered its last."""

    def __init__(self, inputs: MultiModalInputs) -> None:
        self.inputs = inputs
        self.tiles: dict[int, torch.Tensor] = {}

    def held_digests(self) -> set[bytes]:
        """The digests of the tiles held encoded (a chunk has reached them and not yet passed them)."""
        return {self.inputs.tile_hashes[t] for t in self.tiles}

    def rows(self, a: int, b: int, encode: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
             cache: ByteLRU | None = None) -> torch.Tensor:
        """The embeddings of placeholder ordinals [a, b) ([b - a, hidden]), encoding the tiles neither held
        nor in `cache` (in one call; put there) and dropping those whose last placeholder is before b."""
        mm, per = self.inputs, self.inputs.tokens_per_tile
        if mm.embeddings is not None:  # encoded elsewhere (an encode worker)
            return mm.embeddings.reshape(-1, mm.embeddings.shape[-1])[a:b]
        first, last = a // per, (b - 1) // per
        missing = []
        for t in range(first, last + 1):
            if t not in self.tiles:
                cached = cache.get(mm.tile_hashes[t]) if cache is not None else None
                if cached is None:
                    missing.append(t)
                else:
                    self.tiles[t] = cached
        if missing:
            idx = torch.tensor(missing)
            mask = None if mm.pixel_mask is None else mm.pixel_mask[idx]
            for t, emb in zip(missing, encode(mm.pixel_values[idx], mask), strict=True):
                self.tiles[t] = emb
                if cache is not None:
                    cache.insert(mm.tile_hashes[t], emb)
        out = torch.cat([self.tiles[t] for t in range(first, last + 1)])[a - first * per:b - first * per]
        for t in range(first, last + 1):
            if (t + 1) * per <= b:
                del self.tiles[t]
        return out
