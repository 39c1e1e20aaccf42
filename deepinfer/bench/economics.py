"""`deepinfer bench economics`: what a measured run earns and costs, with every step of the arithmetic shown.

Inputs are a measured run (`MeasuredRun`: input, cached-input and output tokens over a wall time, on a worker of
`accelerators` accelerators) and stated prices (`Prices`: $ per million input / cached-input / output tokens, $
per accelerator-hour all-in, capital $ per accelerator). `price_run` turns them into `Economics`: tokens per day
per worker, revenue per accelerator-hour, cost, margin and payback days, each figure a `Step` that carries its
formula, the formula with the numbers substituted, and the result, so the printed report can be checked by hand.

A run comes from flags or from a results JSON the repository's benchmarks write (`load_run`:
benchmarks/throughput.py, serve_load.py, agentic.py, guidellm_run.sh; cached input tokens come from
agentic.py's hit rate and guidellm's per-request `cached_tokens`, the others do not count them).

`--seeds` prices the production figures DeepSeek published with its release (`SeedFigures`, as the three
reports in ../shared/seeds quote them) and adds a consistency section (`seed_consistency`): each published
headline number is recomputed from the other published inputs, and where they disagree the section says by how
much and which inputs give which result. The seeds state no cached-input price; the report solves for the one
that reproduces their $38 per accelerator-hour and says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from deepinfer.config import _f

SECONDS_PER_DAY = 86_400
PER_MILLION = 1_000_000

# This VM's price when a measured run is priced without --accelerator-hour-usd: the closest public cloud
# instance to the machine the benchmarks ran on (2 vCPUs, AMD EPYC with AVX-512 BF16, i.e. Zen 4) is AWS EC2
# m7a.large (2 vCPUs, 4th-gen EPYC), on-demand Linux in us-east-1. The figure is AWS's list price as recalled
# when this was written, not fetched from this machine (it has no route to aws.amazon.com): pass
# --accelerator-hour-usd to use a checked or different one.
CPU_VM_HOUR_USD = 0.11592
CPU_VM_SOURCE = ("AWS EC2 m7a.large (2 vCPU AMD EPYC Zen 4, 8 GiB) on-demand Linux us-east-1 list price, "
                 "$0.11592/h (recalled from AWS's public price list, not fetched here)")


@dataclass(frozen=True)
class EconomicsConfig:
    """Price a measured run (from flags or a results JSON) or the seeds' published figures."""

    seeds: bool = _f(False, "Price DeepSeek's published production figures (../shared/seeds) and print the "
                     "consistency section: which published numbers follow from which.")
    results: str | None = _f(None, "A results JSON from benchmarks/throughput.py, serve_load.py, agentic.py or "
                             "guidellm_run.sh.")
    engine: str = _f("deepinfer", "throughput.py results: the engine's row to price.")
    workload: str | None = _f(None, "throughput.py / agentic.py results: the workload (default: the first).")
    label: str | None = _f(None, "serve_load.py --compare results: the server label (default: the first); "
                           "agentic.py results: the configuration (default: the last, e.g. store_on).")
    input_tokens: int | None = _f(None, "Input (prompt) tokens of the run, cached ones included.")
    cached_input_tokens: int | None = _f(None, "Of the input tokens, those served from a prefix cache.")
    output_tokens: int | None = _f(None, "Output (generated) tokens of the run.")
    wall_s: float | None = _f(None, "Wall-clock seconds of the run.")
    accelerators: float = _f(1.0, "Accelerators in the measured worker (a CPU VM counts as one).")
    hardware: str | None = _f(None, "The hardware the run measured, for the report (results JSONs do not "
                              "record it).")
    price_input: float = _f(0.15, "$ per million uncached input tokens (the default is the seeds' off-peak price).")
    price_cached_input: float | None = _f(None, "$ per million cached input tokens (default: as --price-input, "
                                          "i.e. no cache discount; with --seeds: solved from their $38/h).")
    price_output: float = _f(0.60, "$ per million output tokens (the default is the seeds' off-peak price).")
    accelerator_hour_usd: float | None = _f(None, "All-in cost per accelerator-hour (default: with --seeds "
                                            "$6.50, the middle of their $5-8; else this CPU VM's cloud price, "
                                            f"${CPU_VM_HOUR_USD}/h).")
    capital_usd: float | None = _f(None, "Capital cost per accelerator, for the payback period (default: none; "
                                   "payback is then not computed).")

    def __post_init__(self) -> None:
        for name in ("input_tokens", "cached_input_tokens", "output_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        for name in ("price_input", "price_output", "price_cached_input", "accelerator_hour_usd", "capital_usd"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if self.wall_s is not None and self.wall_s <= 0:
            raise ValueError("--wall-s must be > 0")
        if self.accelerators <= 0:
            raise ValueError("--accelerators must be > 0")


@dataclass(frozen=True)
class MeasuredRun:
    """Tokens one worker processed over a wall time. `input_tokens` includes `cached_input_tokens`."""

    input_tokens: float
    cached_input_tokens: float
    output_tokens: float
    wall_s: float
    accelerators: float = 1.0
    hardware: str = "unspecified"
    source: str = "flags"

    def __post_init__(self) -> None:
        if min(self.input_tokens, self.cached_input_tokens, self.output_tokens) < 0:
            raise ValueError("token counts must be >= 0")
        if self.cached_input_tokens > self.input_tokens:
            raise ValueError(f"cached input tokens ({self.cached_input_tokens:g}) exceed input tokens "
                             f"({self.input_tokens:g}): input tokens count the cached ones too")
        if self.wall_s <= 0 or self.accelerators <= 0:
            raise ValueError("wall time and accelerators must be > 0")


@dataclass(frozen=True)
class Prices:
    """Stated prices: $ per million tokens by kind, $ per accelerator-hour all-in, capital $ per accelerator."""

    input_per_m: float
    cached_input_per_m: float
    output_per_m: float
    accelerator_hour: float
    capital_per_accelerator: float | None = None
    source: str = "flags"


@dataclass(frozen=True)
class Step:
    """One line of arithmetic: `name = formula = substituted = value`."""

    name: str
    formula: str
    substituted: str
    value: float
    unit: str = ""

    def render(self) -> str:
        return f"{self.name} = {self.formula}\n    = {self.substituted}\n    = {fmt(self.value, self.unit)}"


@dataclass(frozen=True)
class Economics:
    """The priced run: the headline figures and the steps that produced them, in order."""

    run: MeasuredRun
    prices: Prices
    steps: tuple[Step, ...]
    tokens_per_day_per_worker: float
    revenue_per_accelerator_hour: float
    cost_per_accelerator_hour: float
    margin: float | None  # (revenue - cost) / revenue; None without revenue
    payback_days: float | None  # None without a capital cost or without a positive margin


@dataclass(frozen=True)
class Check:
    """One published figure recomputed from other published inputs."""

    claim: str
    steps: tuple[Step, ...]
    verdict: str  # one of VERDICTS
    finding: str

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r} is not one of {VERDICTS}")


