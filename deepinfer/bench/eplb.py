"""`deepinfer bench eplb`: expert-parallel load balancing at 64-128 ranks, by simulation.

Per-step routing (a recorded trace, `eplb_trace.py`, or a Zipf prior) is replayed against N modelled ranks
holding one MoE layer's E experts (+ R redundant slots) each, once per R, with the placement code the
runtime uses (`deepinfer.eplb`): EPLB off (the contiguous `initial_placement`, R = 0) and EPLB on (every
`interval` steps the balancer's rule, `eplb.policy.plan_placement`, on the `ExpertLoadWindow` of the last
`window` steps: of two `balanced_placement`s, where a c-th replica needs c x `split_rows` rows of the expert
per rank or in all ranks in the window's median step, the one whose busiest rank costs less in rows plus
weight reads, kept only if it lowers the busiest rank's load by `MIN_GAIN`).

Routing at scale. A small model's routing (4-16 experts, a few tokens per step) becomes E experts (default
256, top-8, DeepSeek-V3/V4's) and tokens_per_rank * N tokens per step like this:
  1. each recorded layer's expert shares over the trace, sorted descending, are a curve over the expert
     rank fraction x = (i + 0.5) / E_rec; the E new experts take log-linear interpolations of that curve at
     x = (j + 0.5) / E (the same shape of skew: hottest-to-coldest profile stretched to E experts), renormalised,
     then shuffled (a seeded permutation per simulated layer: hot experts are not neighbours). Without a
     trace, the shares are Zipf: (j + 1)^-zipf.
  2. popularity drifts: log-weight_e(t) = log share_e + d_e(t), d an AR(1) process per expert with
     stationary deviation `drift` and correlation time `drift_steps` steps (content shifts what is hot).
  3. each token picks k distinct experts without replacement in proportion to the weights (Plackett-Luce,
     as Gumbel-top-k; `topk_counts`); a step's counts are the layer's loads.
  4. the ranks' tokens are the same number each (data-parallel decode), so each expert's pairs of a step
     come from the ranks as a uniform multinomial split (the same split for every R: one seeded stream).
  A trace whose E equals --experts can be replayed as recorded (`--replay-direct`).

Cost model (per MoE layer, per step; stated defaults are an H200-class accelerator at DeepSeek-V3's expert
shape, or `--measure-expert-cost` times a real matmul of the expert shape on this machine):
  replica choice = the engine's (`eplb.policy`, as `layers/ep_moe.py` runs it): a source rank's n pairs of
                   an expert with c replicas go to u = min(c, max(1, n // split_rows)) replicas in that
                   rank's order of preference (its own replica first, else a rotation), in chunks equal to
                   within one; with few rows per rank (n < 2 x split_rows) all to ONE replica, not split
  rank compute   = tokens_r * t_token + active slots * t_slot: t_token = 6 * H * I flops / `tflops`, t_slot
                   = one expert's weights (3 * H * I * weight_bytes) / `hbm_gbps`, read once per step by
                   each slot that got rows (a slot without rows reads nothing, as in the engine)
  all-to-all     = dispatch + combine, each latency + max over ranks of max(sent, received) pairs * H *
                   bytes / `link_gbps`, counting the pairs that leave their source rank under the replica
                   choice (a rank's pairs of an expert it holds stay home), so routing imbalance slows the
                   exchange too; dispatch in `dispatch_bytes` per element (fp8), combine `combine_bytes` (bf16)
  step time      = sum over layers of dispatch + max over ranks of compute + combine (all ranks wait at
                   the combine); waiting = sum over ranks of (max - own compute); imbalance = max / mean of
                   the ranks' tokens. Steps before the first rebalance are warm-up and not reported.
  memory of R    = R / N replicas per rank * 3 * H * I * weight_bytes * `model_moe_layers`.

It is a model: no attention time (data parallel, the same on every rank), no shared expert, no overlap of
communication with compute, weight movement at a rebalance is free (its size is reported). `split_rows`
defaults to the engine's `SPLIT_ROWS` (16, measured on this repository's CPU); the stated accelerator costs
would put the break-even at t_slot / t_token rows (~42 at the defaults), which `--split-rows` can model.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from deepinfer.bench.eplb_trace import RoutingTrace, load_trace, max_over_mean, record_trace
from deepinfer.config import _f
from deepinfer.eplb import ExpertLoadWindow, Placement, initial_placement, moved_slots
from deepinfer.eplb.policy import SPLIT_ROWS, plan_placement, replica_preference

DEFAULT_REDUNDANT = (0, 64, 128, 192, 256, 384, 512)


@dataclass(frozen=True)
class EplbSimConfig:
    """Expert-parallel load balancing replayed against modelled ranks."""

    trace: str | None = _f(None, "Routing trace (deepinfer-routing-trace jsonl, see deepinfer/bench/eplb_trace.py) "
                           "whose skew to scale up. Default: a Zipf prior (--zipf).")
    record_trace: str | None = _f(None, "Record a routing trace from a real run of --record-model into this file "
                                  "first, then simulate from it.")
    record_model: str | None = _f(None, "MoE model (HF directory: Qwen3-MoE, Mixtral, DeepSeek-V4) to record.")
    record_skew: float = _f(1.0, "Gate bias for the recording: -s * ln(1 + rank_e) added to the router logits.")
    record_prompts: int = _f(16, "Recording: prompts in the batch (random token ids).")
    record_prompt_len: int = _f(32, "Recording: tokens per prompt.")
    record_tokens: int = _f(32, "Recording: tokens generated per prompt (greedy, EOS ignored).")
    replay_direct: bool = _f(False, "Replay the trace's counts as recorded (needs its expert count = --experts; "
                             "tokens per step are the trace's) instead of scaling its skew.")
    zipf: float = _f(0.6, "Without a trace: expert shares (j + 1)^-zipf.")
    ranks: tuple[int, ...] = _f((64, 128), "Rank counts (expert-parallel size) to simulate.", nargs="+")
    redundant: tuple[int, ...] = _f(DEFAULT_REDUNDANT, "Redundant expert slots R to compare (a value with "
                                    "(experts + R) % ranks != 0 is skipped: slots per rank are uniform).", nargs="+")
    experts: int = _f(256, "Routed experts per MoE layer (DeepSeek-V3/V4: 256).")
    top_k: int = _f(8, "Experts per token (DeepSeek-V3/V4: 8).")
    layers: int = _f(4, "MoE layers simulated (each with its own hot experts; step time sums them).")
    tokens_per_rank: int = _f(128, "Tokens per rank per step (decode batch of each data-parallel rank).")
    steps: int = _f(300, "Steps simulated (the first --interval are warm-up).")
    window: int = _f(50, "EPLB: steps of counts a rebalance reads (--eplb-window-steps).")
    interval: int = _f(50, "EPLB: steps between rebalances (--eplb-step-interval).")
    drift: float = _f(0.3, "Popularity drift: stationary std of each expert's log-weight deviation.")
    drift_steps: float = _f(200.0, "Popularity drift: correlation time in steps.")
    num_nodes: int | None = _f(None, "Hierarchical placement: ranks grouped into this many nodes.")
    split_rows: int = _f(SPLIT_ROWS, "Rows of one expert on one rank that repay a further read of its weights "
                         "(the engine's SPLIT_ROWS): the replica choice and the balancer's replica rule use it.")
    hidden: int = _f(7168, "Expert input width H (DeepSeek-V3: 7168).")
    intermediate: int = _f(2048, "Expert intermediate width I (DeepSeek-V3: 2048).")
    weight_bytes: float = _f(1.0, "Bytes per expert weight (fp8: 1).")
    tflops: float = _f(400.0, "Effective expert GEMM throughput per rank, TFLOP/s (stated: H200-class fp8 "
                       "grouped GEMM at ~20% of peak).")
    hbm_gbps: float = _f(4800.0, "HBM bandwidth per rank, GB/s (H200: 4.8 TB/s), for reading a slot's weights.")
    measure_expert_cost: bool = _f(False, "Time a real matmul of the expert shape on this machine (CUDA if "
                                   "present, else CPU) for t_token and t_slot instead of --tflops/--hbm-gbps.")
    link_gbps: float = _f(400.0, "All-to-all bandwidth per rank and direction, GB/s (stated: NVLink-class "
                          "supernode).")
    a2a_latency_us: float = _f(10.0, "Latency of one all-to-all phase (dispatch or combine), microseconds.")
    dispatch_bytes: float = _f(1.0, "Bytes per element dispatched (fp8).")
    combine_bytes: float = _f(2.0, "Bytes per element combined (bf16).")
    model_moe_layers: int = _f(58, "MoE layers of the modelled model, for the memory of R (DeepSeek-V3: 58).")
    seed: int = _f(0, "Seed of the synthetic routing and the recording.")

    def __post_init__(self) -> None:
        for name in ("ranks", "redundant"):  # the flags give strings
            try:
                object.__setattr__(self, name, tuple(int(x) for x in getattr(self, name)))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{name} must be integers ({e})") from e
        for name in ("experts", "top_k", "layers", "tokens_per_rank", "steps", "window", "interval", "hidden",
                     "intermediate", "weight_bytes", "tflops", "hbm_gbps", "link_gbps", "model_moe_layers", "split_rows",
                     "drift_steps", "record_prompts", "record_prompt_len", "record_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("zipf", "drift", "a2a_latency_us", "dispatch_bytes", "combine_bytes", "record_skew"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} > experts={self.experts}")
        if not self.ranks or any(n <= 0 for n in self.ranks):
            raise ValueError("ranks must be positive")
        if not self.redundant or any(r < 0 for r in self.redundant):
            raise ValueError("redundant slot counts must be >= 0")
        if self.steps <= self.interval:
            raise ValueError(f"steps ({self.steps}) must exceed the rebalance interval ({self.interval})")
        if self.record_trace and not self.record_model:
            raise ValueError("--record-trace needs --record-model (an MoE model directory)")
        if self.record_trace and self.trace:
            raise ValueError("give --trace or --record-trace, not both")
        if self.replay_direct and not (self.trace or self.record_trace):
            raise ValueError("--replay-direct needs a trace")


@dataclass(frozen=True)
class Costs:
    token_s: float  # one (token, expert) pair's expert MLP
    slot_s: float  # reading one slot's weights once
    source: str


@dataclass(frozen=True)
class Row:
    ranks: int
    redundant: int | None  # None: EPLB off
    slots_per_rank: int
    step_ms: float
    expert_ms: float  # sum over layers of the slowest rank's expert compute
    a2a_ms: float
    waiting_ms: float  # rank-ms per step: sum over layers and ranks of (max - own)
    waiting_share: float  # waiting / (ranks * expert_ms)
    imbalance: float  # mean over steps and layers of max / mean rank tokens
    moved_per_rebalance: float  # expert weights brought onto ranks per rebalance, all layers
    replica_bytes_per_rank: float


def stated_costs(cfg: EplbSimConfig) -> Costs:
    flops = 6.0 * cfg.hidden * cfg.intermediate
    slot_bytes = 3.0 * cfg.hidden * cfg.intermediate * cfg.weight_bytes
    return Costs(flops / (cfg.tflops * 1e12), slot_bytes / (cfg.hbm_gbps * 1e9),
                 f"stated: {cfg.tflops:g} TFLOP/s, {cfg.hbm_gbps:g} GB/s HBM")


def measure_costs(cfg: EplbSimConfig, tokens_per_expert: int) -> Costs:
    """t_token and t_slot from timing one expert's SwiGLU MLP (gate/up then down matmul) at n and 2n tokens:
    time(n) = t_slot + n * t_token (median of 5 after a warm-up)."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    h, i = cfg.hidden, cfg.intermediate
    w13 = torch.randn(2 * i, h, device=dev, dtype=dtype) * 0.02
    w2 = torch.randn(h, i, device=dev, dtype=dtype) * 0.02

    def once(n: int) -> float:
        x = torch.randn(n, h, device=dev, dtype=dtype)
        times = []
        for _ in range(6):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            g, u = torch.nn.functional.linear(x, w13).chunk(2, dim=-1)
            torch.nn.functional.linear(torch.nn.functional.silu(g) * u, w2)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return float(np.median(times[1:]))

    n = max(1, tokens_per_expert)
    t1, t2 = once(n), once(2 * n)
    token_s = (t2 - t1) / n if t2 > t1 else t2 / (2 * n)  # noise can hide the fixed part: then all per token
    slot_s = max(t1 - n * token_s, 0.0)
    return Costs(token_s, slot_s, f"measured on {dev.type} ({dtype}), H={h} I={i}, n={n} and {2 * n} tokens")


