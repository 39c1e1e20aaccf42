"""Bytes the KV store keeps per prompt token: DeepSeek-V4 (compressed entries only) vs a dense model of the
same width (hidden size and layers) storing every layer's full K and V.

Two parts, both through deepinfer's own code (`kvcache/blocks.py` decides what a chain position holds):

* **layout** -- the tier payload of a real-size config (transformers' `DeepseekV4Config()` defaults,
  DeepSeek-V4-Flash: hidden 4096, 43 layers, head_dim 512, CSA ratio 4 with 128-wide indexer keys, HCA
  ratio 128), the model and caches built on the meta device (no weights, no memory): bytes per token =
  the payload of a stride of positions / its tokens. Dense comparators: MHA (K/V width = hidden) and
  GQA with 8 KV heads of 128 (Llama-3-8B-like), same layer count, same dtype.
* **measured** -- small random models run by the engine with a store in a temp directory: payload bytes
  (and file bytes, headers included) of every segment written for one prompt, per stored token.

    PYTHONPATH=. python3 benchmarks/v4_store_bytes.py [--dtype bfloat16] [--block-size 16] [--tokens 512]
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

import torch

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
_DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def v4_layout_bytes_per_token(cfg, block_size: int, dtype: torch.dtype) -> tuple[float, str]:
    """Tier payload bytes per token of `cfg` (built on the meta device) and the layout key."""
    from deepinfer.kvcache.blocks import TierBlocks
    from deepinfer.kvcache.manager import whole_sequence
    from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM

    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg, None, 4096, dtype)
    counts = [2] * len(model.kv_groups)
    caches = model.allocate_kv_caches(counts, block_size, dtype, torch.device("meta"))
    groups = [i for i, g in enumerate(model.kv_groups) if whole_sequence(g.spec)]
    strides = [model.kv_groups[i].spec.tokens_per_block(block_size) // block_size for i in groups]
    tb = TierBlocks.positional(groups, strides, [model.group_tensors(caches, i) for i in groups], block_size)
    period = math.lcm(*strides)
    return tb.layout.run_nbytes(0, period) / (period * block_size), tb.layout.key


def dense_bytes_per_token(layers: int, kv_width: int, dtype: torch.dtype) -> int:
    return 2 * layers * kv_width * torch.tensor([], dtype=dtype).element_size()


def layout_part(dtype_name: str, block_size: int) -> None:
    from transformers import DeepseekV4Config

    dtype = _DT[dtype_name]
    cfg = DeepseekV4Config()
    types = list(cfg.layer_types)
    v4, key = v4_layout_bytes_per_token(cfg, block_size, dtype)
    mha = dense_bytes_per_token(cfg.num_hidden_layers, cfg.hidden_size, dtype)
    gqa = dense_bytes_per_token(cfg.num_hidden_layers, 8 * 128, dtype)
    print(f"layout, {dtype_name}, block size {block_size}: DeepseekV4Config() defaults, hidden {cfg.hidden_size}, "
          f"{cfg.num_hidden_layers} layers ({types.count(CSA)} CSA, {types.count(HCA)} HCA, {types.count(SWA)} SWA), "
          f"head_dim {cfg.head_dim}, index_head_dim {cfg.index_head_dim}, ratios {dict(cfg.compress_rates)}")
    print(f"  V4 stored (compressed entries + indexer keys): {v4:10.1f} B/token   key {key[:60]}...")
    print(f"  dense MHA, K/V width {cfg.hidden_size}:            {mha:10.1f} B/token   ({mha / v4:.1f}x V4)")
    print(f"  dense GQA, 8 KV heads x 128:            {gqa:10.1f} B/token   ({gqa / v4:.1f}x V4)")


def _store_bytes(model_dir: Path, tokens: int, block_size: int, dtype: str) -> tuple[int, int, int]:
    """(payload bytes, file bytes, stored tokens) of the segments one prompt of `tokens` leaves in a store."""
    import random

    from deepinfer import LLM, SamplingParams
    from deepinfer.kvcache.space import iter_files, read_header

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as store:
        with LLM(str(model_dir), dtype=dtype, block_size=block_size, kv_store=store, profile_cost_model=False,
                 kv_cache_memory="64MiB") as llm:
            vocab = llm.engine.core.hf_config.vocab_size
            prompt = [rng.randrange(3, vocab) for _ in range(tokens)]
            llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1))
        payload = files = blocks = 0
        for e in iter_files(Path(store)):
            if e.tmp:
                continue
            with open(e.path, "rb") as f:
                hdr = read_header(f)
            payload += hdr.payload_len
            files += os.path.getsize(e.path)
            blocks += hdr.nblocks
    return payload, files, blocks * block_size


def measured_part(tokens: int, block_size: int, dtype: str, work: Path) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from deepinfer.weights import resolve_model
    from tests.models.v4_tiny import build_v4

    tok_dir = resolve_model(None).directory
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    hidden, layers, head_dim = 256, 4, 64
    v4_dir, dense_dir = work / "v4", work / "dense"
    build_v4(v4_dir, seed=0, tokenizer_dir=tok_dir, hidden_size=hidden, num_hidden_layers=layers,
             layer_types=[CSA, HCA, CSA, HCA], mlp_layer_types=["moe"] * layers, head_dim=head_dim,
             num_attention_heads=4, q_lora_rank=64, index_head_dim=32, index_n_heads=4, index_topk=4,
             sliding_window=32, compress_rates={CSA: 4, HCA: 2 * block_size}, o_lora_rank=32)
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // head_dim,
                      num_key_value_heads=hidden // head_dim, head_dim=head_dim, intermediate_size=512,
                      vocab_size=len(tok), max_position_embeddings=4096, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(dense_dir)
    tok.save_pretrained(dense_dir)
    print(f"measured, {dtype}, block size {block_size}, one {tokens}-token prompt: hidden {hidden}, {layers} layers "
          f"(V4: CSA ratio 4 + index keys 32, HCA ratio {2 * block_size}, head_dim {head_dim}; dense: MHA, K/V "
          f"width {hidden})")
    results = {}
    for name, path in (("V4", v4_dir), ("dense", dense_dir)):
        payload, files, stored = _store_bytes(path, tokens, block_size, dtype)
        results[name] = payload / stored
        print(f"  {name:5s}: {stored} tokens stored, {payload / stored:8.1f} payload B/token, "
              f"{files / stored:8.1f} file B/token (headers included)")
    print(f"  dense / V4 payload: {results['dense'] / results['V4']:.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(_DT))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--measured-dtype", default="float32", choices=sorted(_DT))
    ap.add_argument("--skip-measured", action="store_true")
    args = ap.parse_args()
    layout_part(args.dtype, args.block_size)
    if not args.skip_measured:
        with tempfile.TemporaryDirectory() as work:
            measured_part(args.tokens, args.block_size, args.measured_dtype, Path(work))


if __name__ == "__main__":
    main()