# agrees: follows from the other published inputs; disagrees: contradicts them; partly: holds for part of a
# published range or only with an input the seeds do not state; unchecked: needs an input they do not publish
VERDICTS = ("agrees", "disagrees", "partly", "unchecked")


def fmt(value: float, unit: str = "") -> str:
    """A number for the report: `$` amounts with cents (or thousands separators), token counts with T/B/M."""
    if unit == "$":
        if abs(value) < 0.01 and value:
            return f"${value:.3g}"  # a short measured run earns fractions of a cent
        return f"${value:,.2f}" if abs(value) < 1e5 else f"${value:,.0f}"
    if unit == "$/M":
        return f"${value:.4g}/M"
    if unit == "$/h":
        return f"${value:,.2f}/h" if abs(value) >= 1 else f"${value:.4f}/h"  # a CPU VM earns cents an hour
    if unit == "%":
        return f"{100 * value:.1f}%"
    if unit == "tokens" or unit == "tok/s":
        for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
            if abs(value) >= scale:
                return f"{value / scale:,.3f}{suffix}" + (" tok/s" if unit == "tok/s" else " tokens")
        return f"{value:,.0f}" + (" tok/s" if unit == "tok/s" else " tokens")
    text = f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:,.4g}"
    return text + (f" {unit}" if unit else "")


def price_run(run: MeasuredRun, prices: Prices) -> Economics:
    """Tokens/day per worker, revenue and cost per accelerator-hour, margin and payback, step by step."""
    steps: list[Step] = []

    def step(name: str, formula: str, substituted: str, value: float, unit: str = "") -> float:
        steps.append(Step(name, formula, substituted, value, unit))
        return value

    uncached = step("uncached input tokens", "input - cached input",
                    f"{fmt(run.input_tokens, 'tokens')} - {fmt(run.cached_input_tokens, 'tokens')}",
                    run.input_tokens - run.cached_input_tokens, "tokens")
    total = run.input_tokens + run.output_tokens
    per_day = step("tokens per day per worker", "(input + output) / wall_s * 86400",
                   f"({fmt(run.input_tokens, 'tokens')} + {fmt(run.output_tokens, 'tokens')}) / {run.wall_s:,.6g} s"
                   f" * 86400", total / run.wall_s * SECONDS_PER_DAY, "tokens")
    step("tokens per day per accelerator", "tokens per day per worker / accelerators",
         f"{fmt(per_day, 'tokens')} / {run.accelerators:g}", per_day / run.accelerators, "tokens")
    rev_in = step("input revenue", "uncached input / 1M * price_input",
                  f"{fmt(uncached, 'tokens')} / 1M * ${prices.input_per_m:g}",
                  uncached / PER_MILLION * prices.input_per_m, "$")
    rev_cached = step("cached input revenue", "cached input / 1M * price_cached_input",
                      f"{fmt(run.cached_input_tokens, 'tokens')} / 1M * ${prices.cached_input_per_m:.4g}",
                      run.cached_input_tokens / PER_MILLION * prices.cached_input_per_m, "$")
    rev_out = step("output revenue", "output / 1M * price_output",
                   f"{fmt(run.output_tokens, 'tokens')} / 1M * ${prices.output_per_m:g}",
                   run.output_tokens / PER_MILLION * prices.output_per_m, "$")
    revenue = step("revenue of the run", "input + cached input + output revenue",
                   f"{fmt(rev_in, '$')} + {fmt(rev_cached, '$')} + {fmt(rev_out, '$')}",
                   rev_in + rev_cached + rev_out, "$")
    acc_hours = step("accelerator-hours of the run", "wall_s / 3600 * accelerators",
                     f"{run.wall_s:,.6g} s / 3600 * {run.accelerators:g}", run.wall_s / 3600 * run.accelerators)
    per_hour = step("revenue per accelerator-hour", "revenue / accelerator-hours",
                    f"{fmt(revenue, '$')} / {acc_hours:,.6g}", revenue / acc_hours, "$/h")
    cost = step("cost per accelerator-hour", "stated (all-in)", f"${prices.accelerator_hour:g}",
                prices.accelerator_hour, "$/h")
    profit = step("margin per accelerator-hour", "revenue per accelerator-hour - cost",
                  f"{fmt(per_hour, '$/h')} - {fmt(cost, '$/h')}", per_hour - cost, "$/h")
    margin = None
    if per_hour > 0:
        margin = step("margin", "(revenue - cost) / revenue per accelerator-hour",
                      f"{fmt(profit, '$/h')} / {fmt(per_hour, '$/h')}", profit / per_hour, "%")
    payback = None
    if prices.capital_per_accelerator is not None and profit > 0:
        payback = step("payback period", "capital per accelerator / (margin per accelerator-hour * 24)",
                       f"${prices.capital_per_accelerator:,.0f} / ({fmt(profit, '$/h')} * 24)",
                       prices.capital_per_accelerator / (profit * 24), "days")
    return Economics(run, prices, tuple(steps), per_day, per_hour, cost, margin, payback)


