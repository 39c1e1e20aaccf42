"""Decode throughput with and without a JSON schema, side by side on one engine (default model).

Both runs send the same chat prompts (`--num-prompts` concurrent requests) and generate exactly
`--max-tokens` tokens each: the schema (an array of at least 60 user objects) cannot be finished
within the budget, so every constrained request runs to its length limit and both sides produce the
same number of tokens. The schema is compiled once in the warm-up (compiles are cached and happen
off the engine loop; `benchmarks/grammar_backends.py` times them). Runs alternate plain /
constrained; medians of `--repeats` runs; prints tokens/s and the constrained / plain ratio (of the
medians, and the median of each constrained run over the plain run just before it).

    HF_HUB_OFFLINE=1 python benchmarks/structured.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hw_bounds  # noqa: E402 - a sibling module (the script's directory is on sys.path); it loads no torch

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.engine.grammar import RequestGrammar  # noqa: E402
from deepinfer.engine.sampler import Sampler  # noqa: E402
from deepinfer.engine.structured import StructuredOutputParams  # noqa: E402

SCHEMA = {"type": "array", "minItems": 60, "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string"}, "email": {"type": "string"},
    "role": {"enum": ["admin", "user", "guest"]}, "active": {"type": "boolean"}},
    "required": ["id", "name", "email", "role", "active"]}}
TOPICS = ["a list of users", "team members", "customers", "players", "students", "authors", "employees", "guests"]


class GrammarTimer:
    """Wall time spent in the structured-output hot path: the sampler's mask fill + apply and the
    matcher's per-token accept (wrapped here, in the benchmark only)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        fill, accept = Sampler._apply_grammar, RequestGrammar.accept

        def timed_fill(logits, reqs):
            t = time.perf_counter()
            fill(logits, reqs)
            self.seconds += time.perf_counter() - t

        def timed_accept(grammar, token_id):
            t = time.perf_counter()
            ok = accept(grammar, token_id)
            self.seconds += time.perf_counter() - t
            return ok

        Sampler._apply_grammar = staticmethod(timed_fill)
        RequestGrammar.accept = timed_accept


def run_once(llm: LLM, prompts: list[str], params: SamplingParams, timer: GrammarTimer) -> dict[str, float]:
    grammar0 = timer.seconds
    started, cpu0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tok_s": tokens / wall, "tok_cpu_s": tokens / cpu, "grammar_share": (timer.seconds - grammar0) / wall,
            "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in GGUF")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--overlap-host-work", default="auto", choices=["auto", "on", "off"])
    hw_bounds.add_flag(ap)
    args = ap.parse_args()
    bounds = hw_bounds.RunBounds(args.model) if args.bounds else None  # before the engine, and again after

    llm = LLM(args.model, dtype=args.dtype, overlap_host_work=args.overlap_host_work, max_num_seqs=256)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write {TOPICS[i % len(TOPICS)]} #{i} as JSON."}],
                                       tokenize=False, add_generation_prompt=True) for i in range(args.num_prompts)]
    plain = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                 structured_output=StructuredOutputParams(json_schema=SCHEMA))
    timer = GrammarTimer()
    run_once(llm, prompts[:4], plain, timer)  # warm-up, and the schema's one compile
    sample = llm.generate(prompts[:1], constrained)[0].outputs[0]
    assert sample.finish_reason == "length" and sample.text.startswith("["), sample
    results: dict[str, list[dict[str, float]]] = {"plain": [], "json_schema": []}
    for _ in range(args.repeats):
        for name, params in (("plain", plain), ("json_schema", constrained)):
            r = run_once(llm, prompts, params, timer)
            assert r["tokens"] == args.num_prompts * args.max_tokens, (name, r)
            results[name].append(r)
    print(f"{args.num_prompts} requests x {args.max_tokens} tokens, {args.repeats} runs each, "
          f"overlap_host_work={args.overlap_host_work}")
    if bounds is not None:
        bounds.remeasure()
        print(bounds.describe())
    med = {}
    for name, runs in results.items():
        med[name] = {k: statistics.median(r[k] for r in runs) for k in ("tok_s", "tok_cpu_s", "grammar_share")}
        walls = ", ".join(f"{r['tok_s']:.1f}" for r in runs)
        frac = bounds.of(med[name]["tok_s"], False, None if args.dtype == "auto" else args.dtype) \
            if bounds is not None else "-"
        print(f"{name:12s} median {med[name]['tok_s']:8.1f} tok/s (wall, {frac} of bound)  "
              f"{med[name]['tok_cpu_s']:8.1f} tok/CPU-s  runs (wall tok/s): {walls}")
    for key, what in (("tok_s", "wall"), ("tok_cpu_s", "process CPU time")):
        ratio = med["json_schema"][key] / med["plain"][key]
        # each constrained run against the plain run just before it: robust to load drifting between runs
        paired = statistics.median(c[key] / p[key] for p, c in zip(results["plain"], results["json_schema"],
                                                                     strict=True))
        print(f"json_schema / plain by {what}: {ratio:.3f} of the medians, {paired:.3f} median of paired runs")
    print(f"grammar hot path (mask fill + apply + accept) share of constrained wall time: "
          f"{100 * med['json_schema']['grammar_share']:.2f}%")
    print("sample constrained output:", json.dumps(sample.text[:120]))
    print("load average at end:", os.getloadavg())
    llm.close()


if __name__ == "__main__":
    main()
