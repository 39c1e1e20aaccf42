"""Engine memory over many batch shapes: RSS of an in-process engine every 10 rounds.

Each round generates for 1-12 random prompts of 5-400 words and 2-20 greedy tokens (seeded, so two
runs see the same shapes). Run it twice to split what grows, e.g. with oneDNN's primitive cache off:

    python benchmarks/engine_memory.py --rounds 60
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 python benchmarks/engine_memory.py --rounds 60
"""

from __future__ import annotations

import argparse
import random
import time

import psutil

from deepinfer import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    llm = LLM(None, kv_cache_memory="256MiB", profile_cost_model=False)
    proc = psutil.Process()
    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "ships", "sail", "north"]
    started = time.time()
    for r in range(args.rounds):
        prompts = [" ".join(rng.choices(words, k=rng.randint(5, 400))) for _ in range(rng.randint(1, 12))]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=rng.randint(2, 20)))
        if r % 10 == 0 or r == args.rounds - 1:
            print(f"round {r}: RSS {proc.memory_info().rss / 2**20:.0f} MiB, {time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
