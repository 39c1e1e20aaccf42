"""Offline generation throughput: deepinfer vs HF transformers vs vLLM (CPU) vs llama.cpp (single stream).

Workloads (greedy, ``ignore_eos``, every prompt generates exactly ``--max-tokens``):

* ``chat``   -- ``--num-prompts`` short user questions, chat template applied.
* ``shared`` -- the same questions after a common ~400-token system prompt.
* ``single`` -- single-stream decode: one chat prompt.
* ``long``   -- single stream after a long context: one question after the system prompt four times over
  (~1,650 tokens; the run tag is in the question, so the long prefix is cached after the warm-up as in a
  long conversation, and the timed runs are mostly decoding at that context). Its fraction of the bound
  is not printed: the weight-only memory bound leaves out the KV it reads.

Every run (warm-up and each timed repeat) tags the user messages with the run
index, so a prefix cache can reuse the genuinely shared prefix but never a whole
prompt from an earlier run.  All engines get identical token ids.  Reported
numbers are generated tokens / wall seconds, median of ``--repeats`` runs.

``--contention N`` adds the co-located-load case (issue #22): every timed repeat runs twice, quiet and
then with N processes spinning (``python -c "while True: pass"``, started just before and killed just
after that run), so quiet and contended runs interleave in time; the table prints the contended
median next to the quiet one and their ratio. vLLM's runner does the same inside its process.

Next to each tok/s the table prints its fraction of the machine's bound, measured in the same run,
before the engines and again after them, the best of each kept (``hw_bounds.py``): batched workloads
against matmul FLOP/s in the engine's dtype (model FLOPs per token), single stream against
streaming-read bandwidth (the weight bytes that engine reads per token: the GGUF's for deepinfer's
default model, the HF copy's in its dtype for vLLM / HF).

Usage (system python; vLLM runs in its own venv through a subprocess)::

    HF_HUB_OFFLINE=1 python benchmarks/throughput.py \\
        --engines deepinfer,hf,vllm --vllm-python "$VLLM_PYTHON"

Machine-specific paths come from flags or the environment, never from this file: ``--model-dir``
(``$HF_MODEL_DIR``; default: deepinfer's own HF conversion of the default model, in its cache dir) and
``--vllm-python`` (``$VLLM_PYTHON``; without either, vLLM is skipped), ``--llamacpp-python``
(``$LLAMACPP_PYTHON``, a venv with ``llama-cpp-python``: the single workload on deepinfer's GGUF).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the vLLM subprocess gets the environment as the user gave it, whatever this process sets later
USER_ENV = dict(os.environ)

import hw_bounds  # noqa: E402 - sibling modules (the script's directory is on sys.path); neither loads torch
from spinners import spinning  # noqa: E402

import deepinfer  # noqa: E402,F401 - before anything loads torch, so this process gets its OpenMP settings

HERE = Path(__file__).resolve().parent

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in simple terms.",
    "Write a haiku about autumn rain.", "How do magnets work?",
    "What are the benefits of regular exercise?", "Give me three tips for learning a new language.",
    "Why is the sky blue?", "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet.", "How does a refrigerator keep food cold?",
    "What is a prime number? Give examples.", "Suggest a healthy breakfast.",
    "How do airplanes stay in the air?", "What causes earthquakes?",
    "Explain what a black hole is.", "Write a short poem about the ocean.",
    "What is machine learning?", "How can I improve my sleep?",
    "What is the Pythagorean theorem?", "Describe the water cycle.",
    "What is inflation in economics?", "How do vaccines work?",
    "Write a Python function that reverses a string.", "What are the planets in our solar system?",
    "Why do leaves change color in the fall?", "How does the internet work?",
    "What is the tallest mountain in the world?", "Give me a recipe for pancakes.",
    "What is democracy?", "Explain the theory of evolution briefly.",
    "How do I make a good first impression?", "What is the speed of light?",
    "Translate 'good morning' into Spanish and German.", "What is climate change?",
    "How does a bicycle stay upright?", "Tell me a fun fact about octopuses.",
    "What is the difference between weather and climate?", "How do I start a vegetable garden?",
    "What is an atom made of?", "Explain recursion to a beginner.",
    "Who painted the Mona Lisa?", "What are renewable energy sources?",
    "How does the heart pump blood?", "What is a haiku?",
    "Give me ideas for a rainy day.", "What is the boiling point of water?",
    "How do bees make honey?", "Explain supply and demand.",
    "What is a noun? Give examples.", "How can I reduce stress at work?",
    "What was the Renaissance?", "Describe how a rainbow forms.",
    "Write a limerick about a cat.", "What is DNA?",
    "How do solar panels generate electricity?", "What are the main food groups?",
    "Why do we have seasons?", "What is the largest ocean on Earth?",
    "Explain what an API is.", "How do I write a good resume?",
    "What is gravity?", "Name three famous composers and one work by each.",
    "How are clouds formed?", "What is the meaning of the word 'serendipity'?",
]  # fmt: skip

SYSTEM_PROMPT = (
    "You are Atlas, a knowledgeable, patient and friendly assistant working for the Riverside Public "
    "Library. Your job is to help visitors of every age and background with questions about science, "
    "history, literature, mathematics, cooking, gardening, technology, health and everyday life. "
    "Follow these rules carefully. First, always answer in clear, plain English and avoid jargon; "
    "when a technical term is unavoidable, define it in one short sentence. Second, keep answers "
    "focused: start with a direct answer, then add at most three supporting points or steps. Third, "
    "be honest about uncertainty: if you do not know something, say so and suggest where in the "
    "library the visitor could look, such as the reference desk, the periodicals room on the second "
    "floor, the children's corner, or the digital archive terminals near the main entrance. Fourth, "
    "never give medical, legal or financial advice that could replace a professional; instead give "
    "general information and recommend consulting a qualified expert. Fifth, be inclusive and "
    "respectful, and never make assumptions about a visitor's age, gender, culture or abilities. "
    "Sixth, when asked for creative writing such as poems, stories or jokes, keep the content "
    "family-friendly and suitable for a public space. Seventh, when asked for code, give short, "
    "well-commented examples in Python unless another language is requested, and explain what the "
    "code does in one or two sentences. Eighth, when the visitor asks for recommendations, suggest "
    "books, magazines or online resources that a public library would typically carry, and mention "
    "that the catalogue can be searched at any terminal or on the library website. Ninth, if a "
    "question is ambiguous, make a reasonable assumption, state it briefly, and answer. Tenth, stay "
    "calm and kind even if the visitor is frustrated. The library is open from nine in the morning "
    "until eight in the evening on weekdays, and from ten until five on weekends. Borrowing is free "
    "with a library card, which any resident can obtain at the front desk with proof of address. "
    "Now answer the visitor's question below."
)

LONG_REPEAT = 4  # the long workload's system prompt, this many times over

Prompts = list[list[int]]
Runs = dict[str, list[Prompts]]  # workload -> [warm-up prompts, repeat 1 prompts, ...]


def build_runs(tok: Any, num_prompts: int, repeats: int) -> Runs:
    """`repeats` timed runs after one warm-up, each with its own prompts (see the module docstring)."""
    def encode(msgs: list[dict[str, str]]) -> list[int]:
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    qs = [QUESTIONS[i % len(QUESTIONS)] for i in range(num_prompts)]
    runs: Runs = {"chat": [], "shared": [], "single": [], "long": []}
    long_system = " ".join([SYSTEM_PROMPT] * LONG_REPEAT)
    for r in range(repeats + 1):
        users = [f"(run {r}) {q}" for q in qs]
        runs["chat"].append([encode([{"role": "user", "content": u}]) for u in users])
        runs["shared"].append(
            [
                encode([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": u}])
                for u in users
            ]
        )
        runs["single"].append(runs["chat"][-1][:1])
        runs["long"].append([encode([{"role": "system", "content": long_system}, {"role": "user", "content": users[0]}])])
    return runs


def summarize(
    engine: str, name: str, walls: list[float], outs: list[list[int]], prompts: Prompts, contention: int = 0
) -> dict[str, Any]:
    """With `contention`, `walls` alternate quiet, contended, quiet, ... (see `time_runs`)."""
    contended = walls[1::2] if contention else []
    walls = walls[::2] if contention else walls
    wall = statistics.median(walls)
    ntok = sum(len(o) for o in outs)
    extra = {}
    if contended:
        extra = {"contention": contention, "contended_walls": contended,
                 "contended_tok_per_s": ntok / statistics.median(contended)}
    return {**extra,
        "engine": engine,
        "workload": name,
        "num_prompts": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "generated_tokens": ntok,
        "wall_s": wall,
        "tok_per_s": ntok / wall,
        "best_tok_per_s": ntok / min(walls),
        "walls": walls,
        "first_ids": outs[0],
    }


Gen = Callable[[Prompts], list[list[int]]]


def time_runs(engine: str, runs: Runs, gen: Gen, warmup: Gen | None = None,
              contention: int = 0) -> list[dict[str, Any]]:
    """Warm up, then time each run; with `contention`, every second run has that many spinners beside it."""
    results = []
    for name, plist in runs.items():
        (warmup or gen)(plist[0])
        walls, outs = [], []
        for i, prompts in enumerate(plist[1:]):
            with spinning(contention if i % 2 else 0):
                t = time.perf_counter()
                outs = gen(prompts)
                walls.append(time.perf_counter() - t)
        results.append(summarize(engine, name, walls, outs, plist[-1], contention))
        print(f"  {engine:9s} {name:7s} {contended_note(results[-1])}", file=sys.stderr, flush=True)
    return results


def contended_note(r: dict[str, Any]) -> str:
    note = f"{r['tok_per_s']:8.1f} tok/s"
    if "contended_tok_per_s" in r:
        note += f", with {r['contention']} spinning: {r['contended_tok_per_s']:8.1f} tok/s"
    return note


def run_deepinfer(args: argparse.Namespace, runs: Runs, llm: Any) -> list[dict[str, Any]]:
    from deepinfer import SamplingParams

    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    decode_s: list[float] = []  # a lone request's seconds per token after its first (the warm-up's first)

    def gen(prompts: Prompts) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        if len(outs) == 1 and len(outs[0].outputs[0].token_ids) > 1:
            m, n = outs[0].metrics, len(outs[0].outputs[0].token_ids)
            decode_s.append((m["now"] - m["first_token"]) / (n - 1))
        return [list(o.outputs[0].token_ids) for o in outs]

    results = []
    for name, plist in runs.items():
        decode_s.clear()
        r = time_runs("deepinfer", {name: plist}, gen, contention=args.contention)[0]
        if len(decode_s) > 1:  # a single stream's decode rate alone, as llama.cpp's runner reports its own
            r["decode_tok_per_s"] = 1.0 / statistics.median(decode_s[1:])
        results.append(r)
    dtype = str(llm.engine.core.runner.dtype).removeprefix("torch.")
    return [{**r, "dtype": dtype} for r in results]


def run_hf(args: argparse.Namespace, runs: Runs) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    @torch.inference_mode()
    def gen(prompts: Prompts, max_tokens: int = args.max_tokens) -> list[list[int]]:
        res: list[list[int]] = []
        for i in range(0, len(prompts), args.hf_batch_size):
            chunk = prompts[i : i + args.hf_batch_size]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad,
            )
            res.extend(out[:, width:].tolist())
        return res

    # HF has no compile step or cache to warm: a short warm-up (one batch, 8 tokens) is enough.
    results = time_runs("hf", runs, gen, lambda ps: gen(ps[: args.hf_batch_size], 8), args.contention)
    for r in results:
        r["load_s"] = load_s
        r["dtype"] = "float32"
    return results


def run_baseline(python: str, runner: str, spec: dict[str, Any], env: dict[str, str], timeout: int,
                 log: str | None = None) -> dict[str, Any]:
    """Run `baselines/<runner>` with another venv's `python` on `spec`; its last JSON line (see the runners)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        proc = subprocess.run([python, str(HERE / "baselines" / runner), f.name], env=env, capture_output=True,
                              text=True, timeout=timeout)
    finally:
        os.unlink(f.name)
    if log:
        Path(log).write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"engine"')]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{runner} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}\n{proc.stdout[-2000:]}")
    return json.loads(lines[-1])


