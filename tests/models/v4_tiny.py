"""Tiny random DeepSeek-V4 checkpoints (transformers' model, saved with save_pretrained) for the tests."""

from __future__ import annotations

from pathlib import Path

import torch

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

BASE = dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
            head_dim=16, q_lora_rank=12, num_experts_per_tok=2, n_routed_experts=4, layer_types=[SWA, CSA, HCA],
            mlp_layer_types=["hash_moe", "moe", "moe"], compress_rates={CSA: 4, HCA: 8}, hc_mult=2,
            hc_sinkhorn_iters=6, sliding_window=6, o_groups=2, o_lora_rank=8, index_n_heads=4, index_head_dim=8,
            index_topk=2, partial_rotary_factor=0.25, max_position_embeddings=4096, bos_token_id=0,
            eos_token_id=1)


def allow_softmax_scoring() -> None:
    """transformers' router looks its scoring function up in ACT2FN, which has no "softmax" (see
    docs/deepseek_v4.md): register one so the reference can be built with scoring_func="softmax"."""
    from torch import nn
    from transformers import activations

    class _Softmax(nn.Module):
        def forward(self, x):
            return x.softmax(dim=-1)

    if "softmax" not in activations.ACT2FN:
        activations.ACT2FN["softmax"] = _Softmax  # ClassInstantier instantiates the class on lookup


def build_v4(path: Path | None = None, seed: int = 0, tokenizer_dir: Path | None = None, **overrides):
    """A random V4 (every weight ~N(0, 0.3^2), a random hash table), saved to `path` if given."""
    from transformers import AutoTokenizer, DeepseekV4Config, DeepseekV4ForCausalLM

    spec = {**BASE, **overrides}
    tok = None
    if tokenizer_dir is not None:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        spec.update(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if spec.get("scoring_func") == "softmax":
        allow_softmax_scoring()
    cfg = DeepseekV4Config(**spec)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        for layer in model.model.layers:
            if layer.mlp.is_hash:
                table = layer.mlp.gate.tid2eid
                table.copy_(torch.randint(0, cfg.n_routed_experts, table.shape))
            else:
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(torch.randn_like(bias) * 0.1)
    if path is not None:
        model.save_pretrained(path)
        if tok is not None:
            tok.save_pretrained(path)
    return model


def hf_full_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' uncached full forward: the reference (see docs/deepseek_v4.md)."""
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()