def scaled_shares(curve: np.ndarray, experts: int) -> np.ndarray:
    """Stretch a descending share curve over E_rec experts to `experts` experts (log-linear interpolation at
    the same rank fractions), renormalised."""
    curve = np.sort(np.asarray(curve, dtype=np.float64))[::-1]
    floor = max(curve[curve > 0].min() if (curve > 0).any() else 1.0, 1e-12) * 1e-3  # a never-picked expert
    x_rec = (np.arange(len(curve)) + 0.5) / len(curve)
    x_new = (np.arange(experts) + 0.5) / experts
    out = np.exp(np.interp(x_new, x_rec, np.log(np.maximum(curve, floor))))
    return out / out.sum()


def base_shares(cfg: EplbSimConfig, trace: RoutingTrace | None) -> tuple[list[np.ndarray], str]:
    """Per simulated layer, the experts' mean shares (shuffled), and a line saying where they came from."""
    rng = np.random.default_rng(cfg.seed)
    if trace is None:
        curve = [(np.arange(cfg.experts) + 1.0) ** -cfg.zipf]
        what = f"Zipf prior, exponent {cfg.zipf:g}"
    else:
        recorded = trace.expert_shares()
        curve = list(recorded)
        what = (f"trace {trace.source.get('model', '?')} ({trace.num_experts} experts top-{trace.top_k}, "
                f"{len(trace.layers)} layers, {len(trace.tokens)} steps, gate skew {trace.source.get('skew', '?')}): "
                f"recorded expert max/mean per layer "
                f"{', '.join(f'{max_over_mean(s):.2f}' for s in recorded)}")
    out = []
    for layer in range(cfg.layers):
        s = scaled_shares(curve[layer % len(curve)], cfg.experts)
        out.append(s[rng.permutation(cfg.experts)])
    return out, what


