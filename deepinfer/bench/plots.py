"""PNG plots of benchmark results JSON files (matplotlib, Agg backend): `deepinfer bench plot FILE...`.

One place knows the shapes the repository's benchmark scripts write (`kind_of`) and draws each:

    throughput.py   tok/s per workload, one bar per engine (median of the repeats, whiskers: fastest/slowest)
    serve_load.py   TTFT distribution per server label (empirical CDF of the per-request TTFTs)
    guidellm        TTFT distribution (guidellm_run.sh's JSON; the engine named from serve_compare.sh's port)
    router.py       TTFT and ITL p50 / p99 per routing policy (medians of the repeats)
    agentic.py      prefix-cache comparison per workload: hit rate by tier, TTFT, output tok/s per configuration
    swa_replay.py   cache modes per model: prefill tokens computed and TTFT per conversation turn

Given several serving results at once (serve_load.py and guidellm), `render_files` also draws throughput and
TTFT against streams for each engine (`<name>_streams.png`) and their TTFT distributions on one axis
(`<name>_ttft.png`). The scripts call `plot_after_run` after writing their JSON, so the PNG lands next to it;
without matplotlib (the `bench` extra) they print a note and carry on. matplotlib is imported only here, and
only when a plot is drawn: deepinfer itself does not need it.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# benchmarks/serve_compare.sh serves deepinfer on 8101 and vLLM on 8102; guidellm's JSON records only the URL
SERVE_COMPARE_PORTS = {"8101": "deepinfer", "8102": "vllm"}


@dataclass(frozen=True)
class ServingRun:
    """One serving benchmark run at a fixed number of streams, from serve_load.py or guidellm."""

    engine: str
    streams: int
    output_tok_per_s: float
    ttft_ms: tuple[float, ...]  # per completed request
    source: str


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("plots need matplotlib: pip install 'deepinfer[bench]' (or matplotlib)") from e
    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    return plt


def kind_of(data: Any) -> str | None:
    """Which script wrote this results JSON (None: a shape this module does not draw)."""
    if isinstance(data, dict):
        if isinstance(data.get("benchmarks"), list) and "config" in data:
            return "guidellm"
        if isinstance(data.get("results"), list) and all("engine" in r for r in data["results"]):
            return "throughput"
        if isinstance(data.get("runs"), dict) and isinstance(data.get("medians"), dict):
            return "router"
        models = data.get("models")
        if isinstance(models, dict) and models and all(isinstance(m, dict) and "modes" in m for m in models.values()):
            return "swa_replay"
        results = data.get("results")
        if isinstance(results, dict) and results and all(
                isinstance(v, dict) and v and all(isinstance(c, dict) and "hit_pct" in c for c in v.values())
                for v in results.values()):
            return "agentic"
    if _serve_load_summaries(data):
        return "serve_load"
    return None


def _serve_load_summaries(data: Any) -> list[dict[str, Any]]:
    items = data if isinstance(data, list) else [data]
    flat = [s for item in items for s in (item if isinstance(item, list) else [item])]
    ok = flat and all(isinstance(s, dict) and "requests" in s and "concurrency" in s for s in flat)
    return flat if ok else []


def serving_runs(data: Any, source: str) -> list[ServingRun]:
    """serve_load.py summaries or a guidellm benchmark as `ServingRun`s (empty for other shapes)."""
    kind = kind_of(data)
    runs: list[ServingRun] = []
    if kind == "serve_load":
        for s in _serve_load_summaries(data):
            ttft = tuple(1000 * r["ttft"] for r in s["requests"] if r.get("ok") and r.get("ttft") is not None)
            runs.append(ServingRun(s.get("label") or "server", int(s["concurrency"]), float(s["output_tok_per_s"]),
                                   ttft, source))
    elif kind == "guidellm":
        target = json.dumps(data.get("config", {}).get("spec", data.get("config", {})))
        port = (re.findall(r"127\.0\.0\.1:(\d+)", target) or ["?"])[0]
        engine = SERVE_COMPARE_PORTS.get(port, f"port {port}")
        for b in data["benchmarks"]:
            strategy = b["config"]["strategy"]
            ok = b["requests"]["successful"]
            tokens = sum(r.get("output_tokens") or 0 for r in ok)
            ttft = tuple(r["time_to_first_token_ms"] for r in ok if r.get("time_to_first_token_ms") is not None)
            streams = strategy.get("streams") or strategy.get("max_concurrency") or 0
            runs.append(ServingRun(engine, int(streams), tokens / b["duration"] if b["duration"] else 0.0, ttft,
                                   source))
    return runs


def _percentile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


def plot_throughput(data: dict[str, Any], path: Path, title: str) -> Path:
    plt = _pyplot()
    rows = data["results"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(engines)
    for i, engine in enumerate(engines):
        by_w = {r["workload"]: r for r in rows if r["engine"] == engine}
        xs, ys, lo, hi = [], [], [], []
        for j, w in enumerate(workloads):
            if w not in by_w:
                continue
            r = by_w[w]
            rates = [r["generated_tokens"] / t for t in r.get("walls") or [r["wall_s"]]]
            xs.append(j + (i - (len(engines) - 1) / 2) * width)
            ys.append(r["tok_per_s"])
            lo.append(r["tok_per_s"] - min(rates))
            hi.append(max(rates) - r["tok_per_s"])
        bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=engine)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("generated tokens / s (median of repeats)")
    ax.set_title(title)
    ax.legend()
    return _save(fig, path)


def plot_router(data: dict[str, Any], path: Path, title: str) -> Path:
    plt = _pyplot()
    med = data["medians"]
    policies = list(med)
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, metric, scale, unit in ((axes[0], "ttft", 1.0, "s"), (axes[1], "itl", 1000.0, "ms")):
        width = 0.38
        for k, q in enumerate(("p50", "p99")):
            ys = [med[p][f"{metric}_{q}"] * scale for p in policies]
            bars = ax.bar([i + (k - 0.5) * width for i in range(len(policies))], ys, width, label=q)
            ax.bar_label(bars, fmt="%.2f" if unit == "s" else "%.0f", fontsize=8)
        ax.set_xticks(range(len(policies)), policies)
        ax.set_yscale("log")
        ax.set_ylabel(f"{metric.upper()} ({unit}, median of repeats)")
        ax.legend()
    fig.suptitle(title)
    return _save(fig, path)


def plot_agentic(data: dict[str, Any], path: Path, title: str) -> Path:
    plt = _pyplot()
    workloads = list(data["results"])
    fig, axes = plt.subplots(len(workloads), 3, figsize=(11, 3.2 * len(workloads)), squeeze=False)
    for row, w in zip(axes, workloads, strict=True):
        configs = data["results"][w]
        names = list(configs)
        bottom = [0.0] * len(names)
        for tier in ("device", "host", "store"):
            ys = [configs[c].get(f"hit_{tier}_pct", 0.0) for c in names]
            row[0].bar(names, ys, bottom=bottom, label=tier)
            bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
        ideal = configs[names[0]].get("ideal_hit_pct")
        if ideal is not None:
            row[0].axhline(ideal, color="k", ls="--", lw=1, label="ideal")
        row[0].set_ylabel(f"{w}: prompt tokens hit (%)")
        row[0].legend(fontsize=8)
        width = 0.27
        for k, q in enumerate(("p50", "mean", "p99")):
            ys = [configs[c].get(f"ttft_{q}_ms", 0.0) / 1000 for c in names]
            row[1].bar([i + (k - 1) * width for i in range(len(names))], ys, width, label=q)
        row[1].set_xticks(range(len(names)), names)
        row[1].set_ylabel("TTFT (s)")
        row[1].legend(fontsize=8)
        bars = row[2].bar(names, [configs[c].get("output_tok_per_s", 0.0) for c in names])
        row[2].bar_label(bars, fmt="%.1f", fontsize=8)
        row[2].set_ylabel("output tokens / s")
    fig.suptitle(title)
    return _save(fig, path)


def plot_swa_replay(data: dict[str, Any], path: Path, title: str) -> Path:
    """Per model: prefill tokens computed and TTFT per conversation turn, one line per mode (recompute,
    bounded replay + store, all layers' KV kept); modes that did not run (no per-turn data) are left out."""
    plt = _pyplot()
    models = data["models"]
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.4 * len(models)), squeeze=False)
    for row, (name, m) in zip(axes, models.items(), strict=True):
        for i, (key, mode) in enumerate(m["modes"].items()):  # a mode keeps its colour across models
            if "computed_per_turn" not in mode:
                continue
            turns = range(1, len(mode["computed_per_turn"]) + 1)
            label = f"{key}: {mode.get('name', key)}"
            row[0].plot(turns, mode["computed_per_turn"], "o-", color=f"C{i}", label=label)
            row[1].plot(turns, [v / 1000 for v in mode["ttft_ms_per_turn"]], "o-", color=f"C{i}", label=label)
        row[0].set_ylabel(f"{name}: prefill tokens computed")
        row[1].set_ylabel("TTFT (s)")
        for ax in row:
            ax.set_xlabel("conversation turn")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title)
    return _save(fig, path)


