"""SigLIP's vision transformer, as the vision-language models here use it without its pooling head.

Patches are embedded by a strided convolution, each gets a learned position, bidirectional pre-norm encoder
layers (LayerNorm, attention with biases, a GELU MLP) follow, and a final LayerNorm. Idefics3 / SmolVLM pass
a patch mask for tiles the processor padded: padded patches are no keys for attention, and the kept ones get
positions bucketed over the kept region's fraction of the tile, as transformers' Idefics3 does, so a padded
tile encodes like the same tile alone. Gemma 3 passes none: every patch, positions in patch order, as
transformers' SiglipVisionModel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VisionEmbeddings(nn.Module):
    def __init__(self, vcfg) -> None:
        super().__init__()
        self.patch_size = vcfg.patch_size
        self.side = vcfg.image_size // vcfg.patch_size  # patches per side of a full tile
        self.patch_embedding = nn.Conv2d(vcfg.num_channels, vcfg.hidden_size, vcfg.patch_size, vcfg.patch_size)
        self.position_embedding = nn.Embedding(self.side * self.side, vcfg.hidden_size)

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor | None) -> torch.Tensor:
        """pixels [tiles, C, H, W], patch_mask [tiles, H / p, W / p] (bool; None: whole tiles, positions in
        patch order) -> [tiles, patches, hidden]."""
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if patch_mask is None:
            return x + self.position_embedding.weight[:x.shape[1]]
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

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor | None = None) -> torch.Tensor:
        """pixels [tiles, C, H, W] -> the last layer's outputs, normed [tiles, patches, hidden]; `patch_mask`
        (Idefics3's padded tiles): False patches are no keys and positions are bucketed over the kept ones."""
        x = self.embeddings(pixels, patch_mask)
        key_mask = None if patch_mask is None or bool(patch_mask.all()) else \
            patch_mask.reshape(patch_mask.shape[0], -1)
        for layer in self.encoder.layers:
            x = layer(x, key_mask)
        return self.post_layernorm(x)
