"""What prompt-lookup speculation can gain at batch 1, at most, on this machine: bounds from the greedy text
and the measured price of verification.

Greedy speculation emits the plain engine's tokens, so the plain engine's output for a prompt is the text any
speculative engine produces. Replayed token by token, the engine's own n-gram lookup (`find_match`) gives at
each position the proposal a step there would verify; a step that verifies k drafts of which a are kept costs
T(1 + k) and emits a + 1 tokens. T(R) is measured in this run: every step of the C path's speculating calls
(`FusedDecoder.spec_steps` times each step and reports its rows) of fixed-k engines, k = 1..K, on the same
prompts; the plain engine's steps (its `decode_steps` calls, seconds per step) price no speculation. A policy's
bound is the plain engine's model time (tokens x seconds per plain step) over the replay's (the sum of its
steps' T). Host time between calls, the prompt's prefill and the first token are left out of both: `spec.py`
counts them in its tok/s, which pulls its ratios towards 1.

Policies replayed:
  fixed k           every step verifies min(k, the proposal's length) drafts
  best by match     one draft length per n-gram match length (min_n..max_n), the combination that minimises the
                    replay's time, found by trying all of them: fitted to the whole text, an upper bound of any
                    policy that chooses by match length alone (as the C calls' plans do) with these prices
  oracle            each step verifies exactly the drafts that will be kept (at most K): no draft-length policy
                    over this proposer does better
  any occurrence    the oracle with, at each step, the longest-kept continuation of any earlier occurrence of
                    any suffix length 1..max_n (not only the most recent occurrence of the longest suffix): no
                    proposer that copies from the request's own tokens does better
  online by match   not fitted to the text: every `--call-steps` steps (a C call's), the plan by match length
                    that would have been fastest on the output so far (each past step's kept drafts capped at
                    the tokens known then; k = 3 until 16 tokens are out), applied to the next steps
  adaptive          measured, not replayed: the adaptive engine (`num_speculative_tokens` 16) run beside the
                    others, its model time (the seconds its C calls timed) against the plain engine's on the
                    same prompt (medians over the repeats; its first run starts from the prior's estimates)

    HF_HUB_OFFLINE=1 python benchmarks/spec_bound.py                       # spec.py's batch-1 prompts
    HF_HUB_OFFLINE=1 python benchmarks/spec_bound.py --code-edit-prompts 4   # all four code edits
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spec import build_workloads, code_edit_prompt, run_once  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.config import SpeculativeMethod  # noqa: E402
from deepinfer.engine.spec.ngram import find_match  # noqa: E402
from deepinfer.layers import fused_decode  # noqa: E402


class StepTimes:
    """Wraps `FusedDecoder.decode_steps` and `spec_steps` to collect each plain step's seconds (a call's time over
    its steps) and each speculating step's (rows, seconds) as the C call timed it (while `pricing`); every
    call's model seconds (the plain call's time, the speculating steps' sum) also go to `run`."""

    def __init__(self) -> None:
        self.plain: list[float] = []
        self.spec: dict[int, list[float]] = defaultdict(list)
        self.pricing = True
        self.run = 0.0
        decode_steps, spec_steps = fused_decode.FusedDecoder.decode_steps, fused_decode.FusedDecoder.spec_steps
        times = self

        def timed_decode(decoder, *args, **kwargs):
            started = time.perf_counter()
            tokens = decode_steps(decoder, *args, **kwargs)
            seconds = time.perf_counter() - started
            times.plain.append(seconds / max(tokens.shape[0], 1))
            times.run += seconds
            return tokens

        def timed_spec(decoder, *args, **kwargs):
            call = spec_steps(decoder, *args, **kwargs)
            for rows, seconds in call.steps:
                times.run += seconds
                if times.pricing:
                    times.spec[rows].append(seconds)
            return call

        fused_decode.FusedDecoder.decode_steps = timed_decode
        fused_decode.FusedDecoder.spec_steps = timed_spec