# ---------------------------------------------------------------------------------------------- measured runs


def load_run(path: str | Path, *, engine: str = "deepinfer", workload: str | None = None,
             label: str | None = None, accelerators: float = 1.0, hardware: str | None = None) -> MeasuredRun:
    """The run recorded in a benchmark results JSON (throughput.py, serve_load.py, agentic.py or guidellm)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from e
    hw = hardware or "unspecified (the results JSON does not record it; pass --hardware)"
    try:
        return _run_from(data, path, engine, workload, label, accelerators, hw)
    except (KeyError, TypeError, AttributeError) as e:  # the right shape, a field missing or of the wrong type
        raise ValueError(f"{path}: a results JSON without the expected fields ({type(e).__name__}: {e})") from e


def _run_from(data: Any, path: Path, engine: str, workload: str | None, label: str | None, accelerators: float,
              hw: str) -> MeasuredRun:
    if isinstance(data, dict) and isinstance(data.get("benchmarks"), list) and data["benchmarks"]:  # guidellm
        b = data["benchmarks"][0]
        ok = b["requests"]["successful"]
        streams = b["config"]["strategy"].get("streams", "?")
        return MeasuredRun(sum(r.get("prompt_tokens") or 0 for r in ok), sum(r.get("cached_tokens") or 0 for r in ok),
                           sum(r.get("output_tokens") or 0 for r in ok), b["duration"], accelerators, hw,
                           f"{path} (guidellm: {len(ok)} successful requests at {streams} streams over its "
                           f"{b['duration']:.1f} s; cached tokens as the server reported them)")
    if isinstance(data, dict) and isinstance(data.get("results"), list):  # throughput.py
        rows = [r for r in data["results"] if r.get("engine") == engine]
        if workload is not None:
            rows = [r for r in rows if r.get("workload") == workload]
        if not rows:
            have = sorted({(r.get("engine"), r.get("workload")) for r in data["results"]})
            raise ValueError(f"{path}: no row for engine={engine!r} workload={workload!r}; rows: {have}")
        r = rows[0]
        return MeasuredRun(r["prompt_tokens"], 0, r["generated_tokens"], r["wall_s"], accelerators, hw,
                           f"{path} (throughput.py: {engine} {r['workload']}, median wall of "
                           f"{len(r.get('walls', [r['wall_s']]))}; cache hits not recorded)")
    if isinstance(data, dict) and isinstance(data.get("results"), dict):  # agentic.py
        results = data["results"]
        name = workload or next(iter(results))
        if name not in results:
            raise ValueError(f"{path}: no workload {name!r}; workloads: {sorted(results)}")
        configs = results[name]
        config = label or list(configs)[-1]
        if config not in configs:
            raise ValueError(f"{path}: no configuration {config!r}; configurations: {sorted(configs)}")
        r = configs[config]
        prompt = r["prompt_tokens"]
        return MeasuredRun(prompt, round(prompt * r["hit_pct"] / 100), round(r["output_tok_per_s"] * r["wall_s"]),
                           r["wall_s"], accelerators, hw,
                           f"{path} (agentic.py: {name} {config}; cached = prompt tokens * hit_pct "
                           f"{r['hit_pct']:.1f}%, output = output_tok_per_s * wall_s)")
    summaries = _serve_load_summaries(data)
    if summaries is None:
        raise ValueError(f"{path}: not a results JSON of throughput.py, serve_load.py, agentic.py or guidellm")
    if label is not None:
        summaries = [s for s in summaries if s.get("label") == label]
        if not summaries:
            raise ValueError(f"{path}: no run labelled {label!r}")
    s = summaries[0]
    ok = [q for q in s["requests"] if q.get("ok")]
    return MeasuredRun(sum(q["prompt_tokens"] for q in ok), 0, sum(q["output_tokens"] for q in ok), s["wall_s"],
                       accelerators, hw, f"{path} (serve_load.py: {s.get('label', 'server')}, {len(ok)} completed "
                       f"requests at concurrency {s['concurrency']}; cache hits not recorded)")


def _serve_load_summaries(data: Any) -> list[dict[str, Any]] | None:
    """serve_load.py writes one summary, a list of them (--compare) or a list of pairs (--compare, repeats)."""
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        return None
    flat = [s for item in data for s in (item if isinstance(item, list) else [item])]
    if not flat or not all(isinstance(s, dict) and "requests" in s and "wall_s" in s for s in flat):
        return None
    return flat


# ------------------------------------------------------------------------------------------------- the seeds


@dataclass(frozen=True)
class SeedFigures:
    """DeepSeek's production figures as the seed reports quote them (../shared/seeds/000_*, 002_*, 004_*)."""

    tokens_per_day: float = 155e12  # "155T tokens/day/cluster" (000, 002, 004)
    price_input: float = 0.15  # "$0.15/$0.60 per million input/output tokens" off-peak (000, 002)
    price_output: float = 0.60
    blend_price: float = 0.14  # "155000000 tokens * $0.14 blend cost / 24 hours is ~$1m per hour" (000)
    revenue_per_day: float = 22e6  # "about $22 million per day in revenue per cluster" (002; 000's title)
    revenue_per_hour_cluster: float = 1e6  # "~$1m per hour" (000)
    cache_hit: float = 0.96  # "96% input cache hit" (000, 002, 004)
    prefill_tok_s: float = 1.5e6  # "1.5 million cache-inclusive input tokens/second per prefill GPU" (000)
    decode_tok_s: float = 14_000  # "14,000 output tokens/second per decode GPU" (000)
    accelerators: float = 2400  # "(over ~2400 GPUs)" (000)
    cost_low: float = 5.0  # "all-in costs $5-8 per card per hour" (000)
    cost_high: float = 8.0
    revenue_per_accelerator_hour: float = 38.0  # "$38 revenue per accelerator-hour at off-peak prices" (all)
    margin: float = 0.80  # ">80% inference margin" (000, 004)
    payback_days: float = 81.0  # "81 day payback period on inference margin" (000, 004)
    revenue_per_gw_year: float = 166e9  # "roughly $166B per GW" (000)
    community_margins: tuple[float, ...] = (0.842, 0.961)  # "revised to 84.2% to 96.1% margin" (002)


