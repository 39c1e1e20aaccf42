"""DeepSeek-V4's forward (one step over fresh paged caches) against transformers' uncached full forward."""

from __future__ import annotations

import pytest
import torch

from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.weights.loader import resolve_model
from tests.models.v4_tiny import CSA, HCA, SWA, build_v4, hf_full_logits

VARIANTS = {
    # every attention type, hash + sqrtsoftplus top-k MoE, two streams; 7 CSA groups, 4 HCA groups, window 6
    "mixed": dict(),
    # sigmoid scoring, three streams, HCA first, a wider window than the first groups
    "sigmoid_hc3": dict(scoring_func="sigmoid", hc_mult=3, layer_types=[HCA, CSA, SWA], sliding_window=10,
                        compress_rates={CSA: 4, HCA: 16}),
    # softmax scoring, YaRN on the compressed branches, the indexer keeping more than there are entries
    "softmax_yarn": dict(scoring_func="softmax", index_topk=64, max_position_embeddings=128,
                         rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    # sliding-only layers and one stream
    "sliding_only": dict(layer_types=[SWA, SWA], mlp_layer_types=["hash_moe", "moe"], num_hidden_layers=2,
                         hc_mult=1),
    # CSA only, top-3 of many entries, more indexer heads
    "csa_topk": dict(layer_types=[CSA, CSA], mlp_layer_types=["moe", "moe"], num_hidden_layers=2, index_topk=3,
                     index_n_heads=6),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4")
    out = {}
    for i, (name, over) in enumerate(VARIANTS.items()):
        hf = build_v4(root / name, seed=i, **over)
        ours = DeepseekV4ForCausalLM(hf.config, None, 4096, torch.float32)
        ours.load_weights(resolve_model(root / name).iter_weights(torch.float32))
        out[name] = (hf, ours.eval())
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_full_forward_matches_transformers(checkpoints, name):
    hf, ours = checkpoints[name]
    torch.manual_seed(100)
    ids = torch.randint(0, hf.config.vocab_size, (53,))
    ref = hf_full_logits(hf, ids.tolist())
    got = ours.full_logits(ids)
    assert (ref - got).abs().max().item() < 2e-5


@pytest.mark.parametrize("block_size", [4, 16])
def test_block_size_and_prefixes(checkpoints, block_size):
    """Any block size gives the same logits; a prefix's logits are the full sequence's first rows."""
    hf, ours = checkpoints["mixed"]
    ids = torch.randint(0, hf.config.vocab_size, (37,), generator=torch.Generator().manual_seed(7))
    full = ours.full_logits(ids, block_size=block_size)
    assert (full - hf_full_logits(hf, ids.tolist())).abs().max().item() < 2e-5
    for n in (1, 8, 9, 24):
        assert (ours.full_logits(ids[:n], block_size=block_size) - full[:n]).abs().max().item() < 2e-5


def test_compressed_branches_matter(checkpoints):
    """The comparison is only meaningful if the compressed entries change the logits."""
    hf, ours = checkpoints["mixed"]
    ids = torch.randint(0, hf.config.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    before = ours.full_logits(ids)
    saved = {}
    for i, layer in enumerate(ours.layers):
        if layer.attn.compressor is not None:
            saved[i] = layer.attn.compressor.wkv.weight.detach().clone()
            layer.attn.compressor.wkv.weight.data.zero_()
    try:
        after = ours.full_logits(ids)
    finally:
        for i, w in saved.items():
            ours.layers[i].attn.compressor.wkv.weight.data.copy_(w)
    assert (before[:3] - after[:3]).abs().max().item() == 0  # no group complete yet
    assert (before[10:] - after[10:]).abs().max().item() > 1e-3


def test_rejects_unknown_tensor(tmp_path):
    hf = build_v4(tmp_path / "m")
    ours = DeepseekV4ForCausalLM(hf.config, None, 4096, torch.float32)
    weights = list(resolve_model(tmp_path / "m").iter_weights(torch.float32))
    with pytest.raises(ValueError, match="no matching parameter"):
        ours.load_weights([*weights, ("model.layers.0.attn.bogus.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="3 of 4 expert tensors"):
        ours.load_weights([w for w in weights if "experts.1.w2" not in w[0]])