def plot_ttft_cdf(runs: Sequence[ServingRun], path: Path, title: str) -> Path:
    """Empirical CDF of per-request TTFT, one line per run (engine, streams, source)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    several = len({r.source for r in runs}) > 1
    colors = {e: f"C{i % 10}" for i, e in enumerate(dict.fromkeys(r.engine for r in runs))}
    seen: dict[str, int] = defaultdict(int)  # runs of one engine share its colour and vary the line style
    runs_of = Counter(r.engine for r in runs if r.ttft_ms)
    for r in runs:
        if not r.ttft_ms:
            continue
        style = ("-", "--", ":", "-.")[seen[r.engine] % 4]
        seen[r.engine] += 1
        xs = sorted(v / 1000 for v in r.ttft_ms)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        label = f"{r.engine}" + (f" run {seen[r.engine]}" if runs_of[r.engine] > 1 else "")
        label += f", {r.streams} streams (median {statistics.median(xs):.2f} s)"
        if several:
            label += f" [{Path(r.source).stem[-15:]}]"
        ax.step(xs, ys, where="post", label=label, color=colors[r.engine], ls=style)
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_streams(runs: Sequence[ServingRun], path: Path, title: str) -> Path:
    """Output tok/s and TTFT (p50, p95) against streams, one line per engine (median over its runs)."""
    plt = _pyplot()
    by: dict[str, dict[int, list[ServingRun]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        by[r.engine][r.streams].append(r)
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(10, 4))
    for engine, points in sorted(by.items()):
        streams = sorted(points)
        tput = [statistics.median(r.output_tok_per_s for r in points[s]) for s in streams]
        line = ax_t.plot(streams, tput, "o-", label=f"{engine} (median of runs)")[0]
        for s in streams:  # every run, so the spread between repeats shows
            ax_t.scatter([s] * len(points[s]), [r.output_tok_per_s for r in points[s]], color=line.get_color(),
                         alpha=0.35, s=14)
        p50 = [statistics.median(statistics.median(r.ttft_ms) / 1000 for r in points[s] if r.ttft_ms) for s in streams]
        p95 = [statistics.median(_percentile(r.ttft_ms, 95) / 1000 for r in points[s] if r.ttft_ms) for s in streams]
        ax_l.plot(streams, p50, "o-", color=line.get_color(), label=f"{engine} p50")
        ax_l.plot(streams, p95, "s--", color=line.get_color(), label=f"{engine} p95")
    ax_t.set_xlabel("concurrent streams")
    ax_t.set_ylabel("output tokens / s")
    ax_l.set_xlabel("concurrent streams")
    ax_l.set_ylabel("TTFT (s)")
    ticks = sorted({r.streams for r in runs})
    for ax in (ax_t, ax_l):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(s) for s in ticks])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def render_file(path: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """The plots of one results JSON, written next to it (or into out_dir); [] for a shape not drawn."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from e
    out = Path(out_dir) if out_dir is not None else path.parent
    try:
        return _render(data, path.stem, out)
    except (KeyError, TypeError, AttributeError) as e:  # the right shape, a field missing or of the wrong type
        raise ValueError(f"{path}: a results JSON without the expected fields ({type(e).__name__}: {e})") from e


