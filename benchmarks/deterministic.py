"""The cost of `--deterministic`: the default engine and a deterministic one side by side, one process.

Both engines load the default model in the same dtype (the machine's default unless --dtype) and run
the same workloads in alternation (default, deterministic, default, ...), so drift on a noisy machine
hits both; each figure is the median of --repeats rounds:

* ``chat``    -- --num-prompts short chat prompts x --max-tokens tokens, greedy, all submitted at once
                 (generated tokens / wall second);
* ``single``  -- one chat prompt decoding --max-tokens tokens (tokens / second);
* ``prefill`` -- one --long-tokens prompt, one output token (seconds to the first token).

Every round tags its prompts with the round number, so no run reuses a previous run's whole prompt.

    python benchmarks/deterministic.py --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import hw_bounds  # a sibling module (the script's directory is on sys.path); it loads no torch

from deepinfer import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in simple terms.", "Write a haiku about rain.",
    "How do magnets work?", "Why is the sky blue?", "Summarize Romeo and Juliet.", "How do vaccines work?",
    "What causes earthquakes?", "What is machine learning?", "How does the internet work?",
]


def _chat_ids(llm: LLM, text: str) -> list[int]:
    tok = llm.engine.tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok.encode(rendered, add_special_tokens=False)


def _timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - started, sum(len(o.outputs[0].token_ids) for o in outs)


def run_round(llm: LLM, args: argparse.Namespace, round_no: int) -> dict[str, float]:
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    chat = [_chat_ids(llm, f"[{round_no}.{i}] {QUESTIONS[i % len(QUESTIONS)]}") for i in range(args.num_prompts)]
    seconds, tokens = _timed(llm, chat, greedy)
    out = {"chat tok/s": tokens / seconds}
    seconds, tokens = _timed(llm, chat[:1], greedy)
    out["single tok/s"] = tokens / seconds
    filler = " ".join(f"item {round_no}-{i} costs {i % 17} coins;" for i in range(args.long_tokens))
    long = llm.engine.tokenizer.encode(filler)[:args.long_tokens]
    seconds, _ = _timed(llm, [long], SamplingParams(temperature=0, max_tokens=1))
    out["prefill s"] = seconds
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--long-tokens", type=int, default=1000)
    hw_bounds.add_flag(ap)
    args = ap.parse_args()
    bounds = hw_bounds.RunBounds() if args.bounds else None  # before the engines, and again after
    engines = {name: LLM(None, dtype=args.dtype, deterministic=det, kv_cache_memory="512MiB")
               for name, det in (("default", False), ("deterministic", True))}
    dtype = engines["default"].engine.core.runner.dtype
    results: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    for _ in range(1):  # warm-up: kernels, allocator, cost model
        for llm in engines.values():
            run_round(llm, argparse.Namespace(**{**vars(args), "num_prompts": 4, "max_tokens": 8,
                                                 "long_tokens": 64}), -1)
    for r in range(args.repeats):
        for name, llm in engines.items():
            results[name].append(run_round(llm, args, r))
            print(f"round {r} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in results[name][-1].items()),
                  flush=True)
    print(f"\n{dtype}, {args.num_prompts} chat prompts x {args.max_tokens} tokens, single stream x "
          f"{args.max_tokens}, prefill of {args.long_tokens} tokens; medians of {args.repeats}")
    if bounds is not None:
        bounds.remeasure()
        print(bounds.describe())
    print(f"{'metric':<14}{'default':>12}{'deterministic':>15}{'ratio':>8}  of bound (default, deterministic)")
    for key in results["default"][0]:
        a = statistics.median(x[key] for x in results["default"])
        b = statistics.median(x[key] for x in results["deterministic"])
        frac = ""
        if bounds is not None and key.endswith("tok/s"):
            name, single = str(dtype).removeprefix("torch."), key.startswith("single")
            frac = f"  {bounds.of(a, single, name)}, {bounds.of(b, single, name)}"
        print(f"{key:<14}{a:>12.2f}{b:>15.2f}{b / a:>8.2f}{frac}")


if __name__ == "__main__":
    main()