def proposals(prompt: list[int], output: list[int], min_n: int, max_n: int, k_max: int) -> list[tuple[int, int, int, int]]:
    """Per output position p (the tokens before it known): (match length, proposal length, drafts of it the
    output keeps, the most any earlier occurrence of any suffix of length 1..max_n would keep), each capped at
    k_max and at the tokens left after p's."""
    out = []
    for p in range(len(output)):
        context = prompt + output[:p]
        room = min(k_max, len(output) - p - 1)
        draft, match = find_match(context, min_n, max_n, room)
        kept = _kept(draft, output[p:])
        best = 0
        for n in range(1, min(max_n, len(context) - 1) + 1):
            suffix = context[-n:]
            for s in range(len(context) - n - 1, -1, -1):
                if context[s:s + n] != suffix:
                    continue
                best = max(best, _kept(context[s + n:s + n + room], output[p:]))
        out.append((match, len(draft), kept, best))
    return out


def _kept(draft: list[int], actual: list[int]) -> int:
    """How many leading draft tokens the actual tokens confirm."""
    return next((i for i, (d, t) in enumerate(zip(draft, actual, strict=False)) if d != t), len(draft))


def by_match(plan: dict[int, int]):
    """The `replay` choice of a plan of draft lengths by match length: each proposal cut to its length's."""
    return lambda m, n, a, b: (min(plan.get(m, 0), n), min(plan.get(m, 0), n, a))


def replay(props: list[tuple[int, int, int, int]], price: list[float], choose, end: int | None = None) -> float:
    """Seconds of the steps that emit the output up to position `end` (default: all of it) when each step
    verifies `choose(match, proposed, kept, best)` drafts (at most the proposal's, or `best`'s for the
    any-occurrence oracle) and keeps what the text keeps, no further than `end`."""
    end = len(props) if end is None else end
    p, total = 0, 0.0
    while p < end:
        match, proposed, kept, best = props[p]
        k, a = choose(match, proposed, kept, best)
        total += price[1 + k]
        p += min(a, end - p - 1) + 1
    return total


