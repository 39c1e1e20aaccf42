"""CPU milliseconds per generated token of no speculation, k = 5 and the adaptive draft length, at batch 1.

`spec.py` reports each engine's speed as a ratio to no speculation within one build; when a change speeds
up the plain decode step as well as the verify step, that ratio hides it. This prints the absolute CPU
time per token (`time.process_time`, the three engines in one process with `--num-threads` torch threads)
on `spec.py`'s code_edit prompts (each of the four snippets, greedy, `--max-tokens`), median over
`--repeats` x 4 runs, so two builds can be compared by running it with PYTHONPATH pointing at each tree,
interleaved::

    OMP_NUM_THREADS=1 PYTHONPATH=. python3 benchmarks/spec_cpu.py --repeats 3
    OMP_NUM_THREADS=1 PYTHONPATH=/path/to/base python3 benchmarks/spec_cpu.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))  # spec.py's prompts and timing, whichever tree is on PYTHONPATH

import spec  # noqa: E402

import deepinfer  # noqa: E402
from deepinfer import LLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-threads", type=int, default=1)
    args = ap.parse_args()
    common = dict(kv_cache_memory="768MiB", max_num_seqs=1, num_threads=args.num_threads)
    configs = {"none": None, "k5": {"method": "ngram", "num_speculative_tokens": 5, "adaptive": False},
               "adaptive": {"method": "ngram", "num_speculative_tokens": 16, "adaptive": True}}
    engines = {name: LLM(None, speculative_config=cfg, **common) for name, cfg in configs.items()}
    for llm in engines.values():  # warm-up outside the measurement
        spec.run_once(llm, ["Hello"], 4)
    ms: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for i in range(len(spec.SNIPPETS)):
            prompt = [{"prompt": spec.code_edit_prompt(i)}]
            for name, llm in engines.items():
                _, tokens_per_cpu_second, _, _ = spec.run_once(llm, prompt, args.max_tokens)
                ms[name].append(1e3 / tokens_per_cpu_second)
    med = {name: statistics.median(v) for name, v in ms.items()}
    print(f"deepinfer from {deepinfer.__file__}: CPU ms per token  "
          + "  ".join(f"{name} {v:.2f}" for name, v in med.items())
          + f"  | none / k5 {med['none'] / med['k5']:.2f}  none / adaptive {med['none'] / med['adaptive']:.2f}")
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