def topk_counts(rng: np.random.Generator, weights: np.ndarray, tokens: int, k: int) -> np.ndarray:
    """Expert counts of `tokens` tokens that each pick k distinct experts without replacement in proportion to
    `weights` (Plackett-Luce, the distribution of Gumbel-top-k): each row is a sequence of draws with
    replacement from the categorical and keeps its first k distinct ones (a repeated draw is skipped); rows
    short of k distinct extend their own sequence (discarding them would bias towards varied rows)."""
    e = len(weights)
    cdf = np.cumsum(weights / weights.sum())
    cdf[-1] = 1.0
    picks = np.empty((tokens, k), dtype=np.int64)
    todo = np.arange(tokens)
    c = np.empty((tokens, 0), dtype=np.int64)
    while len(todo):
        more = np.searchsorted(cdf, rng.random((len(todo), max(2 * k, c.shape[1]))), side="right")
        c = np.concatenate([c, np.minimum(more, e - 1)], axis=1)
        keep = np.ones(c.shape, dtype=bool)
        for j in range(1, c.shape[1]):
            keep[:, j] = ~(c[:, :j] == c[:, j:j + 1]).any(axis=1)
        rank = np.cumsum(keep, axis=1)
        ok = rank[:, -1] >= k
        rows = np.nonzero(ok)[0]
        picks[todo[rows]] = c[rows][(keep & (rank <= k))[rows]].reshape(-1, k)
        todo, c = todo[~ok], c[~ok]
    return np.bincount(picks.ravel(), minlength=e)


