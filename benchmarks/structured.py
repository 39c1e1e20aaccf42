"""Decode throughput with and without a JSON schema, side by side on one engine (default model).

Both runs send the same chat prompts (`--num-prompts` concurrent requests) and generate exactly
`--max-tokens` tokens each: the schema (an array of at least 60 user objects) cannot be finished
within the budget, so every constrained request runs to its length limit and both sides produce the
same number of tokens. The schema is compiled once in the warm-up (compiles are cached and happen
off the engine loop; `benchmarks/grammar_backends.py` times them). Runs alternate plain /
constrained; medians of `--repeats` runs; prints tokens/s and the constrained / plain ratio.

    HF_HUB_OFFLINE=1 python benchmarks/structured.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.engine.structured import StructuredOutputParams  # noqa: E402

SCHEMA = {"type": "array", "minItems": 60, "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string"}, "email": {"type": "string"},
    "role": {"enum": ["admin", "user", "guest"]}, "active": {"type": "boolean"}},
    "required": ["id", "name", "email", "role", "active"]}}
TOPICS = ["a list of users", "team members", "customers", "players", "students", "authors", "employees", "guests"]


def run_once(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, int]:
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / wall, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in GGUF")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--overlap-host-work", default="auto", choices=["auto", "on", "off"])
    args = ap.parse_args()

    llm = LLM(args.model, dtype=args.dtype, overlap_host_work=args.overlap_host_work, max_num_seqs=256)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write {TOPICS[i % len(TOPICS)]} #{i} as JSON."}],
                                       tokenize=False, add_generation_prompt=True) for i in range(args.num_prompts)]
    plain = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                 structured_output=StructuredOutputParams(json_schema=SCHEMA))
    run_once(llm, prompts[:4], plain)  # warm-up, and the schema's one compile
    sample = llm.generate(prompts[:1], constrained)[0].outputs[0]
    assert sample.finish_reason == "length" and sample.text.startswith("["), sample
    results: dict[str, list[float]] = {"plain": [], "json_schema": []}
    for _ in range(args.repeats):
        for name, params in (("plain", plain), ("json_schema", constrained)):
            tok_s, tokens = run_once(llm, prompts, params)
            assert tokens == args.num_prompts * args.max_tokens, (name, tokens)
            results[name].append(tok_s)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"{args.num_prompts} requests x {args.max_tokens} tokens, {args.repeats} runs each, "
          f"overlap_host_work={args.overlap_host_work}")
    for name, runs in results.items():
        print(f"{name:12s} median {med[name]:8.1f} tok/s   runs: {', '.join(f'{r:.1f}' for r in runs)}")
    ratio = med["json_schema"] / med["plain"]
    print(f"json_schema / plain: {ratio:.3f} (overhead {100 * (1 - ratio):.1f}%)")
    print("sample constrained output:", json.dumps(sample.text[:120]))
    print("load average at end:", os.getloadavg())
    llm.close()


if __name__ == "__main__":
    main()
