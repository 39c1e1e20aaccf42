"""Where an EP=2 decode step's CPU goes, per rank: cProfile inside both rank processes of `benchmarks/eplb.py`'s
workload (same model, prompts and engine settings), one configuration per run.

Each rank's engine process runs under cProfile with `time.process_time` as its clock (the process's CPU, all
threads: gloo's work shows up under the collective that waits for it), switched on at balancer step
`--start` (after the warm-up batch and EPLB's re-placement in it) and dumped when the engine exits, to
`<out>/<label>_rank<r>_steps<n>.prof` (n: the steps profiled). Printed: per rank, CPU ms per decode step
of the phases of the MoE layer (replica choice, the all_to_all exchanges, grouping and the expert matmuls)
and of the step around it (the balancer's bookkeeping, the per-step stats, the attention layers as a gauge
of the machine's speed, which no EPLB setting changes), and the collectives per step.

Run (one configuration per process; interleave them on a shared machine):
    PYTHONPATH=. python3 benchmarks/eplb_profile.py --redundant 0 --out /tmp/prof
    PYTHONPATH=. python3 benchmarks/eplb_profile.py --redundant 4 --out /tmp/prof
`--redundant -1`: EPLB off.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import tempfile
from pathlib import Path

# phases printed: label -> (file, function) in the profile
PHASES = {
    "decode step (engine step_tokens)": ("engine.py", "step_tokens"),
    "MoE layers (EP forward)": ("ep_moe.py", "forward"),
    "- replica choice": ("ep_moe.py", "_choose_slots"),
    "- exchange: pair counts": ("ep_moe.py", "exchange_counts"),
    "- exchange: rows (dispatch, combine)": ("ep_moe.py", "exchange"),
    "- experts: group + matmuls": ("ep_moe.py", "_compute_pairs"),
    "step end (finish_tick)": ("expert_parallel.py", "finish_tick"),
    "balancer end_step": ("balancer.py", "end_step"),
    "engine stats (sent every step)": ("engine.py", "stats"),
    "attention layers (gauge)": ("llama.py", "DecoderAttention.forward"),
}


def _profiled_engine_main(config, commands, outputs, log_level, rank=None) -> None:
    """The rank process's main under cProfile from balancer step EPLB_PROFILE_START on (runs in the child)."""
    import cProfile
    import time

    import deepinfer.engine.expert_parallel as xp
    from deepinfer.engine import process_engine

    prof = cProfile.Profile(time.process_time)
    state = {"from": None, "ep": None}
    start = int(os.environ["EPLB_PROFILE_START"])
    finish_tick = xp.ExpertParallel.finish_tick

    def tick(self, stopping: bool = False) -> bool:
        out = finish_tick(self, stopping)
        if state["from"] is None and self.balancer is not None and self.balancer.steps >= start:
            state["from"], state["ep"] = self.balancer.steps, self
            prof.enable()
        return out

    xp.ExpertParallel.finish_tick = tick
    try:
        process_engine._engine_main(config, commands, outputs, log_level, rank)
    finally:
        prof.disable()
        steps = state["ep"].balancer.steps - state["from"] if state["ep"] is not None else 0
        prof.dump_stats(os.path.join(os.environ["EPLB_PROFILE_OUT"],
                                     f"{os.environ['EPLB_PROFILE_LABEL']}_rank{rank.rank}_steps{steps}.prof"))


def summarise(files: list[Path]) -> str:
    import inspect
    import pstats

    from deepinfer.models.llama import DecoderAttention

    attention_line = inspect.getsourcelines(DecoderAttention.forward)[1]

    lines = ["| per rank, per decode step | " + " | ".join(f.stem.split("_")[-2] for f in files) + " |",
             "|---|" + "---|" * len(files)]
    tables = []
    for f in files:
        steps = int(re.search(r"steps(\d+)", f.stem).group(1)) or 1
        stats = pstats.Stats(str(f)).stats
        rows = {}
        for label, (file, fn) in PHASES.items():
            line = attention_line if fn == "DecoderAttention.forward" else None
            fn = fn.rpartition(".")[2]
            hits = [v for (path, at, name), v in stats.items()
                    if path.endswith("/" + file) and name == fn and line in (None, at)]
            # the outermost entry of a name (largest cumulative time): a layer's forward, not a helper's
            rows[label] = 1000 * max((v[3] for v in hits), default=0.0) / steps
        a2a = [v for (path, _, name), v in stats.items() if name == "all_to_all_single" and path.endswith(".py")]
        rows["all_to_all calls"] = (a2a[0][1] / steps) if a2a else 0.0
        tables.append(rows)
    for label in [*PHASES, "all_to_all calls"]:
        unit = "" if "calls" in label else " (CPU ms)"
        lines.append(f"| {label}{unit} | " + " | ".join(f"{t[label]:.2f}" for t in tables) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redundant", type=int, default=0, help="redundant experts R (-1: EPLB off)")
    ap.add_argument("--out", required=True, help="directory for the .prof files")
    ap.add_argument("--label", default=None, help="file prefix (default R<r> / off)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--interval", type=int, default=16)
    ap.add_argument("--batches", type=int, default=3, help="timed batches after the warm-up")
    ap.add_argument("--start", type=int, default=60, help="balancer step the profile starts at")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skew", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import eplb  # benchmarks/eplb.py: the same model and workload

    from deepinfer import LLM, SamplingParams
    from deepinfer.engine import process_engine

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    label = args.label or ("off" if args.redundant < 0 else f"R{args.redundant}")
    os.environ.update(EPLB_PROFILE_START=str(args.start), EPLB_PROFILE_OUT=str(out), EPLB_PROFILE_LABEL=label)
    process_engine._engine_main = _profiled_engine_main  # the spawned ranks run it (pickled by name)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 2048) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    kw = {} if args.redundant < 0 else dict(enable_eplb=True, num_redundant_experts=args.redundant)
    with tempfile.TemporaryDirectory() as tmp:
        path = eplb.build_model(Path(tmp), args.skew, args.seed)
        with LLM(str(path), dtype="float32", kv_cache_memory="256MiB", profile_cost_model=False,
                 expert_parallel_size=2, eplb_step_interval=args.interval, eplb_window_steps=args.interval,
                 max_num_seqs=args.requests, num_threads=args.threads, **kw) as llm:
            for _ in range(1 + args.batches):
                llm.generate(prompts, sp)
    print(summarise(sorted(out.glob(f"{label}_rank*_steps*.prof"))))


if __name__ == "__main__":
    main()
