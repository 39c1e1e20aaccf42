"""What the hardware allows, measured in the same run as a benchmark: the fraction of the bound.

* compute: the best FLOP/s of a large square matmul in the engine's dtype (torch, all threads);
* memory: the best streaming-read bandwidth (a sum over a 512 MiB fp32 tensor).

A benchmark measures both before and after its engines run and keeps the best of each (`best_of`).

A model's cost per token: FLOPs = 2 x the parameters each token multiplies (the input embedding is a
lookup and not counted unless it doubles as the tied output head); weight bytes = what one decode
step reads from memory, the GGUF's tensor bytes for a GGUF, else parameters x the dtype's size.
Batched decode is bounded by compute (peak / FLOPs per token), single-stream by memory (bandwidth /
weight bytes per token); `fraction` is measured tok/s over that bound. Attention and KV reads are
left out, so the bounds are upper bounds and the fractions are conservative.

torch is imported inside the functions: a benchmark imports deepinfer (which sets the OpenMP wait
policy) before torch loads, whatever order its imports are in.

`RunBounds` bundles this for a benchmark of the default model (measure at start, `remeasure` at the end, `of`
per result). Shell scripts (serve_compare.sh) use the command line::

    python3 benchmarks/hw_bounds.py measure FILE                 # append a measurement to FILE (JSON lines)
    python3 benchmarks/hw_bounds.py fraction FILE TOK_S DTYPE [TOK_S DTYPE ...]   # "0.41 cmp" a line, against
                                                                  # the best of FILE's measurements
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Machine:
    flops: dict[str, float]  # dtype name -> best matmul FLOP/s
    read_bytes_per_s: float


@dataclass(frozen=True)
class ModelCost:
    params: float  # parameters each token multiplies
    gguf_bytes: float | None  # the GGUF's tensor bytes, for an engine that reads the GGUF's blocks

    @property
    def flops_per_token(self) -> float:
        return 2.0 * self.params

    def weight_bytes(self, dtype: str, gguf: bool) -> float:
        if gguf and self.gguf_bytes:
            return self.gguf_bytes
        import torch

        return self.params * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_machine(dtypes: tuple[str, ...] | None = None, n: int = 2048,
                    read_mib: int = 512, repeats: int = 5) -> Machine:
    """`dtypes` default: float32, and bfloat16 where the CPU multiplies it natively (AVX-512 BF16 / AMX; on an
    AVX2-only CPU torch's bfloat16 matmul is a slow fallback that no engine here runs, and timing it took
    ~5 minutes per run on the 2-core AMD machine)."""
    import torch

    from deepinfer.engine.runner import cpu_has_fast_bf16

    if dtypes is None:
        dtypes = ("bfloat16", "float32") if cpu_has_fast_bf16() else ("float32",)
    flops = {}
    for name in dtypes:
        dt = getattr(torch, name)
        a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
        best = _best(lambda a=a, b=b: torch.mm(a, b), repeats)
        if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
            # oneDNN's packed linear as well: torch.mm's float32 goes to MKL, which on AMD CPUs takes
            # a path at half the machine's rate (2-core EPYC Zen 5: 236 against oneDNN's 513 GFLOP/s;
            # the fractions of that bound read above 1)
            packed = torch.ops.mkldnn._reorder_linear_weight(b, n)
            best = min(best, _best(lambda a=a, p=packed: torch.ops.mkldnn._linear_pointwise(a, p, None, "none", [], ""),
                                   repeats))
        flops[name] = 2 * n**3 / best
    x = torch.ones(read_mib * 2**20 // 4)
    bw = x.numel() * 4 / _best(lambda x=x: x.sum(), repeats)
    del x
    return Machine(flops, bw)


def best_of(*machines: Machine) -> Machine:
    """The best each bound reached over several measurements (e.g. before and after a run). On a machine
    that swings between fast and slow states within minutes, one measurement taken in a slow moment made
    every fraction look higher than it was (session 26: 0.68 of a bound measured at 25.2 GB/s, with 30-37
    GB/s read minutes later); the best of several keeps the fractions conservative."""
    if not machines:
        raise ValueError("best_of needs at least one measurement")
    dtypes = {k for m in machines for k in m.flops}
    flops = {k: max(m.flops[k] for m in machines if k in m.flops) for k in sorted(dtypes)}
    return Machine(flops, max(m.read_bytes_per_s for m in machines))


# config keys of the routed-expert count, by model family (Qwen-MoE, Mixtral, DeepSeek)
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def model_cost(hf_dir: str, gguf_file: str | None) -> ModelCost:
    """Parameters from the HF copy's tensors; the GGUF's tensor bytes when given one. In a mixture of experts a
    token multiplies `num_experts_per_tok` of the routed experts: their tensors (`.experts.` in the name, shared
    experts aside) count at that share of their size."""
    import torch
    from safetensors import safe_open

    cfg = json.loads(Path(hf_dir, "config.json").read_text())
    tied = bool(cfg.get("tie_word_embeddings", False))
    experts = next((int(cfg[k]) for k in _EXPERT_COUNT_KEYS if cfg.get(k)), 0)
    routed_share = min(1.0, int(cfg.get("num_experts_per_tok") or experts) / experts) if experts else 1.0
    numel = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 - safe_open has no __iter__
                shape = h.get_slice(k).get_shape()
                numel[k] = int(torch.tensor(shape).prod()) if shape else 1
    multiplied = sum(v * (routed_share if ".experts." in k and "shared" not in k else 1.0)
                     for k, v in numel.items() if tied or "embed_tokens" not in k)
    gguf_bytes = None
    if gguf_file:
        import gguf

        gguf_bytes = float(sum(int(t.n_bytes) for t in gguf.GGUFReader(gguf_file).tensors))
    return ModelCost(float(multiplied), gguf_bytes)


def fraction(tok_per_s: float, single_stream: bool, machine: Machine, cost: ModelCost, dtype: str,
             gguf: bool) -> tuple[float, str]:
    """(tok/s over the bound, which bound) for one result in `dtype` ('bfloat16', 'float32');
    `gguf`: the engine reads the GGUF's quantized blocks rather than dtype weights."""
    if single_stream:
        bound = machine.read_bytes_per_s / cost.weight_bytes(dtype, gguf)
        return tok_per_s / bound, "mem"
    bound = machine.flops[dtype] / cost.flops_per_token
    return tok_per_s / bound, "cmp"