@dataclass(frozen=True)
class SeedReport:
    """The seeds' cluster priced with the stated prices, and the consistency checks."""

    split: tuple[float, float]  # prefill, decode accelerators
    economics: Economics
    cached_price_for_headline: float  # the cached-input $/M that reproduces the seeds' $/accelerator-hour
    checks: tuple[Check, ...]


def seed_split(s: SeedFigures) -> tuple[float, float]:
    """Prefill and decode accelerators that serve the seeds' tokens/day at their per-accelerator rates."""
    tok_s = s.tokens_per_day / SECONDS_PER_DAY
    prefill = (tok_s - s.accelerators * s.decode_tok_s) / (s.prefill_tok_s - s.decode_tok_s)
    return prefill, s.accelerators - prefill


def seed_run(s: SeedFigures) -> MeasuredRun:
    """One day of the seeds' cluster: prefill accelerators at their input rate, decode at their output rate."""
    prefill, decode = seed_split(s)
    inp = prefill * s.prefill_tok_s * SECONDS_PER_DAY
    return MeasuredRun(inp, inp * s.cache_hit, decode * s.decode_tok_s * SECONDS_PER_DAY, SECONDS_PER_DAY,
                       s.accelerators, f"{s.accelerators:g} accelerators (SM100 / Ascend 950 class, per the seeds)",
                       "the seeds' published figures (../shared/seeds)")


def _cached_price_for(s: SeedFigures, run: MeasuredRun, revenue_per_acc_hour: float) -> float:
    """The cached-input $/M at which the run earns `revenue_per_acc_hour` with the seeds' other prices."""
    hours = run.wall_s / 3600 * run.accelerators
    other = ((run.input_tokens - run.cached_input_tokens) * s.price_input + run.output_tokens * s.price_output)
    return (revenue_per_acc_hour * hours * PER_MILLION - other) / run.cached_input_tokens


