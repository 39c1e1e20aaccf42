"""Speculative decoding: no speculation vs a fixed draft length (k = 5) vs the adaptive draft length,
side by side in one run, on three workloads at several batch sizes (default model).

Workloads (greedy, so all three engines emit the same tokens; tok/s = generated tokens / wall time):
  code_edit  few-shot "rename an identifier" completions: the output repeats most of the prompt's code
  json       chat prompts asking to extract fields of a short text as JSON
  chat       open chat questions (little repetition: speculation should cost nothing here)

The three engines live in this process, built from one config that differs only in
`speculative_config`; each (workload, batch) row runs every engine once per repeat, in an order that
rotates between repeats (A/B interleaved: a load change on a shared machine hits all three), and the
table reports medians over repeats and the ratios to no speculation. A fourth engine, a second copy of
no speculation (`--no-control` leaves it out), gives each row its noise floor: the ratio of two identical
engines ("A/A"; on the 2-core AVX2 machine at batch 8 it read 0.88-1.02 over three repeats, as wide as the
differences the targets ask about). Next to wall-clock tok/s it reports
the ratios of CPU time per token (`time.process_time`, all of the process's threads): on a shared machine
wall time moves with the others' load, CPU time far less (most robust with `--num-threads 1`, where no
thread spins waiting for another). The "decode" ratios compare the mean time per output token after the
first (TPOT, per request from its first token to its last): the part of a request speculation can change.
tok/s also counts each run's prefill, which every engine pays alike and which is a cold prefill only in an
engine's first run of a row (its prefix cache holds the prompt afterwards): at batch 1 it pulls the first
run's tok/s ratios towards 1 (code edits: ~40 ms of a ~180 ms run cold, ~10 ms after).

    HF_HUB_OFFLINE=1 python benchmarks/spec.py --batches 1 8 32 --repeats 3
    HF_HUB_OFFLINE=1 python benchmarks/spec.py --num-threads 1 --repeats 5 --max-tokens 128   # shared machine
    HF_HUB_OFFLINE=1 python benchmarks/spec.py --batches 8 --starts 3 --repeats 2   # over engine starts too

An engine's start-up profile (the price of verification) and its first estimates shape its choices for its
whole life, so repeats within one start share them; `--starts N` builds the engines N times (code_edit at
batch 8 read 0.86-1.02x of no speculation over six single-start runs of one tree on the AVX-512 machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from deepinfer import LLM, SamplingParams  # noqa: E402

SNIPPETS = [
    ("items", "products", '''def compute_total(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
'''),
    ("user", "account", '''def describe(user):
    name = user.first_name + " " + user.last_name
    if user.is_admin:
        return name + " (admin)"
    return name + " <" + user.email + ">"
'''),
    ("values", "samples", '''def normalize(values):
    low = min(values)
    high = max(values)
    span = high - low
    if span == 0:
        return [0.0 for v in values]
    return [(v - low) / span for v in values]
'''),
    ("path", "filename", '''def read_lines(path):
    lines = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                lines.append(line)
    return lines
'''),
]
EXAMPLE = ("count", "total", '''def add_all(numbers):
    count = 0
    for n in numbers:
        count += n
    return count
''')
TEXTS = [
    "Maria Lopez is a 34-year-old architect who moved to Lisbon in 2019.",
    "Born in 1990, Kenji Tanaka (now 35) works as a nurse in Osaka.",
    "The new CFO, Priya Raman, 41, will relocate from Chennai to London next month.",
    "Tom Becker, aged 58, has run a bakery in Hamburg for twenty years.",
]
QUESTIONS = [
    "What are some good ways to stay focused while studying?",
    "Explain why the sky is blue in simple terms.",
    "Give me three ideas for a weekend trip with kids.",
    "How do I start learning to play the guitar?",
]


def code_edit_prompt(i: int) -> str:
    old, new, code = SNIPPETS[i % len(SNIPPETS)]
    eo, en, ecode = EXAMPLE
    return (f"# Original:\n{ecode}\n# The same code with `{eo}` renamed to `{en}`:\n{ecode.replace(eo, en)}\n"
            f"# Original:\n{code}\n# The same code with `{old}` renamed to `{new}`:\n")


def build_workloads(llm: LLM, batch: int) -> dict[str, list]:
    tok = llm.get_tokenizer()

    def chat(text: str) -> list[int]:
        rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
        return tok.encode(rendered, add_special_tokens=False)

    return {
        "code_edit": [{"prompt": code_edit_prompt(i)} for i in range(batch)],
        "json": [{"prompt_token_ids": chat('Extract the person\'s name, age and city as JSON with keys "name", '
                                           f'"age", "city".\n\nText: {TEXTS[i % len(TEXTS)]}')} for i in range(batch)],
        "chat": [{"prompt_token_ids": chat(QUESTIONS[i % len(QUESTIONS)])} for i in range(batch)],
    }


def run_once(llm: LLM, prompts: list, max_tokens: int) -> tuple[float, float, float, list]:
    """(tokens per wall second, tokens per CPU second, the mean time per output token after the first over
    the requests that emitted two or more (TPOT, seconds; nan if none did), the outputs' token ids)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    started, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    tpots = [(o.metrics["now"] - o.metrics["first_token"]) / (len(o.outputs[0].token_ids) - 1)
             for o in outs if len(o.outputs[0].token_ids) > 1]
    tpot = statistics.fmean(tpots) if tpots else float("nan")
    return tokens / wall, tokens / max(cpu, 1e-9), tpot, [list(o.outputs[0].token_ids) for o in outs]


