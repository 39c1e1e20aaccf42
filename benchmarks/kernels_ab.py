"""Two builds of the CPU kernels in one engine process, alternating: the ratio of their decode speed.

The machines here swing between fast and slow states within minutes (the same C harness 3.1 and
6.3 ms in consecutive runs), so before / after runs in separate processes cannot resolve a few
percent. This loads the kernels of this checkout (A) and a second set of sources (B: a directory
holding the same `.c` / `.h` files, e.g. `<worktree>/deepinfer/layers`), builds one engine, and
points its whole-layer decoder (`FusedDecoder`) at A or B for alternate `generate` calls: the same
weights, KV cache and host code, seconds apart, the order flipped every pair. Each call decodes
`--tokens` greedy tokens for `--batch` prompts; the decode time per step is that call's time minus a
2-token call's on the same prompts (the prefill and start-up), divided by the steps in between.

    git worktree add /tmp/before <commit>
    python benchmarks/kernels_ab.py /tmp/before/deepinfer/layers --pairs 12

B / A < 1 means B's kernels decode faster. Only the decode steps' C calls switch; the prefill and the
sampler use A's library.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def load_both(b_dir: Path):
    """A: this checkout's kernels; B: the same files from b_dir, built and loaded beside them."""
    import deepinfer.layers.cpu_kernels as ck

    lib_a = ck.load_library()
    if lib_a is None:
        raise SystemExit("the C kernels are unavailable on this machine")
    missing = [n for n in ck.SOURCE_NAMES + ck.HEADER_NAMES if not (b_dir / n).is_file()]
    if missing:
        raise SystemExit(f"{b_dir} lacks {', '.join(missing)}")
    lib_b = ck.load_library_from(b_dir)
    if lib_b is None:
        raise SystemExit(f"the kernels in {b_dir} did not build")
    return lib_a, lib_b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("b_dir", type=Path, help="directory with the other build's kernel sources")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=128, help="greedy tokens per request in a timed call")
    ap.add_argument("--batch", type=int, default=1, help="prompts per call (<= 8 decode in the whole-layer path)")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    if args.tokens < 4:
        ap.error("--tokens must be at least 4")

    lib_a, lib_b = load_both(args.b_dir)
    from deepinfer import LLM, SamplingParams

    llm = LLM(None)
    fused = llm.engine.core.runner.model.fused
    if fused is None:
        raise SystemExit("this engine does not decode through the whole-layer C path")
    tok = llm.get_tokenizer()

    def prompts(tag: str, mark: str) -> list[dict]:
        out = []
        for j in range(args.batch):
            text = tok.apply_chat_template(
                [{"role": "user", "content": f"({tag}, {j}) Tell me a long story about a dragon and a knight{mark}"}],
                add_generation_prompt=True, tokenize=False)
            out.append({"prompt_token_ids": tok(text, add_special_tokens=False)["input_ids"]})
        return out

    def decode_ms(lib, tag: str) -> float:
        fused.lib = lib
        times = {}
        for n, mark in ((2, "."), (args.tokens, "!")):  # other prompts: no prefix hit on the first call
            sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            t = time.perf_counter()
            llm.generate(prompts(tag, mark), sp)
            times[n] = time.perf_counter() - t
        return (times[args.tokens] - times[2]) / (args.tokens - 2) * 1e3

    decode_ms(lib_a, "warm a")
    decode_ms(lib_b, "warm b")
    rows = []
    for i in range(args.pairs):
        order = (("a", lib_a), ("b", lib_b)) if i % 2 == 0 else (("b", lib_b), ("a", lib_a))
        ms = {name: decode_ms(lib, f"pair {i}") for name, lib in order}
        rows.append(ms)
        print(f"pair {i}: A {ms['a']:.3f}  B {ms['b']:.3f} ms per step  B/A {ms['b'] / ms['a']:.3f}", flush=True)
    ratios = [r["b"] / r["a"] for r in rows]
    summary = {
        "batch": args.batch, "tokens": args.tokens, "pairs": args.pairs, "b_dir": str(args.b_dir),
        "median_a_ms": statistics.median(r["a"] for r in rows), "median_b_ms": statistics.median(r["b"] for r in rows),
        "median_ratio_b_over_a": statistics.median(ratios), "pairs_b_faster": sum(x < 1 for x in ratios),
    }
    print(f"batch {args.batch}: median A {summary['median_a_ms']:.3f} ms, B {summary['median_b_ms']:.3f} ms per step; "
          f"median B/A {summary['median_ratio_b_over_a']:.3f} ({summary['pairs_b_faster']} of {args.pairs} pairs B faster)")
    if args.json_out:
        args.json_out.write_text(json.dumps({"summary": summary, "pairs": rows}, indent=2))


if __name__ == "__main__":
    main()