def seed_consistency(s: SeedFigures, cost: float) -> tuple[Check, ...]:
    """Each headline figure recomputed from the other published inputs; says which agree and which do not."""
    checks: list[Check] = []
    run = seed_run(s)
    prefill, decode = seed_split(s)
    tok_s = s.tokens_per_day / SECONDS_PER_DAY

    # 1. cluster size and per-accelerator rates against tokens/day
    a = Step("cluster tokens/s", "tokens/day / 86400", f"{fmt(s.tokens_per_day, 'tokens')} / 86400", tok_s, "tok/s")
    b = Step("prefill accelerators P", "(tokens/s - N * decode rate) / (prefill rate - decode rate)",
             f"({fmt(tok_s, 'tok/s')} - {s.accelerators:g} * {s.decode_tok_s:,.0f}) / "
             f"({s.prefill_tok_s:,.0f} - {s.decode_tok_s:,.0f})", prefill, "accelerators")
    c = Step("decode accelerators D", "N - P", f"{s.accelerators:g} - {prefill:,.1f}", decode, "accelerators")
    d = Step("output share of tokens", "D * decode rate / tokens/s",
             f"{decode:,.1f} * {s.decode_tok_s:,.0f} / {fmt(tok_s, 'tok/s')}", decode * s.decode_tok_s / tok_s, "%")
    checks.append(Check(
        f"{fmt(s.tokens_per_day, 'tokens')}/day on ~{s.accelerators:g} accelerators at "
        f"{fmt(s.prefill_tok_s, 'tok/s')} per prefill and {fmt(s.decode_tok_s, 'tok/s')} per decode accelerator",
        (a, b, c, d), "agrees" if 0 < prefill < s.accelerators else "disagrees",
        f"consistent: a {prefill:,.0f} prefill + {decode:,.0f} decode split serves exactly the published tokens/day "
        f"(output is {100 * d.value:.2f}% of the tokens)"))

    # 2. the $22M/day and ~$1M/h: 155T at the $0.14 blend
    rev_day = s.tokens_per_day / PER_MILLION * s.blend_price
    a = Step("revenue per day at the blend", "tokens/day / 1M * blend", f"{fmt(s.tokens_per_day, 'tokens')} / 1M "
             f"* ${s.blend_price:g}", rev_day, "$")
    b = Step("revenue per hour", "revenue per day / 24", f"{fmt(rev_day, '$')} / 24", rev_day / 24, "$")
    ok = abs(rev_day / s.revenue_per_day - 1) < 0.05 and abs(rev_day / 24 / s.revenue_per_hour_cluster - 1) < 0.15
    checks.append(Check(f"about {fmt(s.revenue_per_day, '$')}/day, ~{fmt(s.revenue_per_hour_cluster, '$')}/h "
                        f"(155T * ${s.blend_price:g} blend)", (a, b), "agrees" if ok else "disagrees",
                        "consistent with each other: the $0.14 blend gives both (the hourly one rounded up)"))

    # 3. the $0.14 blend against the $0.15 / $0.60 list prices
    inp, out = run.input_tokens, run.output_tokens
    blend_list = (inp * s.price_input + out * s.price_output) / (inp + out)
    blend_free = ((inp - run.cached_input_tokens) * s.price_input + out * s.price_output) / (inp + out)
    a = Step("blend, cached input at the full input price", "(input * price_input + output * price_output) / "
             "tokens", f"({fmt(inp, 'tokens')} * ${s.price_input:g} + {fmt(out, 'tokens')} * ${s.price_output:g}) / "
             f"{fmt(inp + out, 'tokens')}", blend_list, "$/M")
    b = Step("blend, cached input free", "(uncached input * price_input + output * price_output) / tokens",
             f"({fmt(inp - run.cached_input_tokens, 'tokens')} * ${s.price_input:g} + {fmt(out, 'tokens')} * "
             f"${s.price_output:g}) / {fmt(inp + out, 'tokens')}", blend_free, "$/M")
    checks.append(Check(f"a ${s.blend_price:g} blend from ${s.price_input:g} input / ${s.price_output:g} output",
                        (a, b), "agrees" if blend_free <= s.blend_price <= blend_list and s.blend_price >= s.price_input
                        else "disagrees",
                        f"${s.blend_price:g} is below the cheapest stated price (${s.price_input:g}), so "
                        f"it needs a cached-input price the seeds do not state; list prices without a cache "
                        f"discount give ${blend_list:.4f}/M, and free cache hits ${blend_free:.4f}/M"))

    # 4. $38 per accelerator-hour against the $22M/day on ~2400 accelerators
    per_acc = rev_day / 24 / s.accelerators
    day_at_38 = s.revenue_per_accelerator_hour * 24 * s.accelerators
    a = Step("revenue per accelerator-hour from $/day", "revenue per day / 24 / N",
             f"{fmt(rev_day, '$')} / 24 / {s.accelerators:g}", per_acc, "$/h")
    b = Step(f"accelerators that make {fmt(rev_day, '$')}/day at ${s.revenue_per_accelerator_hour:g}/h",
             "revenue per day / 24 / headline", f"{fmt(rev_day, '$')} / 24 / ${s.revenue_per_accelerator_hour:g}",
             rev_day / 24 / s.revenue_per_accelerator_hour, "accelerators")
    c = Step(f"revenue per day at ${s.revenue_per_accelerator_hour:g}/h on N", "headline * 24 * N",
             f"${s.revenue_per_accelerator_hour:g} * 24 * {s.accelerators:g}", day_at_38, "$")
    d = Step("blend that revenue implies", "revenue per day / (tokens/day / 1M)",
             f"{fmt(day_at_38, '$')} / {s.tokens_per_day / PER_MILLION:,.0f}",
             day_at_38 / (s.tokens_per_day / PER_MILLION), "$/M")
    checks.append(Check(f"${s.revenue_per_accelerator_hour:g} per accelerator-hour on ~{s.accelerators:g} "
                        f"accelerators earning {fmt(s.revenue_per_day, '$')}/day", (a, b, c, d),
                        "agrees" if abs(per_acc / s.revenue_per_accelerator_hour - 1) < 0.1 else "disagrees",
                        f"off by {per_acc / s.revenue_per_accelerator_hour:.1f}x: the $/day figure gives "
                        f"${per_acc:,.0f}/h per accelerator; ${s.revenue_per_accelerator_hour:g}/h needs either "
                        f"~{b.value:,.0f} accelerators (10x the ~{s.accelerators:g} stated) or a "
                        f"${d.value:.4f}/M blend (a tenth of the ${s.blend_price:g} one) i.e. "
                        f"{fmt(day_at_38, '$')}/day"))

    # 5. $38/h from the per-accelerator rates and list prices: which cached-input price gives it
    decode_hour = s.decode_tok_s * 3600 / PER_MILLION * s.price_output
    prefill_hour_free = s.prefill_tok_s * 3600 * (1 - s.cache_hit) / PER_MILLION * s.price_input
    free = price_run(run, Prices(s.price_input, 0.0, s.price_output, cost)).revenue_per_accelerator_hour
    full = price_run(run, Prices(s.price_input, s.price_input, s.price_output, cost)).revenue_per_accelerator_hour
    solved = _cached_price_for(s, run, s.revenue_per_accelerator_hour)
    steps = (
        Step("decode accelerator's output revenue", "decode rate * 3600 / 1M * price_output",
             f"{s.decode_tok_s:,.0f} * 3600 / 1M * ${s.price_output:g}", decode_hour, "$/h"),
        Step("prefill accelerator's uncached input revenue", "prefill rate * 3600 * (1 - hit) / 1M * price_input",
             f"{s.prefill_tok_s:,.0f} * 3600 * {1 - s.cache_hit:.2f} / 1M * ${s.price_input:g}",
             prefill_hour_free, "$/h"),
        Step("cluster revenue per accelerator-hour, cached input free", "(see the priced run, cached price $0)",
             f"P={prefill:,.1f}, D={decode:,.1f}", free, "$/h"),
        Step("cluster revenue per accelerator-hour, cached input at $0.15", "(see the priced run, cached price "
             "$0.15)", f"P={prefill:,.1f}, D={decode:,.1f}", full, "$/h"),
        Step(f"cached-input price that gives ${s.revenue_per_accelerator_hour:g}/h",
             "(headline * accelerator-hours * 1M - uncached input * price_input - output * price_output) / cached",
             f"(${s.revenue_per_accelerator_hour:g} * {run.wall_s / 3600 * run.accelerators:,.0f} * 1M - "
             f"{fmt(inp - run.cached_input_tokens, 'tokens')} * ${s.price_input:g} - {fmt(out, 'tokens')} * "
             f"${s.price_output:g}) / {fmt(run.cached_input_tokens, 'tokens')}", solved, "$/M"),
    )
    checks.append(Check(f"${s.revenue_per_accelerator_hour:g}/h from {fmt(s.prefill_tok_s, 'tok/s')} prefill, "
                        f"{fmt(s.decode_tok_s, 'tok/s')} decode, {100 * s.cache_hit:.0f}% hits and list prices",
                        steps, "partly" if free <= s.revenue_per_accelerator_hour <= full else "disagrees",
                        (f"follows only with a cached-input price the seeds do not state: free hits give "
                         f"${free:.2f}/h, hits at the full input price ${full:.0f}/h (the $22M/day reading); "
                         f"${s.revenue_per_accelerator_hour:g}/h needs cached input at ${solved:.4f}/M "
                         f"({100 * solved / s.price_input:.1f}% of the input price)") if free <= s.revenue_per_accelerator_hour
                        <= full else f"no cached-input price gives ${s.revenue_per_accelerator_hour:g}/h: free hits "
                        f"already give ${free:.2f}/h and hits at the input price ${full:.0f}/h"))

    # 6. margin at $38/h and $5-8 all-in
    m_low = 1 - s.cost_low / s.revenue_per_accelerator_hour
    m_high = 1 - s.cost_high / s.revenue_per_accelerator_hour
    break80 = s.revenue_per_accelerator_hour * (1 - s.margin)
    steps = (
        Step(f"margin at ${s.cost_low:g}/h", "1 - cost / revenue", f"1 - ${s.cost_low:g} / "
             f"${s.revenue_per_accelerator_hour:g}", m_low, "%"),
        Step(f"margin at ${s.cost_high:g}/h", "1 - cost / revenue", f"1 - ${s.cost_high:g} / "
             f"${s.revenue_per_accelerator_hour:g}", m_high, "%"),
        Step(f"highest cost with a margin over {100 * s.margin:.0f}%", "revenue * (1 - margin)",
             f"${s.revenue_per_accelerator_hour:g} * {1 - s.margin:.2f}", break80, "$/h"),
        *(Step(f"cost behind seed 002's {100 * m:.1f}% margin", "revenue * (1 - margin)",
               f"${s.revenue_per_accelerator_hour:g} * (1 - {m:.3f})", s.revenue_per_accelerator_hour * (1 - m), "$/h")
          for m in s.community_margins),
    )
    checks.append(Check(f">{100 * s.margin:.0f}% margin at ${s.revenue_per_accelerator_hour:g}/h and "
                        f"${s.cost_low:g}-{s.cost_high:g}/h all-in", steps,
                        "agrees" if m_high > s.margin else "partly" if m_low > s.margin else "disagrees",
                        f"{100 * m_low:.1f}% at ${s.cost_low:g} but {100 * m_high:.1f}% at "
                        f"${s.cost_high:g}; over {100 * s.margin:.0f}% only for costs below ${break80:.2f}/h "
                        f"(the free-hit revenue ${free:.2f}/h gives {100 * (1 - s.cost_low / free):.1f}%-"
                        f"{100 * (1 - s.cost_high / free):.1f}%); seed 002's "
                        + "-".join(f"{100 * m:.1f}%" for m in s.community_margins) + " means "
                        + "-".join(fmt(s.revenue_per_accelerator_hour * (1 - m), "$/h") for m in s.community_margins)
                        + f", partly below the ${s.cost_low:g}-{s.cost_high:g} range"))

    # 7. 81-day payback: the seeds give no capital cost; the one that gives 81 days
    cap_low = s.payback_days * 24 * (s.revenue_per_accelerator_hour - s.cost_low)
    cap_high = s.payback_days * 24 * (s.revenue_per_accelerator_hour - s.cost_high)
    steps = (
        Step(f"capital per accelerator for {s.payback_days:g} days at ${s.cost_low:g}/h",
             "payback days * 24 * (revenue - cost)",
             f"{s.payback_days:g} * 24 * (${s.revenue_per_accelerator_hour:g} - ${s.cost_low:g})", cap_low, "$"),
        Step(f"capital per accelerator for {s.payback_days:g} days at ${s.cost_high:g}/h",
             "payback days * 24 * (revenue - cost)",
             f"{s.payback_days:g} * 24 * (${s.revenue_per_accelerator_hour:g} - ${s.cost_high:g})", cap_high, "$"),
    )
    checks.append(Check(f"{s.payback_days:g}-day payback", steps, "unchecked",
                        f"not checkable from the seeds alone (no capital cost is published): "
                        f"{s.payback_days:g} days at ${s.revenue_per_accelerator_hour:g}/h means "
                        f"{fmt(cap_high, '$')}-{fmt(cap_low, '$')} of capital per accelerator, a plausible "
                        f"SM100-class price; if the $5-8 all-in already amortises that capital, the payback "
                        f"counts it twice"))

    # 8. $166B per GW a year, against $38/h
    year = s.revenue_per_accelerator_hour * 24 * 365
    per_gw = s.revenue_per_gw_year / year
    steps = (
        Step("revenue per accelerator-year", "headline * 24 * 365",
             f"${s.revenue_per_accelerator_hour:g} * 24 * 365", year, "$"),
        Step("accelerators per GW", "$ per GW-year / revenue per accelerator-year",
             f"{fmt(s.revenue_per_gw_year, '$')} / {fmt(year, '$')}", per_gw, "accelerators"),
        Step("all-in power per accelerator", "1 GW / accelerators per GW", f"1e9 W / {per_gw:,.0f}",
             1e9 / per_gw / 1e3, "kW"),
    )
    checks.append(Check(f"{fmt(s.revenue_per_gw_year, '$')} per GW (a year)", steps,
                        "agrees" if 1.0 <= steps[2].value <= 3.0 else "disagrees",
                        f"consistent with ${s.revenue_per_accelerator_hour:g}/h at {steps[2].value:.1f} kW per "
                        f"accelerator all-in (SM100-class); at the $/day figure's ${per_acc:,.0f}/h it would mean "
                        f"{1e9 / (s.revenue_per_gw_year / (per_acc * 24 * 365)) / 1e3:.0f} kW each, which no "
                        f"accelerator draws"))
    return tuple(checks)