def run_vllm(args: argparse.Namespace, runs: Runs) -> list[dict[str, Any]]:
    spec = {
        "model": args.model_dir,
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "dtype": args.vllm_dtype,
        "enforce_eager": args.vllm_eager,
        "enable_prefix_caching": True,
        "max_model_len": 2048,
        "kv_cache_gib": args.vllm_kv_gib,
        "return_token_ids": True,
        "contention": args.contention,
        "workloads": [{"name": n, "runs": p} for n, p in runs.items()],
    }
    env = dict(USER_ENV, HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{len(os.sched_getaffinity(0)) - 1}")
    venv = Path(args.vllm_python).parent.parent  # LD_PRELOAD tcmalloc + iomp as vLLM's CPU docs recommend
    preload = [
        str(p)
        for p in (venv / "lib/preload/libtcmalloc_minimal.so.4", venv / "lib/libiomp5.so")
        if p.exists()
    ]
    if preload and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = ":".join(preload)
    res = run_baseline(args.vllm_python, "vllm_runner.py", spec, env, args.vllm_timeout, args.vllm_log)
    out = []
    for name, w in res["workloads"].items():
        r = summarize("vllm", name, w["walls"], w["token_ids"], runs[name][-1], args.contention)
        r["load_s"] = res["load_s"]
        r["dtype"] = str(res["dtype"]).removeprefix("torch.")
        out.append(r)
        print(f"  vllm      {name:7s} {contended_note(r)}", file=sys.stderr, flush=True)
    return out


def run_llamacpp(args: argparse.Namespace, runs: Runs) -> list[dict[str, Any]]:
    """llama.cpp on the same GGUF as deepinfer (single stream only: its Python binding decodes one sequence
    at a time), in its own venv through `baselines/llamacpp_runner.py`."""
    from deepinfer.weights import resolve_model

    gguf = resolve_model(args.deepinfer_model).source
    if gguf.suffix != ".gguf":
        sys.exit(f"llamacpp needs a .gguf model; deepinfer's model is {gguf}")
    single = {n: p for n, p in runs.items() if n in ("single", "long")}
    if not single:
        print("llamacpp runs the single-stream workloads only; skipped", file=sys.stderr)
        return []
    spec = {"gguf": str(gguf), "n_threads": len(os.sched_getaffinity(0)), "max_tokens": args.max_tokens,
            "decode_only": args.llamacpp_decode_only, "contention": args.contention,
            "workloads": [{"name": n, "runs": p} for n, p in single.items()]}
    res = run_baseline(args.llamacpp_python, "llamacpp_runner.py", spec, dict(USER_ENV), args.vllm_timeout)
    out = []
    for name, w in res["workloads"].items():
        r = summarize("llamacpp", name, w["walls"], w["token_ids"], runs[name][-1], args.contention)
        r.update(load_s=res["load_s"], dtype="gguf", decode_only=res["decode_only"],
                 decode_tok_per_s=1.0 / w["decode_s_per_token"])
        out.append(r)
        print(f"  llamacpp  {name:7s} {contended_note(r)}", file=sys.stderr, flush=True)
    return out


def bound_fraction(r: dict[str, Any], bounds: tuple[Any, Any] | None, args: argparse.Namespace,
                   tok_per_s: float) -> str:
    """`tok_per_s` as a fraction of the machine's bound for `r`'s engine and workload ('-' unmeasured)."""
    if bounds is None:
        return "-"
    machine, cost = bounds
    dtype = r.get("dtype", "float32")
    gguf = r["engine"] == "llamacpp" or (
        r["engine"] == "deepinfer" and (args.deepinfer_model is None or args.deepinfer_model.endswith(".gguf")))
    if r["engine"] == "llamacpp" and r["workload"] == "single":
        dtype = "float32"  # reads the GGUF blocks: the memory bound does not depend on a compute dtype
    if dtype not in machine.flops or r["workload"] == "long":
        return "-"
    frac, kind = hw_bounds.fraction(tok_per_s, r["workload"] == "single", machine, cost, dtype, gguf)
    return f"{frac:.2f} {kind}"


def print_table(results: list[dict[str, Any]], bounds: tuple[Any, Any] | None = None,
                args: argparse.Namespace | None = None) -> None:
    base = {r["workload"]: r for r in results if r["engine"] == "deepinfer"}
    contended = any("contended_tok_per_s" in r for r in results)
    hdr = (f"{'engine':10s} {'workload':8s} {'prompts':>7s} {'prompt_tok':>10s} {'gen_tok':>8s} {'wall_s':>8s} "
           f"{'tok/s':>9s} {'of bound':>9s} {'best':>9s} {'load_s':>7s} {'deepinfer/x':>11s} {'same_ids':>8s}")
    if contended:
        hdr += f" {'contended':>9s} {'of bound':>9s} {'c/quiet':>7s} {'deepinfer/x':>11s}"
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        b = base.get(r["workload"])
        ratio = f"{b['tok_per_s'] / r['tok_per_s']:.2f}x" if b else "-"
        same = "-" if not b else ("yes" if b["first_ids"] == r["first_ids"] else "no")
        load = f"{r['load_s']:.1f}" if "load_s" in r else "-"
        line = (
            f"{r['engine']:10s} {r['workload']:8s} {r['num_prompts']:7d} {r['prompt_tokens']:10d} "
            f"{r['generated_tokens']:8d} {r['wall_s']:8.2f} {r['tok_per_s']:9.1f} "
            f"{bound_fraction(r, bounds, args, r['tok_per_s']):>9s} {r['best_tok_per_s']:9.1f} {load:>7s} "
            f"{ratio:>11s} {same:>8s}"
        )
        if "contended_tok_per_s" in r:
            c = r["contended_tok_per_s"]
            cratio = f"{b['contended_tok_per_s'] / c:.2f}x" if b and "contended_tok_per_s" in b else "-"
            line += (f" {c:9.1f} {bound_fraction(r, bounds, args, c):>9s} {c / r['tok_per_s']:7.2f} "
                     f"{cratio:>11s}")
        print(line)
    single = {r["engine"]: r["tok_per_s"] for r in results if r["workload"] == "single"}
    if single:
        print("single-stream decode tok/s: " + ", ".join(f"{e}={v:.1f}" for e, v in single.items()))
    for r in results:
        if r["engine"] == "llamacpp":
            how = "first prompt token only (--llamacpp-decode-only)" if r["decode_only"] else "whole prompt"
            print(f"llamacpp {r['workload']}: decode alone {r['decode_tok_per_s']:.1f} tok/s; prompt evaluated: {how}")
        elif r["engine"] == "deepinfer" and "decode_tok_per_s" in r:
            print(f"deepinfer {r['workload']}: decode alone {r['decode_tok_per_s']:.1f} tok/s (the tokens after the "
                  "first over the time after it; the tok/s column includes the prompt's prefill)")
    if bounds is not None:
        print(hw_bounds.describe(*bounds))
        print("of bound: tok/s over the bound (cmp: matmul FLOP/s in the engine's dtype / model FLOPs per "
              "token; mem: streaming-read bandwidth / weight bytes per token)")
    if contended:
        print("contended: with --contention processes spinning beside each timed run (median); c/quiet: "
              "contended over quiet tok/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="deepinfer,hf,vllm", help="comma list of deepinfer,hf,vllm,llamacpp")
    ap.add_argument("--workloads", default="chat,shared,single", help="comma list of chat,shared,single,long")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-dir", default=os.environ.get("HF_MODEL_DIR") or None,
                    help="HF dir (tokenizer, HF and vLLM weights); default: $HF_MODEL_DIR, else deepinfer's HF "
                    "conversion of the default model (the GGUF dequantized, in its cache dir)")
    ap.add_argument(
        "--deepinfer-model", default=None, help="model for deepinfer (default: its built-in GGUF)"
    )
    ap.add_argument("--deepinfer-max-num-seqs", type=int, default=256)
    ap.add_argument("--deepinfer-dtype", default="auto", help="auto picks bf16 where the CPU has AVX-512 BF16 / AMX")
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON") or None,
                    help="python of the vLLM venv (default: $VLLM_PYTHON; without either, vllm is skipped)")
    ap.add_argument("--vllm-dtype", default="auto")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM enforce_eager (no torch.compile)")
    ap.add_argument("--vllm-kv-gib", type=float, default=4.0)
    ap.add_argument("--vllm-timeout", type=int, default=3600)
    ap.add_argument("--vllm-log", default=None, help="save the vLLM runner's stdout/stderr here")
    ap.add_argument("--llamacpp-python", default=os.environ.get("LLAMACPP_PYTHON") or None,
                    help="python of a venv with llama-cpp-python (default: $LLAMACPP_PYTHON; without either, "
                    "llamacpp is skipped); it runs the single workload on deepinfer's GGUF")
    ap.add_argument("--llamacpp-decode-only", action="store_true",
                    help="llama.cpp evaluates only each prompt's first token (where longer prompts crash it)")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--contention", type=int, default=0,
                    help="also time every repeat with N processes spinning beside it (co-located load)")
    ap.add_argument("--no-bounds", action="store_true",
                    help="skip measuring the machine's matmul FLOP/s and read bandwidth (the 'of bound' column)")
    args = ap.parse_args()

    load0 = os.getloadavg()
    engines = [e for e in args.engines.split(",") if e]
    if "vllm" in engines and (args.vllm_python is None or not Path(args.vllm_python).exists()):
        print(f"vLLM python not found ({args.vllm_python or 'give --vllm-python or $VLLM_PYTHON'}); skipping vllm",
              file=sys.stderr)
        engines.remove("vllm")
    if "llamacpp" in engines and (args.llamacpp_python is None or not Path(args.llamacpp_python).exists()):
        print(f"llama.cpp python not found ({args.llamacpp_python or 'give --llamacpp-python or $LLAMACPP_PYTHON'})"
              "; skipping llamacpp", file=sys.stderr)
        engines.remove("llamacpp")
    if args.model_dir is None:
        from deepinfer.weights import resolve_model

        args.model_dir = str(resolve_model(None).directory)

    llm: Any = None
    deepinfer_load = 0.0
    if "deepinfer" in engines:
        from deepinfer import LLM

        t0 = time.perf_counter()
        llm = LLM(
            model=args.deepinfer_model,
            dtype=args.deepinfer_dtype,
            max_num_seqs=args.deepinfer_max_num_seqs,
            enable_prefix_caching=True,
        )
        deepinfer_load = time.perf_counter() - t0
    if Path(args.model_dir, "tokenizer.json").exists():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model_dir)
    elif llm is not None:
        tok = llm.get_tokenizer()
    else:
        sys.exit(f"no tokenizer: {args.model_dir} missing and deepinfer not selected")
    runs = build_runs(tok, args.num_prompts, args.repeats * (2 if args.contention else 1))
    wanted = args.workloads.split(",")
    runs = {k: v for k, v in runs.items() if k in wanted}

    bounds = None
    if not args.no_bounds:  # measured before any engine runs, and again after them (see below)
        gguf_file = None
        if "deepinfer" in engines:
            from deepinfer.weights import resolve_model

            src = resolve_model(args.deepinfer_model).source
            gguf_file = str(src) if src.suffix == ".gguf" else None
        bounds = (hw_bounds.measure_machine(), hw_bounds.model_cost(args.model_dir, gguf_file))
        print(hw_bounds.describe(*bounds), file=sys.stderr, flush=True)

    results: list[dict[str, Any]] = []
    for engine in engines:
        if engine == "deepinfer":
            res = run_deepinfer(args, runs, llm)
            for r in res:
                r["load_s"] = deepinfer_load
            llm = None  # free its KV cache before the next engine
            gc.collect()
        elif engine == "hf":
            res = run_hf(args, runs)
        elif engine == "vllm":
            res = run_vllm(args, runs)
        elif engine == "llamacpp":
            res = run_llamacpp(args, runs)
        else:
            sys.exit(f"unknown engine {engine!r}")
        results.extend(res)
    if bounds is not None:  # the best of both measurements: a slow moment at the start inflated every fraction
        after = hw_bounds.measure_machine(tuple(bounds[0].flops))
        print(f"bounds again after the engines: {hw_bounds.describe(after, bounds[1])}", file=sys.stderr, flush=True)
        bounds = (hw_bounds.best_of(bounds[0], after), bounds[1])
    print_table(results, bounds, args)
    print(
        f"load average (1/5/15 min) at end: {os.getloadavg()} -- >0.5 means something else competed for CPU"
    )
    if args.json_out:
        meta = {"config": vars(args), "loadavg_start": load0, "loadavg_end": os.getloadavg()}
        Path(args.json_out).write_text(json.dumps({**meta, "results": results}, indent=1))
        from deepinfer.bench.plots import plot_after_run

        plot_after_run(args.json_out)  # tok/s per workload and engine, next to the JSON


if __name__ == "__main__":
    main()