def describe(machine: Machine, cost: ModelCost) -> str:
    fl = ", ".join(f"{k} matmul {v / 1e9:.0f} GFLOP/s" for k, v in machine.flops.items())
    wb = f"bf16 {cost.weight_bytes('bfloat16', False) / 1e6:.1f} MB"
    if cost.gguf_bytes:
        wb += f", GGUF {cost.gguf_bytes / 1e6:.1f} MB"
    return (f"machine: {fl}, streaming read {machine.read_bytes_per_s / 1e9:.1f} GB/s; model: "
            f"{cost.flops_per_token / 1e9:.3f} GFLOP/token, weight bytes per token: {wb}")


def default_dtype() -> str:
    """The dtype deepinfer computes in by default on this machine (`--dtype auto` on CPU)."""
    from deepinfer.engine.runner import cpu_has_fast_bf16

    return "bfloat16" if cpu_has_fast_bf16() else "float32"


def add_flag(parser: argparse.ArgumentParser, note: str = "") -> None:
    """A benchmark's `--no-bounds` (`args.bounds`: whether to measure the machine for `RunBounds`)."""
    parser.add_argument("--no-bounds", dest="bounds", action="store_false",
                        help=f"skip measuring the machine's bounds (benchmarks/hw_bounds.py{note})")


class RunBounds:
    """One benchmark run's bounds for a model (default: the built-in GGUF): the machine measured when made and
    again by `remeasure` (the best of each kept, `best_of`), and the model's cost per token."""

    def __init__(self, model: str | None = None, measure: bool = True) -> None:
        from deepinfer.weights import resolve_model

        files = resolve_model(model)
        gguf_file = str(files.source) if files.source.suffix == ".gguf" else None
        self.cost = model_cost(str(files.directory), gguf_file)
        self.gguf = gguf_file is not None
        self.machine = measure_machine() if measure else None

    def remeasure(self) -> None:
        again = measure_machine(tuple(self.machine.flops) if self.machine else None)
        self.machine = best_of(self.machine, again) if self.machine else again

    def value(self, tok_per_s: float, single_stream: bool, dtype: str | None = None) -> float:
        """tok/s over the bound (single stream: memory; else compute) in `dtype` (default: deepinfer's), for an
        engine that reads the GGUF's blocks when the model is one."""
        return fraction(tok_per_s, single_stream, self.machine, self.cost, dtype or default_dtype(), self.gguf)[0]

    def of(self, tok_per_s: float, single_stream: bool, dtype: str | None = None) -> str:
        """`value` as '0.41 cmp' / '0.31 mem'."""
        return f"{self.value(tok_per_s, single_stream, dtype):.2f} {'mem' if single_stream else 'cmp'}"

    def describe(self) -> str:
        return describe(self.machine, self.cost)


def _machine_to_json(m: Machine) -> str:
    return json.dumps({"flops": m.flops, "read_bytes_per_s": m.read_bytes_per_s})


def _machines_from(path: str) -> list[Machine]:
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            out.append(Machine(d["flops"], d["read_bytes_per_s"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="measure the machine's bounds, or a result's fraction of them")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="append one measurement (JSON line) to FILE and describe it")
    m.add_argument("file")
    f = sub.add_parser("fraction", help="each TOK_S over the bound in its DTYPE, from the best of FILE's "
                       "measurements, a line each")
    f.add_argument("file")
    f.add_argument("results", nargs="+", metavar="TOK_S DTYPE",
                   help="pairs: tok/s, the engine's dtype (auto: deepinfer's default on this machine)")
    f.add_argument("--single-stream", action="store_true", help="the memory bound (default: compute)")
    f.add_argument("--model", default=None, help="default: the built-in GGUF")
    args = ap.parse_args()
    if args.cmd == "measure":
        bounds = RunBounds(measure=False)
        bounds.remeasure()
        with open(args.file, "a") as out:
            out.write(_machine_to_json(bounds.machine) + "\n")
        print(bounds.describe())
        return
    if len(args.results) % 2:
        ap.error("fraction takes TOK_S DTYPE pairs")
    bounds = RunBounds(args.model, measure=False)  # the model's cost read once for every result
    bounds.machine = best_of(*_machines_from(args.file))
    for rate, dtype in zip(args.results[::2], args.results[1::2], strict=True):
        print(bounds.of(float(rate), args.single_stream, None if dtype == "auto" else dtype))


if __name__ == "__main__":
    main()