def acceptance(drafted: list[int], kept: list[int]) -> float:
    """The median over runs of the share of verified draft tokens kept (a run that drafted nothing: 0)."""
    rates = [k / d if d else 0.0 for d, k in zip(drafted, kept, strict=True)]
    return statistics.median(rates) if rates else 0.0


def main() -> None:
    import hw_bounds  # a sibling module: the script's directory is on sys.path (tests import this module's helpers)

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in GGUF")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--workloads", nargs="+", default=["code_edit", "json", "chat"])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--method", default="ngram", choices=["ngram", "suffix"])
    ap.add_argument("--k-max", type=int, default=16, help="adaptive: the longest draft it may choose")
    ap.add_argument("--num-threads", type=int, default=None, help="torch threads per engine (default: torch's)")
    ap.add_argument("--starts", type=int, default=1,
                    help="build the engines this many times, each running every row --repeats times (medians "
                         "over all): an engine's start-up profile shapes its choices for its whole life")
    ap.add_argument("--no-control", dest="control", action="store_false",
                    help="leave out the second no-speculation engine (the A/A noise floor)")
    ap.add_argument("--deterministic", action="store_true",
                    help="batch-invariant numerics (`deterministic=True`): every engine emits the same tokens at "
                         "every batch size, so the ratios compare the draft policies on the same texts (by default "
                         "a step past the C path's 8 rows has other bits than one within it, and from batch 8 on the "
                         "engines' greedy outputs drift apart: their ratios then also compare different texts); "
                         "the step prices are this mode's, not the default's")
    hw_bounds.add_flag(ap, "; each row's tok/s over the memory bound at batch 1, the compute bound at larger "
                           "batches")
    args = ap.parse_args()
    bounds = hw_bounds.RunBounds(args.model) if args.bounds else None  # before the engines, and again after

    common = dict(kv_cache_memory="768MiB", max_num_seqs=max(args.batches), num_threads=args.num_threads,
                  deterministic=args.deterministic)
    configs = {
        "none": None,
        "k5": {"method": args.method, "num_speculative_tokens": 5, "adaptive": False},
        "adaptive": {"method": args.method, "num_speculative_tokens": args.k_max, "adaptive": True},
    }
    if args.control:
        configs["none_b"] = None
    names = list(configs)
    cells = [(w, b) for w in args.workloads for b in args.batches]
    rates: dict[tuple, dict[str, list[float]]] = {c: {n: [] for n in names} for c in cells}
    cpu_rates: dict[tuple, dict[str, list[float]]] = {c: {n: [] for n in names} for c in cells}
    tpots: dict[tuple, dict[str, list[float]]] = {c: {n: [] for n in names} for c in cells}
    # per run, the draft tokens verified and kept (each start's line reports the adaptive engine's sums; the
    # table the median of the runs' acceptance rates)
    drafted: dict[tuple, dict[str, list[int]]] = {c: {n: [] for n in names} for c in cells}
    kept: dict[tuple, dict[str, list[int]]] = {c: {n: [] for n in names} for c in cells}
    for start in range(args.starts):
        # each start builds the engines afresh: an engine's start-up profile and first estimates shape its
        # choices for its whole life, so repeats within one start do not average over them
        engines = {name: LLM(args.model, speculative_config=cfg, **common) for name, cfg in configs.items()}
        for llm in engines.values():  # warm-up (kernels, caches) outside the measurement
            run_once(llm, ["Hello"], 4)
        for workload, batch in cells:
            prompts = build_workloads(engines["none"], batch)[workload]
            ref = None
            for rep in range(args.repeats):
                order = names[rep % len(names):] + names[:rep % len(names)]
                for name in order:
                    llm = engines[name]
                    before = llm.engine.stats()
                    rate, cpu_rate, tpot, outs = run_once(llm, [p for p in prompts], args.max_tokens)
                    after = llm.engine.stats()
                    rates[workload, batch][name].append(rate)
                    tpots[workload, batch][name].append(tpot)
                    cpu_rates[workload, batch][name].append(cpu_rate)
                    if "spec_draft_tokens" in after:
                        d = after["spec_draft_tokens"] - before["spec_draft_tokens"]
                        a = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
                        drafted[workload, batch][name].append(d)
                        kept[workload, batch][name].append(a)
                    if ref is None:
                        ref = outs
                    elif outs != ref:
                        print(f"  note: {name} output differs from the first run's on {workload} x{batch} "
                              "(floating-point batch-shape effects)")
            med = {n: statistics.median(rates[workload, batch][n][-args.repeats:]) for n in names}
            tmed = {n: statistics.median(tpots[workload, batch][n][-args.repeats:]) for n in names}
            print(f"  start {start + 1}: {workload} b={batch} adaptive/none {med['adaptive'] / med['none']:.2f} "
                  f"k5/none {med['k5'] / med['none']:.2f} (decode: {tmed['none'] / tmed['adaptive']:.2f}, "
                  f"{tmed['none'] / tmed['k5']:.2f}; adaptive drafted "
                  f"{sum(drafted[workload, batch]['adaptive'][-args.repeats:])} tokens, kept "
                  f"{sum(kept[workload, batch]['adaptive'][-args.repeats:])})", flush=True)
        for llm in engines.values():
            llm.close()
        del engines
    rows = []
    for workload, batch in cells:
        med = {n: statistics.median(rates[workload, batch][n]) for n in names}
        cmed = {n: statistics.median(cpu_rates[workload, batch][n]) for n in names}
        tmed = {n: statistics.median(tpots[workload, batch][n]) for n in names}
        row = (workload, batch, med["none"], med["k5"], med["adaptive"], med["k5"] / med["none"],
               med["adaptive"] / med["none"], med["adaptive"] / med["k5"],
               cmed["k5"] / cmed["none"], cmed["adaptive"] / cmed["none"], cmed["adaptive"] / cmed["k5"],
               acceptance(drafted[workload, batch]["k5"], kept[workload, batch]["k5"]),
               acceptance(drafted[workload, batch]["adaptive"], kept[workload, batch]["adaptive"]),
               med["none_b"] / med["none"] if "none_b" in med else float("nan"),
               tmed["none"] / tmed["k5"], tmed["none"] / tmed["adaptive"], tmed["k5"] / tmed["adaptive"])
        rows.append(row)
        print("{:<10} b={:<3} none {:7.1f}  k5 {:7.1f}  adaptive {:7.1f} tok/s | k5/none {:.2f}  "
              "adaptive/none {:.2f}  adaptive/k5 {:.2f} | CPU: {:.2f} {:.2f} {:.2f} | accept k5 {:.2f} "
              "adaptive {:.2f} | A/A {:.2f} | decode: {:.2f} {:.2f} {:.2f}".format(*row), flush=True)
    print(f"\nmethod={args.method}, max_tokens={args.max_tokens}, repeats={args.repeats}, starts={args.starts}, "
          f"num_threads={args.num_threads}, deterministic={args.deterministic} (medians, engines interleaved in rotating order; CPU: the same "
          "ratios of tokens per CPU second; decode: the same ratios of the time per output token after the "
          "first, TPOT, the part speculation can change)")
    print("| workload | batch | none tok/s | k=5 tok/s | adaptive tok/s | k=5 / none | adaptive / none | "
          "adaptive / k=5 | CPU k=5 / none | CPU adaptive / none | CPU adaptive / k=5 | acceptance k=5 | "
          "acceptance adaptive | A/A: none (2nd copy) / none | decode k=5 / none | decode adaptive / none | "
          "decode adaptive / k=5 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| {} | {} | {:.1f} | {:.1f} | {:.1f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} "
              "| {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} |".format(*r))
    if bounds is not None:
        bounds.remeasure()
        print(f"\n{bounds.describe()} (the best of before and after the engines)")
        print("| workload | batch | none, of bound | k=5, of bound | adaptive, of bound |")
        print("|---|---|---|---|---|")
        for workload, batch, none, k5, adaptive, *_ in rows:
            cells = " | ".join(bounds.of(rate, batch == 1) for rate in (none, k5, adaptive))
            print(f"| {workload} | {batch} | {cells} |")


if __name__ == "__main__":
    main()
