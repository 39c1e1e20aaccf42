"""Does a request's greedy output depend on load? Count the answers that change.

Each of --num-prompts chat prompts (a long shared document plus a question, so each prompt spans
many KV blocks) is answered greedily four ways, in one engine configuration:

* ``alone``   -- one request at a time, nothing cached (the reference);
* ``batched`` -- all prompts submitted together, prefill chunks of --chunk tokens sharing steps;
* ``device``  -- each prompt again after ``alone``: the prefix comes from the device cache and
                 only the last partial block is computed;
* ``store``   -- a restarted engine over the same persistent store: the prefix comes from disk.

The table gives, per way, how many answers differ from ``alone`` and the first differing position.

    python benchmarks/load_invariance.py                    # default mode, the machine's dtype
    python benchmarks/load_invariance.py --deterministic
"""

from __future__ import annotations

import argparse
import gc
import tempfile

from deepinfer import LLM, SamplingParams

QUESTIONS = ["Which dock was busiest?", "How many crates left dock 3?", "Summarize the log in one sentence.",
             "What happened at 5 o'clock?", "Which warehouse got the most crates?", "List the docks mentioned.",
             "What is the earliest departure?", "Name one entry with 7 crates.", "How long did trips take?",
             "Is any dock unused?", "What is the average trip time?", "Write a headline for this log.",
             "Which entry is the last one?", "How many entries are there?", "Give the total crate count.",
             "What time did entry 10 leave?"]


def build_prompts(llm: LLM, n: int) -> list[list[int]]:
    doc = "\n".join(f"Entry {i}: the shipment of {i * 7 % 23} crates left dock {i % 5} at {i % 12 + 1} o'clock "
                    f"and reached the warehouse {i * 3 % 11} hours later." for i in range(50))
    tok = llm.engine.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": f"{doc}\n\n{QUESTIONS[i % len(QUESTIONS)]}"}],
                                     add_generation_prompt=True, tokenize=False) for i in range(n)]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens of the batched run")
    args = ap.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    common: dict = dict(dtype=args.dtype, kv_cache_memory="512MiB")
    if args.deterministic:  # only when asked: the script also runs against versions without the flag
        common["deterministic"] = True
    with tempfile.TemporaryDirectory(prefix="di-invariance-") as store:
        llm = LLM(None, kv_store=store, **common)
        prompts = build_prompts(llm, args.num_prompts)
        dtype = llm.engine.core.runner.dtype
        alone = [llm.generate([p], params)[0] for p in prompts]
        device = [llm.generate([p], params)[0] for p in prompts]
        llm.engine.flush_kv_store(timeout=120)
        del llm
        gc.collect()
        llm = LLM(None, kv_store=store, **common)
        stored = [llm.generate([p], params)[0] for p in prompts]
        del llm
        gc.collect()
    llm = LLM(None, enable_prefix_caching=False, max_num_batched_tokens=args.chunk, **common)
    batched = llm.generate(prompts, params)
    ref = [list(o.outputs[0].token_ids) for o in alone]
    print(f"\n{dtype}, deterministic={args.deterministic}: {args.num_prompts} prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.max_tokens} greedy tokens each")
    print(f"{'way':<10}{'cached tokens':>15}{'differ':>8}  first differing positions")
    for name, outs in (("batched", batched), ("device", device), ("store", stored)):
        diffs = [first_diff(list(o.outputs[0].token_ids), r) for o, r in zip(outs, ref, strict=True)]
        cached = sum(o.num_cached_tokens for o in outs) // len(outs)
        positions = [d for d in diffs if d is not None]
        print(f"{name:<10}{cached:>15}{len(positions):>5}/{len(outs):<2}  {positions}")


if __name__ == "__main__":
    main()