def synth_counts(cfg: EplbSimConfig, shares: list[np.ndarray], tokens: int, seed: int) -> np.ndarray:
    """[steps, layers, experts] counts: top-k picks from drifting log-weights (see the module docstring)."""
    rng = np.random.default_rng(seed)
    logw = np.log(np.stack(shares))  # [L, E]
    rho = math.exp(-1.0 / cfg.drift_steps)
    dev = rng.standard_normal(logw.shape) * cfg.drift
    out = np.zeros((cfg.steps, cfg.layers, cfg.experts), dtype=np.int64)
    for t in range(cfg.steps):
        dev = rho * dev + math.sqrt(1 - rho * rho) * cfg.drift * rng.standard_normal(logw.shape)
        for layer in range(cfg.layers):
            out[t, layer] = topk_counts(rng, np.exp(logw[layer] + dev[layer]), tokens, cfg.top_k)
    return out


def preference_table(p: Placement) -> np.ndarray:
    """[experts, ranks, max replicas]: each rank's replica slots of each expert in its order of preference
    (`eplb.policy.replica_preference`, the engine's), padded with the first."""
    width = max(p.replica_counts())
    table = np.empty((p.num_experts, p.num_ranks, width), dtype=np.int64)
    for e in range(p.num_experts):
        slots = p.replicas(e)
        if len(slots) == 1:
            table[e] = slots[0]
            continue
        for r in range(p.num_ranks):
            pref = replica_preference(p, r, e)
            table[e, r] = pref + pref[:1] * (width - len(pref))
    return table


