"""EPLB on this machine: an ~100M-parameter MoE with skewed routing, EP=2, EPLB off vs on (R = 0, 2, 4).

The model: a Qwen3-MoE with random weights (hidden 512, 8 layers, all sparse, 16 experts of intermediate
512, top-2, 8 heads of 64, vocab 2048): ~110M parameters, ~101M of them routed experts. The skew: in every
layer the gate rows of experts 4..7 (all on rank 0 under EP=2's contiguous split, and not the first
experts, which the initial placement's redundant slots copy) are rewritten to +-`--skew` * u (u a random
unit vector per layer; experts 4 and 6 along +u, 5 and 7 along -u, the other rows scaled by 0.1), so the
sign of x . u sends most tokens' two picks to {4, 6} or {5, 7}. The share of
(token, expert) pairs those four experts receive is measured and printed.

Per configuration (one engine of two rank processes, each with `--threads` CPU threads), the same workload:
`--requests` prompts of `--prompt-len` random tokens, `--max-tokens` greedy tokens each (ignore_eos), spread
by the front end over the two ranks. A warm-up batch first (long enough for EPLB to re-place: interval and
window `--interval` steps), then `--repeats` timed batches; configurations run in the order off, R0, R2, R4,
then again in reverse (ABBA), each start a fresh engine. Reported (medians over the timed batches):

- imbalance: max / mean of per-rank expert tokens ((token, expert) pairs each rank computed) over the
  balancer's last interval (the engine's own measure, also on /metrics as deepinfer:eplb_imbalance);
- decode step time: the batch's wall time / the engine steps it took (all requests decode together);
- throughput: generated tokens / wall time;
- memory per rank: each rank process's resident set (RSS) after the run, and its routed-expert weights;
- the mechanism, independent of the machine's load (rank 0 / rank 1, per engine step of the timed batches,
  summed over the 8 MoE layers): expert pairs computed, expert weight reads (slots that ran a matmul: each
  reads the slot's 3 MiB of weights), and the expert compute seconds (`ExpertStats`). A code version
  without the weight-read counter prints "-" for it;
- CPU ms per step per rank: each rank process's CPU time (user + system, all its threads: gloo's included)
  over the timed batches / their engine steps; on a shared machine less noisy than the wall clock.

Run: PYTHONPATH=. python3 benchmarks/eplb.py  (about 10 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import hw_bounds  # a sibling module (the script's directory is on sys.path); it loads no torch
import torch

# the skewed experts: all on rank 0 under EP=2's contiguous split, and not the ones the initial placement's
# redundant slots replicate (the first experts), so only EPLB can relieve rank 0
HOT = (4, 5, 6, 7)


def build_model(root: Path, skew: float, seed: int) -> Path:
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from deepinfer.weights import resolve_model

    tok_dir = resolve_model(None).directory
    cfg = Qwen3MoeConfig(vocab_size=2048, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512,
                         num_experts=16, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_hidden_layers=8,
                         max_position_embeddings=2048, tie_word_embeddings=False, initializer_range=0.05,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = root / "moe100m"
    model.save_pretrained(path)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(tok_dir)).save_pretrained(path)  # only for the engine's start-up
    weights = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    for name, w in weights.items():
        if name.endswith("mlp.gate.weight"):
            u = torch.randn(w.shape[1], generator=gen)
            u = skew * u / u.norm()
            w = w.clone() * 0.1
            w[HOT[0]] += u
            w[HOT[2]] += 0.9 * u
            w[HOT[1]] -= u
            w[HOT[3]] -= 0.9 * u
            weights[name] = w
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    n = sum(t.numel() for t in weights.values())
    experts = sum(t.numel() for k, t in weights.items() if ".experts." in k)
    print(f"model: {n / 1e6:.1f}M parameters ({experts / 1e6:.1f}M in routed experts), skew {skew}")
    return path


def run_config(path: Path, label: str, kwargs: dict, args, prompts) -> dict:
    import psutil

    from deepinfer import LLM, SamplingParams

    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    out: dict = {"label": label, "wall": [], "step": [], "imb": [], "pairs": [], "reads": [], "secs": [], "cpu": []}
    with LLM(str(path), dtype="float32", kv_cache_memory="256MiB", profile_cost_model=False,
             expert_parallel_size=2, eplb_step_interval=args.interval, eplb_window_steps=args.interval,
             max_num_seqs=args.requests, num_threads=args.threads, **kwargs) as llm:
        procs = [psutil.Process(r._proc.pid) for r in llm.ranks.ranks]
        llm.generate(prompts, sp)  # warm-up: EPLB re-places at least once here
        for _ in range(args.repeats):
            b = llm.stats()["eplb"]
            cpu = [sum(p.cpu_times()[:2]) for p in procs]
            started = time.perf_counter()
            llm.generate(prompts, sp)
            wall = time.perf_counter() - started
            cpu = [sum(p.cpu_times()[:2]) - c for p, c in zip(procs, cpu, strict=True)]
            e = llm.stats()["eplb"]
            steps = max(1, e["steps"] - b["steps"])
            out["cpu"].append([c / steps for c in cpu])
            out["wall"].append(wall)
            out["step"].append(wall / steps)
            out["imb"].append(e["imbalance"])
            for key, name in (("pairs", "expert_tokens_total"), ("reads", "expert_weight_reads_total"),
                              ("secs", "expert_compute_seconds_total")):
                out[key].append([(r.get(name, float("nan")) - q.get(name, float("nan"))) / steps
                                 for r, q in zip(e["ranks"], b["ranks"], strict=True)])
        e = llm.stats()["eplb"]
        out["rss"] = [p.memory_info().rss for p in procs]
        routed = torch.tensor([r["window_routed"] for r in e["ranks"]]).sum(0)  # [layers, experts]
        out["hot_share"] = float(routed[:, list(HOT)].sum() / routed.sum())
        out["placement0"] = e["placement"][0]
        out["rebalances"] = e["rebalances"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--interval", type=int, default=16, help="EPLB interval and window, in steps")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skew", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per rank process (torch)")
    hw_bounds.add_flag(ap, "; the MoE's FLOPs per token count the routed experts at top-k of their number")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 2048) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    configs = [("EPLB off", {}), ("EPLB R=0", dict(enable_eplb=True, num_redundant_experts=0)),
               ("EPLB R=2", dict(enable_eplb=True, num_redundant_experts=2)),
               ("EPLB R=4", dict(enable_eplb=True, num_redundant_experts=4))]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp), args.skew, args.seed)
        bounds = hw_bounds.RunBounds(str(path)) if args.bounds else None  # before the engines, and again after
        results: dict[str, list[dict]] = {label: [] for label, _ in configs}
        for label, kw in [*configs, *reversed(configs)]:  # ABBA: both halves see the machine's drift
            r = run_config(path, label, kw, args, prompts)
            results[label].append(r)
            print(f"  {label}: wall {[round(w, 2) for w in r['wall']]} s, imbalance {[round(i, 3) for i in r['imb']]},"
                  f" CPU ms/step {[[round(1000 * c, 1) for c in x] for x in r['cpu']]},"
                  f" rebalances {r['rebalances']}, layer-0 placement {r['placement0']}", flush=True)
        if bounds is not None:
            bounds.remeasure()
            print(bounds.describe())
    tokens = args.requests * args.max_tokens
    slot_bytes = 8 * 3 * 512 * 512 * 4  # one expert slot in each of the 8 layers, fp32
    share = statistics.median(r["hot_share"] for runs in results.values() for r in runs)
    print(f"\nskew: experts 4-7 (of 16) receive {100 * share:.1f}% of the (token, expert) pairs (median over runs)")
    base = None
    print(f"{args.requests} requests x {args.max_tokens} tokens, EP=2 ({args.threads} thread(s) per rank), "
          f"interval {args.interval}")
    print("| config | imbalance | decode step (ms) | throughput (tok/s) | of bound | vs off | RSS per rank (MiB) | "
          "expert weights per rank (MiB) | pairs / step per rank | weight reads / step per rank | "
          "expert ms / step per rank | CPU ms / step per rank |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, kw in configs:
        runs = results[label]
        imb = statistics.median(i for r in runs for i in r["imb"])
        step = statistics.median(s for r in runs for s in r["step"])
        thr = statistics.median(tokens / w for r in runs for w in r["wall"])
        base = base or thr
        rss = [statistics.median(r["rss"][k] for r in runs) / 2**20 for k in range(2)]
        slots = (16 + kw.get("num_redundant_experts", 0)) // 2
        per_rank = {key: [statistics.median(x[k] for r in runs for x in r[key]) for k in range(2)]
                    for key in ("pairs", "reads", "secs", "cpu")}
        reads = "-" if per_rank["reads"][0] != per_rank["reads"][0] else "{:.1f} / {:.1f}".format(*per_rank["reads"])
        frac = bounds.of(thr, False, "float32") if bounds is not None else "-"
        print(f"| {label} | {imb:.3f} | {1000 * step:.1f} | {thr:.1f} | {frac} | {thr / base:.3f} | "
              f"{rss[0]:.0f} / {rss[1]:.0f} | {slots * slot_bytes / 2**20:.0f} | "
              "{:.1f} / {:.1f} | ".format(*per_rank["pairs"]) + reads + " | "
              "{:.1f} / {:.1f} | ".format(*(1000 * x for x in per_rank["secs"])) +
              "{:.1f} / {:.1f} |".format(*(1000 * x for x in per_rank["cpu"])))


if __name__ == "__main__":
    main()
