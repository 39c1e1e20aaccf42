"""MoE decode on a GGUF file: routed experts multiplying their quantized blocks vs their dequantized weights.

One GGUF file (a random Qwen3-MoE written by `tests/models/gguf_moe_tiny.py`'s writer: hidden 768, 8 layers,
all sparse, 32 experts of intermediate 512, top-4, 12 heads of 64, the default model's 49152-token vocabulary;
~390M parameters, 302M of them routed experts; projections, experts and LM head Q8_0 or Q4_1, the embedding
float32), three configurations side by side in one run:

- `experts-q`: `gguf_kernels=on`, every projection and every expert slot on its blocks (the new path);
- `experts-dense`: the same engine with the experts' blocks detached (attention and LM head still on
  blocks): isolates the experts' part;
- `off`: `gguf_kernels=off`, everything dense (what an MoE GGUF got before).

The workload: batch B of short random prompts (4 tokens), `--max-tokens` greedy tokens each (ignore_eos),
through `LLM.generate`; the time per decode step is the wall time / max_tokens (the one prefill step of
4 * B tokens is included, ~1/max_tokens of the total). Configurations interleave (q, dense, off, then
off, dense, q: ABBA) for `--rounds` rounds; medians are printed, with the ratios to `experts-q`.

Memory-bound fraction (printed per configuration): the weight bytes one decode step reads (attention
projections and LM head in the configuration's format, the expected distinct experts of B tokens under
uniform top-k routing, E * (1 - (1 - k/E)^B), times one expert's bytes) / step time, over the machine's read
bandwidth measured in the same run (sum over a 1 GiB float32 tensor, best of 3, with the same threads).

Threads: one by default. On a machine other jobs load, two OpenMP threads wait for each other at every
parallel region (see the thread-governor section of BENCHMARKS.md): a first run with 2 threads measured
~10x slower steps for every configuration, which measures the contention, not the weights.

Run: PYTHONPATH=. python3 benchmarks/moe_gguf.py [--quant q8_0] [--batches 1 8] [--rounds 3] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

SPEC = dict(hidden_size=768, intermediate_size=1024, moe_intermediate_size=512, num_experts=32, num_experts_per_tok=4,
            num_attention_heads=12, num_key_value_heads=4, head_dim=64, num_hidden_layers=8)
BLOCK_BYTES = {"q8_0": 34 / 32, "q4_1": 20 / 32}  # bytes per weight


def read_bandwidth(threads: int) -> float:
    """Bytes/s of a sum over 1 GiB of float32 (best of 3)."""
    torch.set_num_threads(threads)
    t = torch.ones(1 << 28)
    best = 0.0
    for _ in range(3):
        started = time.perf_counter()
        t.sum()
        best = max(best, t.numel() * 4 / (time.perf_counter() - started))
    return best


def step_bytes(config: str, batch: int, quant: str, vocab: int) -> float:
    h, i_moe, e, k = (SPEC[n] for n in ("hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok"))
    q = SPEC["num_attention_heads"] * SPEC["head_dim"]
    kv = SPEC["num_key_value_heads"] * SPEC["head_dim"]
    attn = h * (q + 2 * kv) + q * h
    experts = e * (1 - (1 - k / e) ** batch) * 3 * h * i_moe
    blocks = BLOCK_BYTES[quant]
    dense_attn = config == "off"
    per_layer = attn * (4 if dense_attn else blocks) + experts * (blocks if config == "experts-q" else 4)
    return SPEC["num_hidden_layers"] * per_layer + vocab * h * (4 if dense_attn else blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quant", default="q8_0", choices=["q8_0", "q4_1"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--workdir", default=None, help="where to write the GGUF file (default: a temp dir)")
    args = ap.parse_args()

    from deepinfer import LLM, SamplingParams
    from tests.models.gguf_moe_tiny import write_qwen3_moe_gguf

    root = Path(args.workdir or tempfile.mkdtemp(prefix="moe-gguf-"))
    path = root / f"moe300m-{args.quant}.gguf"
    if not path.exists():
        started = time.perf_counter()
        write_qwen3_moe_gguf(path, args.quant, seed=0, **SPEC)
        print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - started:.0f}s")
    common = dict(dtype=args.dtype, kv_cache_memory="256MiB", profile_cost_model=False, num_threads=args.threads,
                  max_num_batched_tokens=256, enable_prefix_caching=False)
    on = LLM(str(path), gguf_kernels="on", **common)
    off = LLM(str(path), gguf_kernels="off", **common)
    experts = [layer.mlp.experts for layer in on.engine.core.runner.model.layers]
    blocks = [list(ex.quantized) for ex in experts]
    assert all(ex.num_quantized == SPEC["num_experts"] for ex in experts), "expert blocks not attached"
    vocab = on.engine.core.runner.model.config.vocab_size
    bandwidth = read_bandwidth(args.threads)

    def run(config: str, batch: int, seed: int) -> float:
        llm = off if config == "off" else on
        for ex, b in zip(experts, blocks, strict=True):
            ex.quantized = list(b) if config == "experts-q" else [None] * len(b)
        rng = random.Random(seed)
        prompts = [[rng.randrange(3, vocab) for _ in range(4)] for _ in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        calls = sum(ex.quantized_calls for ex in experts)
        started = time.perf_counter()
        llm.generate(prompts, params)
        seconds = (time.perf_counter() - started) / args.max_tokens
        used = sum(ex.quantized_calls for ex in experts) - calls
        if (used > 0) != (config == "experts-q"):
            raise RuntimeError(f"{config}: {used} expert matmuls on blocks")
        return seconds

    configs = ["experts-q", "experts-dense", "off"]
    load = os.getloadavg()[0]
    print(f"load average {load:.2f} ({'others compete for the cores' if load > 0.5 else 'quiet'}); "
          f"{args.threads} threads, {args.dtype}, {args.quant}, read bandwidth {bandwidth / 1e9:.1f} GB/s")
    for batch in args.batches:
        for c in configs:  # warm-up (oneDNN / kernel first calls)
            run(c, batch, 0)
        times: dict[str, list[float]] = {c: [] for c in configs}
        for r in range(args.rounds):
            for c in configs if r % 2 == 0 else configs[::-1]:
                times[c].append(run(c, batch, r + 1))
        base = statistics.median(times["experts-q"])
        print(f"\nbatch {batch}: ms per decode step (median of {args.rounds}; runs "
              + ", ".join(f"{c} {' '.join(f'{t * 1e3:.1f}' for t in times[c])}" for c in configs) + ")")
        print("| config | ms/step | x experts-q | GB/s read | memory-bound fraction |")
        print("| --- | --- | --- | --- | --- |")
        for c in configs:
            m = statistics.median(times[c])
            rate = step_bytes(c, batch, args.quant, vocab) / m
            print(f"| {c} | {m * 1e3:.2f} | {m / base:.2f} | {rate / 1e9:.1f} | {rate / bandwidth:.2f} |")
    on.close()
    off.close()


if __name__ == "__main__":
    main()