def seed_report(s: SeedFigures, cost: float, capital: float | None, cached_price: float | None) -> SeedReport:
    """The seeds' cluster day priced (cached input at `cached_price`, default: solved from their $/h)."""
    run = seed_run(s)
    solved = _cached_price_for(s, run, s.revenue_per_accelerator_hour)
    if cached_price is not None:
        cached, note = cached_price, f"${cached_price:g}/M as given"
    elif solved >= 0:
        cached, note = solved, (f"${solved:.4f}/M, solved from their ${s.revenue_per_accelerator_hour:g}/h (they "
                                "state no cached-input price)")
    else:  # the other prices alone already earn more than the headline: no price reproduces it
        cached, note = 0.0, (f"free: no cached-input price gives ${s.revenue_per_accelerator_hour:g}/h with these "
                             "prices (consistency [5])")
    prices = Prices(s.price_input, cached, s.price_output, cost, capital,
                    f"${s.price_input:g} / ${s.price_output:g} (the seeds' off-peak list prices unless given); "
                    f"cached input {note}")
    return SeedReport(seed_split(s), price_run(run, prices), solved, seed_consistency(s, cost))


# --------------------------------------------------------------------------------------------------- output


def render(e: Economics) -> str:
    r, p = e.run, e.prices
    lines = [f"run: {r.source}", f"hardware: {r.hardware}; accelerators per worker: {r.accelerators:g}",
             f"prices: input ${p.input_per_m:g}/M, cached input ${p.cached_input_per_m:.4g}/M, output "
             f"${p.output_per_m:g}/M, ${p.accelerator_hour:g} per accelerator-hour, capital "
             + (f"${p.capital_per_accelerator:,.0f} per accelerator" if p.capital_per_accelerator is not None
                else "not given") + f" ({p.source})", "", "arithmetic:"]
    lines += [s.render() for s in e.steps]
    lines += ["", "summary:",
              f"  tokens per day per worker:     {fmt(e.tokens_per_day_per_worker, 'tokens')}",
              f"  revenue per accelerator-hour:  {fmt(e.revenue_per_accelerator_hour, '$/h')}",
              f"  cost per accelerator-hour:     {fmt(e.cost_per_accelerator_hour, '$/h')}",
              "  margin:                        " + (fmt(e.margin, '%') if e.margin is not None else "n/a (no revenue)"),
              "  payback period:                " + (
                  f"{e.payback_days:,.1f} days" if e.payback_days is not None
                  else "n/a (" + ("no capital cost given" if p.capital_per_accelerator is None
                                  else "revenue does not cover cost") + ")")]
    return "\n".join(lines)


