"""What the output processor costs per token: detokenization, stop strings, logprob entries and the
per-step `RequestOutput`s, for N streams decoding together (the shape of a serving step).

It runs the real `OutputProcessor` with the default model's tokenizer on token deltas shaped like an
engine's (one token per stream per step), so the number is the processor's own CPU time, which does not
move with other load on the machine the way serving throughput does. Compare it with the server's CPU time
per output token that `benchmarks/serve_load.py` prints ("CPU ms/token frontend / engine"): that says how
much of a serving step the processor's placement (server or engine process) can move at most.

    python benchmarks/output_cost.py --streams 8 --tokens 64 --logprobs 0,5
"""

from __future__ import annotations

import argparse
import statistics
import time

from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine.outputs import TokenDelta
from deepinfer.engine.sampler import TokenLogprobs
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.recipe.tokenizer import load_tokenizer
from deepinfer.weights.loader import resolve_model

TEXT = ("The paged KV cache keeps each request's keys and values in fixed-size blocks; a block table maps a "
        "request's positions to them, so requests of any length share one pool without fragmentation. ") * 40


def run_once(tokenizer, ids: list[int], streams: int, tokens: int, logprobs: int | None) -> float:
    """Seconds of processor time per generated token (CPU time of this thread)."""
    proc = OutputProcessor(tokenizer, [tokenizer.eos_token_id], lambda seq, stop: None)
    for r in range(streams):
        proc.add_request(f"r{r}", None, ids[:150], SamplingParams(max_tokens=tokens, stop=["zzz"], logprobs=logprobs))
    started = time.process_time()
    for step in range(tokens):
        deltas = []
        for r in range(streams):
            token = ids[200 + (r * tokens + step) % (len(ids) - 200)]
            lps = [TokenLogprobs(-0.5, 1, [(token, -0.5)] + [(t, -2.0 - t % 7) for t in range(logprobs)])] \
                if logprobs is not None else None
            deltas.append(TokenDelta(f"r{r}", [token], lps, finish_reason="length" if step == tokens - 1 else None))
        proc.process(deltas)
    return (time.process_time() - started) / (streams * tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--logprobs", default="none,0,5", help="comma-separated: none, or top-k logprobs per token")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    tokenizer = load_tokenizer(resolve_model(None))
    ids = tokenizer.encode(TEXT)
    for lp in args.logprobs.split(","):
        k = None if lp == "none" else int(lp)
        runs = [run_once(tokenizer, ids, args.streams, args.tokens, k) for _ in range(args.repeats)]
        print(f"streams={args.streams} logprobs={lp:<4} processor CPU per token: median "
              f"{statistics.median(runs) * 1e6:.1f} us (runs: {', '.join(f'{r * 1e6:.1f}' for r in runs)})")


if __name__ == "__main__":
    main()
