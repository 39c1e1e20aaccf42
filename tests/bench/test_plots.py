"""deepinfer/bench/plots.py: PNGs rendered from small results JSONs of each shape the benchmark scripts write,
read back with matplotlib (dimensions, and that something was drawn), and `deepinfer bench plot`'s errors."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest

from deepinfer.bench.plots import kind_of, plot_after_run, render_files
from deepinfer.cli import main


def _serve_load(label: str, concurrency: int, tok_s: float, ttfts: list[float]) -> dict:
    return {"label": label, "concurrency": concurrency, "wall_s": 10.0, "output_tok_per_s": tok_s,
            "requests": [{"ok": True, "ttft": t, "prompt_tokens": 100, "output_tokens": 64} for t in ttfts]
            + [{"ok": False, "ttft": None, "prompt_tokens": 100, "output_tokens": 0}]}


THROUGHPUT = {"config": {}, "results": [
    {"engine": e, "workload": w, "prompt_tokens": 100, "generated_tokens": 1000, "wall_s": s,
     "tok_per_s": 1000 / s, "walls": [s * 0.9, s, s * 1.2]}
    for e, w, s in (("deepinfer", "chat", 1.0), ("vllm", "chat", 1.2), ("deepinfer", "single", 20.0))]}
ROUTER = {"args": {}, "runs": {"round_robin": [], "deepinfer": []}, "medians": {
    p: {"ttft_p50": a, "ttft_p99": b, "itl_p50": 0.05, "itl_p99": 0.9, "prefill_imbalance": 1.0,
        "decode_imbalance": 1.0} for p, a, b in (("round_robin", 0.9, 25.0), ("deepinfer", 0.4, 6.6))}}
SWA_REPLAY = {"args": {}, "models": {"m": {"modes": {
    "a": {"name": "recompute", "computed_per_turn": [700, 950, 1200], "ttft_ms_per_turn": [3000, 5000, 7000]},
    "b": {"name": "replay + store", "status": "n/a"},  # a mode that did not run: left out, not a crash
    "c": {"name": "all KV kept", "computed_per_turn": [700, 240, 220], "ttft_ms_per_turn": [3000, 900, 800]}}}}}
AGENTIC = {"args": {}, "results": {"mooncake": {
    c: {"requests": 10, "prompt_tokens": 1000, "ideal_hit_pct": 24.0, "hit_pct": h, "hit_device_pct": 6.0,
        "hit_host_pct": 0.0, "hit_store_pct": h - 6.0, "ttft_mean_ms": 8000.0, "ttft_p50_ms": 9000.0,
        "ttft_p99_ms": 16000.0, "output_tok_per_s": 25.0, "wall_s": 90.0}
    for c, h in (("store_off", 6.0), ("store_on", 22.0))}}}


def _check_png(path: Path, width: int, height: int) -> None:
    assert path.is_file() and path.stat().st_size > 10_000, path
    img = mpimg.imread(path)
    assert img.shape[:2] == (height, width)
    # drawn, not blank: a good share of the pixels differ from the (white) background
    rgb = img[..., :3]
    assert (np.abs(rgb - 1.0).sum(axis=-1) > 0.1).mean() > 0.03


def test_each_results_shape_renders_a_png(tmp_path):
    files = {"throughput.json": THROUGHPUT, "router.json": ROUTER, "agentic.json": AGENTIC, "swa.json": SWA_REPLAY,
             "serve_a.json": _serve_load("deepinfer", 8, 250.0, [0.2, 0.5, 0.7, 1.1]),
             "serve_b.json": [_serve_load("deepinfer", 32, 400.0, [0.9, 1.5, 2.0, 4.0]),
                              _serve_load("vllm", 32, 380.0, [0.6, 0.8, 1.2, 2.5])]}
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    assert [kind_of(json.loads((tmp_path / n).read_text())) for n in files] == [
        "throughput", "router", "agentic", "swa_replay", "serve_load", "serve_load"]
    out = tmp_path / "plots"
    done = dict((Path(png).name, src) for src, png in render_files([tmp_path / n for n in files], out_dir=out,
                                                                     name="t"))
    assert set(done) == {"throughput.png", "router.png", "agentic.png", "swa.png", "serve_a_ttft.png", "serve_b_ttft.png",
                         "t_streams.png", "t_ttft.png"}
    _check_png(out / "throughput.png", 700, 400)  # figsize (7, 4) at 100 dpi
    _check_png(out / "router.png", 900, 400)
    _check_png(out / "agentic.png", 1100, 320)
    _check_png(out / "swa.png", 1000, 340)
    _check_png(out / "serve_b_ttft.png", 700, 400)
    _check_png(out / "t_streams.png", 1000, 400)
    _check_png(out / "t_ttft.png", 700, 400)


def test_script_hook_writes_next_to_the_json(tmp_path, capsys):
    path = tmp_path / "throughput_run.json"
    path.write_text(json.dumps(THROUGHPUT))
    plot_after_run(path)
    assert "plot: " in capsys.readouterr().out
    _check_png(tmp_path / "throughput_run.png", 700, 400)


def test_cli_plot_and_its_errors(tmp_path, capsys):
    good = tmp_path / "router.json"
    good.write_text(json.dumps(ROUTER))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"something": "else"}))
    assert main(["bench", "plot", str(good), str(other)]) == 0
    captured = capsys.readouterr()
    assert "router.png" in captured.out and "other.json: not a results shape" in captured.err
    assert (tmp_path / "router.png").is_file() and not (tmp_path / "other.png").exists()
    assert main(["bench", "plot", str(tmp_path / "missing.json")]) == 2
    assert "no such results file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["bench", "plot", str(bad)]) == 2
    assert "not JSON" in capsys.readouterr().err
    bad.write_text(json.dumps({"results": [{"engine": "deepinfer", "workload": "chat"}]}))  # fields missing
    assert main(["bench", "plot", str(bad)]) == 2
    assert "without the expected fields" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["throughput_di_vllm_amx.json", "router_skewed_pinned_rate1_s8b.json"])
def test_repository_results_still_parse(tmp_path, name):
    """The plotter keeps up with what the scripts wrote in earlier sessions (benchmarks/results/)."""
    src = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / name
    (png,) = [p for _, p in render_files([src], out_dir=tmp_path)]
    assert png.stat().st_size > 10_000
