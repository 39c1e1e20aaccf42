"""xgrammar vs llguidance on the default model's tokenizer: grammar compile time for a few JSON
schemas, and per-token mask-fill time while walking a valid JSON document token by token.

    python benchmarks/grammar_backends.py [--runs 5]

Prints medians over `--runs` runs and the ratio llguidance / xgrammar (lower is better for each).
Compile times are cold (each library's compile cache is bypassed by a fresh compiler per run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
             "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "email": {"type": "string"},
                                                  "tags": {"type": "array", "items": {"type": "string"}}},
                 "required": ["id", "email", "tags"]},
        "status": {"enum": ["active", "inactive", "banned"]},
        "scores": {"type": "array", "items": {"type": "number"}, "minItems": 1}},
        "required": ["user", "status", "scores"]},
    "wide": {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "boolean"]}
                                              for i in range(24)},
             "required": [f"field_{i}" for i in range(24)]},
}
DOC = {"user": {"id": 42, "email": "someone@example.com", "tags": ["alpha", "beta", "gamma"]},
       "status": "active", "scores": [1.5, 2.25, 3.0, 99.125]}


def bench_xgrammar(tok, vocab: int, eos: list[int], runs: int) -> dict[str, float]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos)
    out: dict[str, float] = {}
    for name, schema in SCHEMAS.items():
        times = []
        for _ in range(runs):
            compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            t = time.perf_counter()
            compiler.compile_json_schema(json.dumps(schema))
            times.append(time.perf_counter() - t)
        out[f"compile {name} (ms)"] = 1000 * statistics.median(times)
    compiled = xgr.GrammarCompiler(info, max_threads=2).compile_json_schema(json.dumps(SCHEMAS["nested"]))
    ids = tok.encode(json.dumps(DOC), add_special_tokens=False)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    per_token = []
    for _ in range(runs):
        m = xgr.GrammarMatcher(compiled)
        t = time.perf_counter()
        for tid in ids:
            m.fill_next_token_bitmask(bitmask, 0)
            assert m.accept_token(tid)
        per_token.append((time.perf_counter() - t) / len(ids))
    out["mask fill + accept per token (us)"] = 1e6 * statistics.median(per_token)
    return out


def bench_llguidance(tok, vocab: int, eos: list[int], runs: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos[0])
    out: dict[str, float] = {}
    for name, schema in SCHEMAS.items():
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
            m = llguidance.LLMatcher(lltok, grammar)  # llguidance compiles lazily: matcher creation is the compile
            assert not m.is_error(), m.get_error()
            times.append(time.perf_counter() - t)
        out[f"compile {name} (ms)"] = 1000 * statistics.median(times)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMAS["nested"]))
    ids = tok.encode(json.dumps(DOC), add_special_tokens=False)
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    per_token = []
    for _ in range(runs):
        m = llguidance.LLMatcher(lltok, grammar)
        t = time.perf_counter()
        for tid in ids:
            llguidance.torch.fill_next_token_bitmask(m, bitmask, 0)
            assert m.consume_token(tid), m.get_error()
        per_token.append((time.perf_counter() - t) / len(ids))
    out["mask fill + accept per token (us)"] = 1e6 * statistics.median(per_token)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(2)
    from transformers import AutoConfig, AutoTokenizer

    from deepinfer.weights import resolve_model

    files = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(str(files.directory))
    vocab = AutoConfig.from_pretrained(str(files.directory)).vocab_size
    eos = [tok.eos_token_id]
    xg = bench_xgrammar(tok, vocab, eos, args.runs)
    ll = bench_llguidance(tok, vocab, eos, args.runs)
    print(f"{'metric':40s} {'xgrammar':>10s} {'llguidance':>11s} {'ll/xg':>7s}")
    for k in xg:
        print(f"{k:40s} {xg[k]:10.2f} {ll[k]:11.2f} {ll[k] / xg[k]:7.2f}")


if __name__ == "__main__":
    main()