def _render(data: Any, stem: str, out: Path) -> list[Path]:
    kind = kind_of(data)
    title = f"{stem} ({kind})"
    if kind == "throughput":
        return [plot_throughput(data, out / f"{stem}.png", title)]
    if kind == "router":
        return [plot_router(data, out / f"{stem}.png", title)]
    if kind == "agentic":
        return [plot_agentic(data, out / f"{stem}.png", title)]
    if kind == "swa_replay":
        return [plot_swa_replay(data, out / f"{stem}.png", title)]
    if kind in ("serve_load", "guidellm"):
        return [plot_ttft_cdf(serving_runs(data, stem), out / f"{stem}_ttft.png", f"{stem}: TTFT distribution")]
    return []


def render_files(paths: Iterable[str | Path], out_dir: str | Path | None = None,
                 name: str | None = None) -> list[tuple[str, Path]]:
    """Each file's plots, and with serving results from two or more files, `<name>_streams.png` and
    `<name>_ttft.png` over all of them (`name` default: serving; next to the first file or in out_dir)."""
    paths = [Path(p) for p in paths]
    done: list[tuple[str, Path]] = []
    serving: list[ServingRun] = []
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no such results file")
        pngs = render_file(p, out_dir)
        if not pngs:
            print(f"{p}: not a results shape this plotter knows; skipped", file=sys.stderr)
        done += [(str(p), png) for png in pngs]
        serving += serving_runs(json.loads(p.read_text()), str(p))
    if len({r.source for r in serving}) > 1:
        out = Path(out_dir) if out_dir is not None else paths[0].parent
        name = name or "serving"
        sources = f"{len({r.source for r in serving})} runs"
        done.append(("(all serving runs)", plot_streams(serving, out / f"{name}_streams.png",
                                                        f"{name}: throughput and TTFT against streams ({sources})")))
        done.append(("(all serving runs)", plot_ttft_cdf(serving, out / f"{name}_ttft.png",
                                                         f"{name}: TTFT distributions ({sources})")))
    return done


def plot_after_run(json_path: str | Path) -> None:
    """For the benchmark scripts: plot the results JSON just written; a missing matplotlib is a note, not a
    failure (the measurement is already saved)."""
    try:
        for png in render_file(json_path):
            print(f"plot: {png}")
    except ValueError as e:
        print(f"plot skipped: {e}", file=sys.stderr)