def route_rows(p: Placement, table: np.ndarray, rows: np.ndarray, split_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The engine's replica choice for one layer's step: `rows` [experts, ranks] pairs by source rank ->
    (rows per physical slot [slots], pairs from each source rank to each destination rank [ranks, ranks])."""
    e, n = rows.shape
    c = np.asarray(p.replica_counts(), dtype=np.int64)[:, None]
    used = np.minimum(c, np.maximum(1, rows // split_rows))  # eplb.policy.replicas_used
    i = np.arange(table.shape[2])[None, None, :]
    r3, u3 = rows[:, :, None], used[:, :, None]
    # eplb.policy.chunk_rows: chunk i of a rank's n rows is ceil((i + 1) n / u) - ceil(i n / u), none past u
    size = np.where(i < u3, -((-(i + 1) * r3) // u3) + (-i * r3) // u3, 0)
    slot_rows = np.bincount(table.ravel(), weights=size.ravel(), minlength=len(p.physical_to_logical))
    src = np.broadcast_to(np.arange(n)[None, :, None], table.shape)
    flow = np.bincount((src * n + table // p.slots_per_rank).ravel(), weights=size.ravel(), minlength=n * n)
    return slot_rows, flow.reshape(n, n)


def simulate(cfg: EplbSimConfig, counts: np.ndarray, tokens: np.ndarray, ranks: int, redundant: int | None,
             costs: Costs) -> Row:
    """Replay counts [steps, layers, experts] on `ranks` ranks with `redundant` slots (None: EPLB off)."""
    steps, layers, experts = counts.shape
    r = redundant or 0
    placements = [initial_placement(experts, ranks, r) for _ in range(layers)]
    window = ExpertLoadWindow(layers, experts, cfg.window)
    split = np.random.default_rng(cfg.seed + 7919 * ranks)  # the same source-rank split for every R
    even = np.full(ranks, 1.0 / ranks)
    moved, rebalances = 0, 0
    step_s, expert_s, a2a_s, wait_s, imb = [], [], [], [], []
    tables = [preference_table(p) for p in placements]
    for t in range(steps):
        if redundant is not None and t > 0 and t % cfg.interval == 0:
            load = window.window_load().tolist()
            median = window.window_steps_rows().median(dim=0).values.tolist()
            for layer, old in enumerate(placements):
                new = plan_placement(load[layer], median[layer], ranks, r, old, split_rows=cfg.split_rows,
                                     num_nodes=cfg.num_nodes)
                if new is not None:
                    moved += moved_slots(old, new)
                    placements[layer], tables[layer] = new, preference_table(new)
            rebalances += 1
        window.record(counts[t])
        by_rank = split.multinomial(counts[t], even)  # [layers, experts, ranks]
        if t < cfg.interval:
            continue  # warm-up: before the first rebalance
        total = exp_total = a2a_total = wait_total = imb_total = 0.0
        for layer in range(layers):
            p = placements[layer]
            slot_rows, flow = route_rows(p, tables[layer], by_rank[layer], cfg.split_rows)
            per_rank = slot_rows.reshape(ranks, p.slots_per_rank)
            rank_tok = per_rank.sum(axis=1)
            compute = rank_tok * costs.token_s + (per_rank > 0).sum(axis=1) * costs.slot_s
            peak = float(compute.max())
            home = np.diag(flow)
            heaviest = float(max((flow.sum(axis=1) - home).max(), (flow.sum(axis=0) - home).max()))
            a2a = 2 * cfg.a2a_latency_us * 1e-6 + heaviest * cfg.hidden * (
                cfg.dispatch_bytes + cfg.combine_bytes) / (cfg.link_gbps * 1e9)
            total += peak + a2a
            exp_total += peak
            a2a_total += a2a
            wait_total += float((peak - compute).sum())
            mean = float(rank_tok.mean())
            imb_total += float(rank_tok.max()) / mean if mean > 0 else 1.0
        step_s.append(total)
        expert_s.append(exp_total)
        a2a_s.append(a2a_total)
        wait_s.append(wait_total)
        imb.append(imb_total / layers)
    slot_bytes = 3.0 * cfg.hidden * cfg.intermediate * cfg.weight_bytes
    return Row(ranks, redundant, placements[0].slots_per_rank, 1e3 * float(np.mean(step_s)),
               1e3 * float(np.mean(expert_s)), 1e3 * float(np.mean(a2a_s)), 1e3 * float(np.mean(wait_s)),
               float(np.mean(wait_s)) / (ranks * float(np.mean(expert_s))), float(np.mean(imb)),
               moved / max(rebalances, 1), r / ranks * slot_bytes * cfg.model_moe_layers)


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def format_table(rows: list[Row]) -> str:
    head = ("| ranks | R | slots/rank | step ms | vs off | expert ms | all-to-all ms | waiting rank-ms | "
            "waiting share | imbalance | moved/rebalance | replica weights/rank |")
    lines = [head, "|" + " --- |" * 12]
    base = {row.ranks: row.step_ms for row in rows if row.redundant is None}
    for row in rows:
        speed = base.get(row.ranks, row.step_ms) / row.step_ms
        lines.append(f"| {row.ranks} | {'off' if row.redundant is None else row.redundant} | {row.slots_per_rank} | "
                     f"{row.step_ms:.3f} | {speed:.2f}x | {row.expert_ms:.3f} | {row.a2a_ms:.3f} | "
                     f"{row.waiting_ms:.2f} | {row.waiting_share:.1%} | {row.imbalance:.3f} | "
                     f"{row.moved_per_rebalance:.0f} | {_gib(row.replica_bytes_per_rank)} |")
    return "\n".join(lines)


def run(cfg: EplbSimConfig) -> tuple[str, list[Row]]:
    """Record (if asked), build the routing per rank count, simulate EPLB off and each R; (report, rows)."""
    trace = None
    if cfg.record_trace:
        trace = record_trace(cfg.record_model, cfg.record_trace, skew=cfg.record_skew, prompts=cfg.record_prompts,
                             prompt_len=cfg.record_prompt_len, new_tokens=cfg.record_tokens, seed=cfg.seed)
    elif cfg.trace:
        if not Path(cfg.trace).is_file():
            raise FileNotFoundError(f"no routing trace at {cfg.trace}")
        trace = load_trace(cfg.trace)
    if cfg.replay_direct and trace is not None and trace.num_experts != cfg.experts:
        raise ValueError(f"--replay-direct: the trace has {trace.num_experts} experts, --experts is {cfg.experts}")
    shares, source = base_shares(cfg, trace)
    costs = None
    rows: list[Row] = []
    skipped: list[str] = []
    for n in cfg.ranks:
        if cfg.replay_direct:
            counts, tokens, what = trace.counts, trace.tokens, "replayed as recorded"
            if len(tokens) <= cfg.interval:
                raise ValueError(f"the trace has {len(tokens)} steps, not more than --interval {cfg.interval}")
        else:
            per_step = cfg.tokens_per_rank * n
            counts = synth_counts(cfg, shares, per_step, cfg.seed + n)
            tokens = np.full(cfg.steps, per_step, dtype=np.int64)
            what = f"{per_step} tokens/step"
        if costs is None:
            avg = int(tokens.mean() * (counts[0, 0].sum() / max(tokens[0], 1)) / counts.shape[2])
            costs = measure_costs(cfg, avg) if cfg.measure_expert_cost else stated_costs(cfg)
        rows.append(simulate(cfg, counts, tokens, n, None, costs))
        for r in cfg.redundant:
            if (counts.shape[2] + r) % n or r > counts.shape[2] * (n - 1):
                skipped.append(f"R={r} at {n} ranks")
                continue
            rows.append(simulate(cfg, counts, tokens, n, r, costs))
        source += f"; {n} ranks: {what}"
    shape = (f"{counts.shape[2]} experts, {counts.shape[1]} MoE layers as recorded" if cfg.replay_direct else
             f"{cfg.experts} experts top-{cfg.top_k}, {cfg.layers} MoE layers, drift {cfg.drift:g} (correlation "
             f"{cfg.drift_steps:g} steps)")
    head = (f"routing: {source}; {shape}; EPLB window {cfg.window}, interval "
            f"{cfg.interval}, {cfg.steps} steps ({cfg.interval} warm-up){', ' + str(cfg.num_nodes) + ' nodes' if cfg.num_nodes else ''}\n"
            f"costs: t_token {costs.token_s * 1e6:.4f} us, t_slot {costs.slot_s * 1e6:.2f} us ({costs.source}); "
            f"all-to-all {cfg.link_gbps:g} GB/s, {cfg.a2a_latency_us:g} us per phase; expert H={cfg.hidden} "
            f"I={cfg.intermediate} at {cfg.weight_bytes:g} B/weight, memory for {cfg.model_moe_layers} MoE layers"
            + (f"\nskipped (experts + R not a multiple of ranks): {', '.join(skipped)}" if skipped else ""))
    return head + "\n\n" + format_table(rows), rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `deepinfer bench eplb` flags: one per EplbSimConfig field."""
    from deepinfer.config import add_config_arguments

    add_config_arguments(parser, EplbSimConfig)