def render_checks(checks: tuple[Check, ...]) -> str:
    lines = ["consistency: each published figure recomputed from the other published inputs"]
    for i, c in enumerate(checks, 1):
        lines += ["", f"[{i}] {c.claim}: {c.verdict.upper() if c.verdict != 'agrees' else c.verdict}"]
        lines += ["  " + s.render().replace("\n", "\n  ") for s in c.steps]
        lines.append(f"  => {c.finding}")
    return "\n".join(lines)


def run(cfg: EconomicsConfig) -> str:
    """The report `deepinfer bench economics` prints."""
    if cfg.seeds:
        # the seeds' own prices are the flags' defaults; other --price-input / --price-output explore the checks
        s = replace(SeedFigures(), price_input=cfg.price_input, price_output=cfg.price_output)
        report = seed_report(s, 6.5 if cfg.accelerator_hour_usd is None else cfg.accelerator_hour_usd,
                             cfg.capital_usd, cfg.price_cached_input)
        p, d = report.split
        head = (f"DeepSeek's published production figures (../shared/seeds), one cluster-day: {p:,.1f} prefill + "
                f"{d:,.1f} decode accelerators (solved from 155T tokens/day on ~{s.accelerators:g} at "
                f"{s.prefill_tok_s:,.0f} and {s.decode_tok_s:,.0f} tok/s each; see consistency [1])")
        return "\n".join([head, "", render(report.economics), "", render_checks(report.checks)])
    if cfg.results is not None:
        measured = load_run(cfg.results, engine=cfg.engine, workload=cfg.workload, label=cfg.label,
                            accelerators=cfg.accelerators, hardware=cfg.hardware)
        override = {k: v for k, v in (("input_tokens", cfg.input_tokens), ("output_tokens", cfg.output_tokens),
                                      ("cached_input_tokens", cfg.cached_input_tokens), ("wall_s", cfg.wall_s))
                    if v is not None}
        measured = replace(measured, **override)
    else:
        missing = [f"--{n.replace('_', '-')}" for n in ("input_tokens", "output_tokens", "wall_s")
                   if getattr(cfg, n) is None]
        if missing:
            raise ValueError(f"give --seeds, --results FILE, or a run's {', '.join(missing)}")
        measured = MeasuredRun(cfg.input_tokens, cfg.cached_input_tokens or 0, cfg.output_tokens, cfg.wall_s,
                               cfg.accelerators, cfg.hardware or "unspecified")
    if cfg.accelerator_hour_usd is None:
        hour, source = CPU_VM_HOUR_USD, CPU_VM_SOURCE
    else:
        hour, source = cfg.accelerator_hour_usd, f"${cfg.accelerator_hour_usd:g}/h as given"
    cached = cfg.price_input if cfg.price_cached_input is None else cfg.price_cached_input
    prices = Prices(cfg.price_input, cached, cfg.price_output, hour, cfg.capital_usd,
                    f"token prices as given (defaults: the seeds' off-peak list prices; cached input "
                    f"{'= input, no discount' if cfg.price_cached_input is None else 'as given'}); hour: {source}")
    return render(price_run(measured, prices))
