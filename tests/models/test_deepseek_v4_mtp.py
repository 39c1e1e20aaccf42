"""DeepSeek-V4's MTP layer (deepinfer/models/deepseek_v4/mtp.py) on a tiny random checkpoint.

What is checked against something external: the block and head are the V4 modules checked against
transformers in test_deepseek_v4.py, and the block here is shown to compute exactly what the target's own
(transformers-verified) sliding-window MoE layer computes when given its weights. The MTP wiring (norms,
projections, shared embedding / head) has no external implementation to compare with (transformers
drops `mtp.*` tensors); it is checked against the formula of DeepSeek's reference code, written out in
the test, and for self-consistency: one-shot, chunked and token-by-token runs over the paged window
cache, past the sliding window, give the same logits."""

from __future__ import annotations

import pytest
import torch

from deepinfer.layers.attention import AttentionBatch
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.models.deepseek_v4.compressor import rms_norm
from deepinfer.models.deepseek_v4.mtp import V4MTPLayer
from deepinfer.weights.loader import resolve_model
from tests.models.v4_mtp_tiny import build_v4_with_mtp


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny V4 whose checkpoint also holds `mtp.0.*`: the block's tensors are layer 1's (as published
    checkpoints name them) and the MTP's own ones random."""
    path = tmp_path_factory.mktemp("v4mtp") / "m"
    hf, mtp = build_v4_with_mtp(path)
    files = resolve_model(path)
    target = DeepseekV4ForCausalLM(hf.config, None, 4096, torch.float32)
    target.load_weights(files.iter_weights(torch.float32))  # skips mtp.*
    layer = V4MTPLayer(hf.config)
    assert layer.load_weights(files.iter_weights(torch.float32)) > 0  # raises if one is missing
    return target.eval(), layer.eval(), mtp


def _streams(target: DeepseekV4ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The target's last residual streams at every position (one step over fresh caches)."""
    target.keep_streams = True
    try:
        target.full_logits(ids)
        return target.step_streams
    finally:
        target.keep_streams = False


def _run(layer: V4MTPLayer, target, streams, next_ids, chunks: list[int], block_size: int = 4) -> torch.Tensor:
    """The MTP layer over positions 0..n-1 in steps of `chunks` tokens, through one paged window cache."""
    n = streams.shape[0]
    blocks = -(-n // block_size) + 1
    cache = layer.allocate_cache(blocks, block_size, torch.float32, torch.device("cpu"))
    table = list(range(blocks))
    out, start = [], 0
    for c in chunks:
        end = start + c
        batch = AttentionBatch([c], [end], [table], int(c == 1), torch.zeros(0, dtype=torch.long), block_size)
        pos = torch.arange(start, end)
        logits, _ = layer(streams[start:end], next_ids[start:end], pos, target, cache, layer.prepare(batch, pos.device))
        out.append(logits)
        start = end
    return torch.cat(out)


@torch.inference_mode()
def test_mtp_chunked_and_incremental_match_one_shot(checkpoint):
    target, layer, _ = checkpoint
    ids = torch.randint(0, target.config.vocab_size, (21,), generator=torch.Generator().manual_seed(1))
    streams = _streams(target, ids[:-1])  # position i's streams with token i + 1: 20 positions, window 6
    one = _run(layer, target, streams, ids[1:], [20])
    assert one.shape == (20, target.config.vocab_size)
    for chunks in ([1] * 20, [7, 5, 1, 1, 6], [3, 17]):
        assert (_run(layer, target, streams, ids[1:], chunks) - one).abs().max().item() < 1e-4


@torch.inference_mode()
def test_mtp_block_is_the_targets_layer_kind_and_follows_the_reference_formula(checkpoint):
    """With layer 1's weights the MTP block computes what the target's layer 1 computes; the MTP logits
    are the reference's head(norm(hc_head(Block(e_proj(enorm(emb)) + h_proj(hnorm(h)))))) written out."""
    target, layer, mtp = checkpoint
    n = 9
    ids = torch.randint(0, target.config.vocab_size, (n + 1,), generator=torch.Generator().manual_seed(2))
    streams = _streams(target, ids[:-1])
    got = _run(layer, target, streams, ids[1:], [n])
    eps = target.config.rms_norm_eps
    e = rms_norm(target.embed_tokens(ids[1:]), mtp["mtp.0.enorm.weight"], eps)
    h = rms_norm(streams, mtp["mtp.0.hnorm.weight"], eps)
    x = e @ mtp["mtp.0.e_proj.weight"].T
    x = x.unsqueeze(1) + h @ mtp["mtp.0.h_proj.weight"].T
    # the target's layer 1 on x, over its own fresh window cache
    blocks = -(-n // 4) + 1
    cache = {"window": torch.zeros(blocks, 4, target.layers[1].attn.head_dim)}
    batch = AttentionBatch([n], [n], [list(range(blocks))], 0, torch.zeros(0, dtype=torch.long), 4)
    pos = torch.arange(n)
    rope = {label: r(pos) for label, r in target.ropes.items()}
    x = target.layers[1](x, ids[1:], rope, target.ropes, cache, layer.prepare(batch, pos.device))
    pre = torch.sigmoid(
        (torch.nn.functional.linear(x.flatten(1) * torch.rsqrt(x.flatten(1).square().mean(-1, keepdim=True) + eps),
                                    mtp["mtp.0.hc_head_fn"])) * mtp["mtp.0.hc_head_scale"] + mtp["mtp.0.hc_head_base"]
    ) + target.config.hc_eps
    y = (pre.unsqueeze(-1) * x).sum(1)
    want = rms_norm(y, mtp["mtp.0.norm.weight"], eps) @ target.lm_head.weight.T
    assert (got - want).abs().max().item() < 1e-4


def test_mtp_checkpoint_errors(checkpoint, tmp_path):
    target, layer, mtp = checkpoint
    fresh = V4MTPLayer(target.config)
    assert fresh.load_weights(iter([("layers.0.attn_norm.weight", torch.ones(1))])) == 0  # no MTP layer
    partial = [(k, v) for k, v in mtp.items() if k != "mtp.0.e_proj.weight"]
    with pytest.raises(ValueError, match="missing"):
        fresh.load_weights(iter(partial))
    with pytest.raises(ValueError, match="no matching MTP parameter"):
        fresh.load_weights(iter([*mtp.items(), ("mtp.0.bogus.weight", torch.ones(2))]))
