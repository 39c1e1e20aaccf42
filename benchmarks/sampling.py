"""The sampler's cost per step: deepinfer's `Sampler` against the exponential race, side by side.

Baseline: the method deepinfer used before session 5, and the one vLLM's sampler uses: softmax,
a full descending sort when top-k / top-p is set, then argmax(p / E) with E ~ Exp(1) drawn for
every vocabulary entry. deepinfer draws one uniform per row (inverse CDF in a C kernel) and
finds top-k / top-p among the 256 most likely tokens when those hold the nucleus.

Synthetic logits (normal, times `scale`): scale 3 spreads the nucleus wider than 256 tokens
(the slow path), scale 8 keeps it inside (the usual case for a trained model). Medians over
--repeats calls, interleaved; the ratio is baseline / deepinfer.

    python benchmarks/sampling.py --vocab 49152 --batch 8,32,64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepinfer.engine.request import Request
from deepinfer.engine.sampler import Sampler
from deepinfer.engine.sampling_params import SamplingParams

CASES = {
    "temperature=1": dict(temperature=1.0),
    "temperature=0.7 top_p=0.9": dict(temperature=0.7, top_p=0.9),
    "top_k=50 top_p=0.95": dict(temperature=1.0, top_k=50, top_p=0.95),
    "temperature=1 seed": dict(temperature=1.0, seed=1),
}


def exponential_race(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_k > 0 or params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_p, dtype=torch.bool)
        if params.top_k > 0:
            drop[:, params.top_k:] = True
        drop |= sorted_p.cumsum(dim=-1) - sorted_p >= params.top_p
        drop[:, 0] = False
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p.masked_fill(drop, 0.0))
    noise = torch.empty_like(probs)
    if params.seed is not None:  # a seeded row draws its own noise
        for row in noise:
            row.exponential_(generator=gen)
    else:
        noise.exponential_(generator=gen)
    return (probs / noise).argmax(dim=-1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--batch", default="8,32,64")
    p.add_argument("--scales", default="3,8")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, vocab {args.vocab}")
    print("| logits scale | batch | sampling | exponential race ms | deepinfer ms | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    gen = torch.Generator().manual_seed(0)
    for scale in map(float, args.scales.split(",")):
        for batch in map(int, args.batch.split(",")):
            logits = torch.randn(batch, args.vocab, generator=gen) * scale
            for name, kw in CASES.items():
                params = SamplingParams(**kw)
                reqs = [Request(f"r{i}", [1], SamplingParams(**kw)) for i in range(batch)]
                sampler = Sampler()
                ours, base = [], []
                for _ in range(args.repeats + 1):  # the first round warms up
                    t = time.perf_counter()
                    exponential_race(logits, params, gen)
                    base.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    sampler(logits, reqs)
                    ours.append(time.perf_counter() - t)
                b, o = statistics.median(base[1:]) * 1e3, statistics.median(ours[1:]) * 1e3
                print(f"| {scale:g} | {batch} | {name} | {b:.2f} | {o:.2f} | {b / o:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