def online(props: list[tuple[int, int, int, int]], price: list[float], lengths: range, choices: list[int],
           every: int, warm: int = 16, start_k: int = 3) -> float:
    """Seconds of the steps that emit the output when every `every` steps the plan (a draft length from `choices`
    per match length) is the one that replays fastest on the output so far (positions before the current one,
    each past step's kept drafts capped at the tokens known now), k = `start_k` until `warm` tokens are out."""
    plans = [dict(zip(lengths, plan, strict=True)) for plan in itertools.product(choices, repeat=len(lengths))]
    p, total, since, plan = 0, 0.0, every, None
    while p < len(props):
        if since >= every and p >= warm:
            plan, since = min(plans, key=lambda by: replay(props, price, by_match(by), p)), 0
        match, proposed, kept, _ = props[p]
        k = min(plan.get(match, 0) if plan else start_k, proposed)
        total += price[1 + k]
        p += min(kept, k) + 1
        since += 1
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k-max", type=int, default=7, help="longest draft (a batch-1 step of the C path: 8 rows)")
    ap.add_argument("--code-edit-prompts", type=int, default=1,
                    help="code edits 0..N-1 (spec.py's batch 1 runs the first of each workload)")
    ap.add_argument("--workloads", nargs="+", default=["code_edit", "json", "chat"])
    ap.add_argument("--repeats", type=int, default=3, help="runs of each prompt per engine for the prices")
    ap.add_argument("--call-steps", type=int, default=6, help="online by match: steps between its plan choices")
    args = ap.parse_args()

    times = StepTimes()
    common = dict(kv_cache_memory="512MiB", max_num_seqs=8)
    # every engine lives at once and they take turns, prompt by prompt: a load change on a shared machine
    # then moves every row count's price alike, where engines run one after another would each see their own
    engines = {0: LLM(None, **common)}
    for k in range(1, args.k_max + 1):
        engines[k] = LLM(None, speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                                   "adaptive": False}, **common)
    # the engine's own choice, measured alongside (its steps price nothing: they would weigh the counts it picks)
    engines["adaptive"] = LLM(None, speculative_config={"method": "ngram", "num_speculative_tokens": 16,
                                                        "adaptive": True}, **common)
    lookup = SpeculativeMethod("ngram", args.k_max)  # the engine's n-gram sizes: its defaults
    min_n, max_n = lookup.prompt_lookup_min, lookup.prompt_lookup_max
    first = build_workloads(engines[0], 1)
    prompts = {}
    for workload in args.workloads:
        if workload == "code_edit":
            for i in range(args.code_edit_prompts):
                prompts[f"code_edit[{i}]"] = {"prompt": code_edit_prompt(i)}
        else:
            prompts[f"{workload}[0]"] = first[workload][0]
    for llm in engines.values():
        run_once(llm, ["Hello"], 4)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    outputs = {}
    model = defaultdict(list)  # (prompt, engine) -> model seconds of each run
    for _ in range(args.repeats):
        for name, prompt in prompts.items():
            for k, llm in engines.items():
                times.pricing, times.run = k != "adaptive", 0.0
                out = llm.generate([prompt], params)[0]
                model[name, k].append(times.run)
                if k == 0:
                    outputs[name] = (list(out.prompt_token_ids), list(out.outputs[0].token_ids))
    plain_step = statistics.median(times.plain)
    for llm in engines.values():
        llm.close()
    measured = {r: statistics.median(v) for r, v in sorted(times.spec.items())}
    # a row count no step had (rare at the ends): linear between its measured neighbours
    price = [0.0] * (args.k_max + 2)
    known = sorted(measured)
    for r in range(1, args.k_max + 2):
        if r in measured:
            price[r] = measured[r]
            continue
        lo = max((c for c in known if c < r), default=known[0])
        hi = min((c for c in known if c > r), default=known[-1])
        price[r] = measured[lo] if hi == lo else measured[lo] + (measured[hi] - measured[lo]) * (r - lo) / (hi - lo)
    print(f"plain decode step {plain_step * 1e3:.2f} ms (median of {len(times.plain)} calls' seconds per step); "
          "speculating steps by rows (ms, steps measured):")
    print("  " + "  ".join(f"{r}: {price[r] * 1e3:.2f} ({len(times.spec.get(r, []))})"
                          for r in range(1, args.k_max + 2)))

    ks = range(args.k_max + 1)
    lengths = range(min_n, max_n + 1)
    print(f"\nn-gram {min_n}..{max_n}, drafts up to {args.k_max}; ratios of the plain engine's model time to the "
          "replay's (no host time, prefill or first token)")
    head = "| prompt | tokens | " + " | ".join(f"k={k}" for k in range(1, args.k_max + 1)) + \
        " | best by match | online by match | oracle | any occurrence | adaptive, measured |"
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    for name, (prompt, output) in outputs.items():
        props = proposals(prompt, output, min_n, max_n, args.k_max)
        none = len(output) * plain_step
        fixed = [none / replay(props, price, lambda m, n, a, b, k=k: (min(k, n), min(k, a)))
                 for k in range(1, args.k_max + 1)]
        best, best_plan = None, None
        for plan in itertools.product(ks, repeat=len(lengths)):
            by = dict(zip(lengths, plan, strict=True))
            t = replay(props, price, by_match(by))
            if best is None or t < best:
                best, best_plan = t, plan
        learnt = none / online(props, price, lengths, [0, 1, 2, 3, 5, 7], args.call_steps)
        oracle = none / replay(props, price, lambda m, n, a, b: (a, a))
        anywhere = none / replay(props, price, lambda m, n, a, b: (b, b))
        plan = ",".join(map(str, best_plan))
        adaptive = statistics.median(model[name, 0]) / statistics.median(model[name, "adaptive"])
        print(f"| {name} | {len(output)} | " + " | ".join(f"{r:.2f}" for r in fixed) +
              f" | {none / best:.2f} (k by match {min_n}..{max_n}: {plan}) | {learnt:.2f} | {oracle:.2f} | {anywhere:.2f} "
              f"| {adaptive:.2f} |")


if __name__ == "__main__":
    main()
