"""`deepinfer bench economics`: the seeds' published inputs against their headline numbers, and measured runs.

The expected figures are worked out here by hand from the numbers the seed reports print (../shared/seeds), not
taken from the module: 155T tokens/day, $0.15 / $0.60 per million input / output tokens, 96% cache hits,
1.5M input tok/s per prefill and 14,000 output tok/s per decode accelerator on ~2400 accelerators, $5-8 all-in
per accelerator-hour; headlines $38 per accelerator-hour, >80% margin, 81-day payback, $22M/day.
"""

from __future__ import annotations

import json
import re

import pytest

from deepinfer.bench.economics import MeasuredRun, Prices, price_run
from deepinfer.cli import main


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["bench", "economics", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _summary(text: str, name: str) -> str:
    return re.search(rf"^  {name}:\s+(.*)$", text, re.M).group(1)


def _money(text: str) -> float:
    return float(re.search(r"-?\$?(-?[\d,]+\.?\d*)", text).group(1).replace(",", ""))


def _check(text: str, n: int) -> str:
    """The consistency section's block [n], up to the next one."""
    return re.search(rf"^\[{n}\] (.*?)(?=^\[\d+\]|\Z)", text, re.M | re.S).group(1)


def test_seeds_reproduce_headlines_and_name_the_disagreements(capsys):
    rc, out, _ = _cli(capsys, "--seeds", "--capital-usd", "60000")
    assert rc == 0

    # the cluster: P prefill + D decode = 2400 serving 155T/day at 1.5M / 14k tok/s each
    tok_s = 155e12 / 86400
    p = (tok_s - 2400 * 14_000) / (1_500_000 - 14_000)
    assert 1184 < p < 1186
    assert "1,184.6 prefill + 1,215.4 decode" in out

    # headline: $38/h, with cached input at the price that reproduces it (the seeds state none)
    inp, out_tok = p * 1.5e6 * 86400, (2400 - p) * 14_000 * 86400
    uncached_rev, output_rev = inp * 0.04 * 0.15 / 1e6, out_tok * 0.60 / 1e6
    cached_price = (38 * 2400 * 24 - uncached_rev - output_rev) / (inp * 0.96 / 1e6)
    assert 0.0025 < cached_price < 0.0027
    assert f"cached input ${cached_price:.4g}/M" in out
    assert _summary(out, "revenue per accelerator-hour") == "$38.00/h"
    assert _summary(out, "tokens per day per worker") == "155.000T tokens"
    # >80% margin at the middle of $5-8 (the default cost, $6.50)
    margin = float(_summary(out, "margin").rstrip("%"))
    assert margin == pytest.approx(100 * (1 - 6.5 / 38), abs=0.05) and margin > 80
    # 81-day payback: a $60,000 accelerator at $38 - $6.50 a hour
    payback = float(_summary(out, "payback period").split()[0])
    assert payback == pytest.approx(60000 / ((38 - 6.5) * 24), abs=0.05)
    assert 78 < payback < 84

    # every arithmetic line shows formula, numbers and result
    assert "revenue per accelerator-hour = revenue / accelerator-hours\n    = $2,188,800 / 57,600\n    = $38.00/h" in out

    # consistency section: verdicts and the numbers behind them
    assert "agrees" in _check(out, 1).splitlines()[0]  # 155T/day fits 2400 accelerators at the stated rates
    two = _check(out, 2)
    assert "$21,700,000" in two and "agrees" in two.splitlines()[0]  # 155T * $0.14 = $21.7M/day ~ "$22M/day"
    three = _check(out, 3)
    assert "DISAGREES" in three.splitlines()[0]  # a $0.14 blend is below the $0.15 input price
    blend_list = (inp * 0.15 + out_tok * 0.60) / (inp + out_tok)
    assert f"${blend_list:.4f}/M" in three
    four = _check(out, 4)
    assert "DISAGREES" in four.splitlines()[0]  # $21.7M/day on 2400 accelerators is $377/h, not $38
    assert f"off by {21.7e6 / 24 / 2400 / 38:.1f}x" in four and "$376.74/h" in four
    assert f"~{21.7e6 / 24 / 38:,.0f} accelerators" in four  # 23,794: the count $38/h would need
    five = _check(out, 5)
    assert "PARTLY" in five.splitlines()[0]
    assert "$30.24/h" in five  # one decode accelerator's output: 14,000 * 3600 / 1M * $0.60
    free = (uncached_rev + output_rev) / (2400 * 24)
    assert f"free hits give ${free:.2f}/h" in five and 31 < free < 32
    six = _check(out, 6)
    assert "PARTLY" in six.splitlines()[0]  # over 80% at $5 (86.8%) but not at $8 (78.9%)
    assert "86.8% at $5 but 78.9% at $8" in six and "$7.60/h" in six
    seven = _check(out, 7)
    assert "UNCHECKED" in seven.splitlines()[0]  # no capital cost is published
    assert f"${81 * 24 * (38 - 8):,.2f}-${81 * 24 * (38 - 5):,.2f}" in seven
    eight = _check(out, 8)
    assert "agrees" in eight.splitlines()[0] and "2.0 kW" in eight  # $166B/GW-year at $38/h: ~2 kW each


@pytest.mark.parametrize("cost, margin", [(5, 86.8), (8, 78.9)])
def test_seed_margin_across_the_published_cost_range(capsys, cost, margin):
    rc, out, _ = _cli(capsys, "--seeds", "--accelerator-hour-usd", str(cost))
    assert rc == 0
    assert _summary(out, "margin") == f"{margin}%"
    assert _summary(out, "payback period") == "n/a (no capital cost given)"


def test_seeds_with_free_cache_hits_miss_38(capsys):
    rc, out, _ = _cli(capsys, "--seeds", "--price-cached-input", "0")
    assert rc == 0
    assert _summary(out, "revenue per accelerator-hour") == "$31.31/h"


def test_measured_run_from_a_throughput_results_json(tmp_path, capsys):
    results = {"config": {}, "results": [
        {"engine": "vllm", "workload": "chat", "prompt_tokens": 999, "generated_tokens": 999, "wall_s": 1.0},
        {"engine": "deepinfer", "workload": "chat", "prompt_tokens": 2698, "generated_tokens": 8192,
         "wall_s": 10.3, "walls": [10.0, 10.3, 10.5]},
    ]}
    path = tmp_path / "throughput.json"
    path.write_text(json.dumps(results))
    rc, out, _ = _cli(capsys, "--results", str(path), "--workload", "chat", "--accelerator-hour-usd", "0.1",
                      "--capital-usd", "1000", "--hardware", "test VM")
    assert rc == 0
    revenue_h = (2698 * 0.15 + 8192 * 0.60) / 1e6 / 10.3 * 3600
    assert _money(_summary(out, "revenue per accelerator-hour")) == pytest.approx(revenue_h, abs=0.005)
    assert _summary(out, "tokens per day per worker") == f"{(2698 + 8192) / 10.3 * 86400 / 1e6:,.3f}M tokens"
    assert float(_summary(out, "payback period").split()[0]) == pytest.approx(1000 / ((revenue_h - 0.1) * 24),
                                                                              abs=0.05)
    assert "hardware: test VM" in out and "deepinfer chat" in out


def test_cpu_vm_price_is_stated_when_not_given(tmp_path, capsys):
    rc, out, _ = _cli(capsys, "--input-tokens", "1000", "--output-tokens", "100", "--wall-s", "2")
    assert rc == 0
    assert "m7a.large" in out and "$0.11592" in out
    assert _summary(out, "cost per accelerator-hour") == "$0.1159/h"


def test_loss_making_run_has_negative_margin_and_no_payback():
    e = price_run(MeasuredRun(100, 0, 10, 3600.0), Prices(0.15, 0.15, 0.6, 1.0, 50_000))
    assert e.margin is not None and e.margin < 0
    assert e.payback_days is None


@pytest.mark.parametrize("argv, message", [
    (["--input-tokens", "5", "--cached-input-tokens", "9", "--output-tokens", "1", "--wall-s", "1"],
     "exceed input tokens"),
    (["--input-tokens", "5", "--output-tokens", "1", "--wall-s", "0"], "--wall-s must be > 0"),
    (["--seeds", "--price-input", "-1"], "--price-input must be >= 0"),
    ([], "give --seeds, --results FILE"),
])
def test_bad_input_is_a_clear_error(capsys, argv, message):
    rc, _, err = _cli(capsys, *argv)
    assert rc == 2 and message in err


def test_unknown_results_file_shape_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"hello": 1}))
    rc, _, err = _cli(capsys, "--results", str(path))
    assert rc == 2 and "not a results JSON" in err
    path.write_text(json.dumps({"results": [{"engine": "deepinfer", "workload": "chat"}]}))  # fields missing
    rc, _, err = _cli(capsys, "--results", str(path))
    assert rc == 2 and "without the expected fields" in err


def test_guidellm_and_serve_load_results_count_completed_requests(tmp_path):
    guidellm = {"config": {}, "benchmarks": [{
        "config": {"strategy": {"streams": 4}}, "duration": 20.0,
        "requests": {"successful": [{"prompt_tokens": 158, "cached_tokens": 100, "output_tokens": 64}] * 3,
                     "errored": [{"prompt_tokens": 158, "output_tokens": 0}]}}]}
    serve_load = [[{"label": "deepinfer", "concurrency": 8, "wall_s": 10.0, "requests": [
        {"ok": True, "prompt_tokens": 150, "output_tokens": 64}, {"ok": False, "prompt_tokens": 150,
                                                                  "output_tokens": 3}]},
                   {"label": "vllm", "concurrency": 8, "wall_s": 5.0, "requests": [
                       {"ok": True, "prompt_tokens": 150, "output_tokens": 64}]}]]
    (tmp_path / "g.json").write_text(json.dumps(guidellm))
    (tmp_path / "s.json").write_text(json.dumps(serve_load))
    from deepinfer.bench.economics import load_run

    g = load_run(tmp_path / "g.json")
    assert (g.input_tokens, g.cached_input_tokens, g.output_tokens, g.wall_s) == (474, 300, 192, 20.0)
    s = load_run(tmp_path / "s.json", label="vllm")
    assert (s.input_tokens, s.output_tokens, s.wall_s) == (150, 64, 5.0)
    s = load_run(tmp_path / "s.json")  # the first label; the failed request earns nothing
    assert (s.input_tokens, s.output_tokens, s.wall_s) == (150, 64, 10.0)
    e = price_run(g, Prices(0.15, 0.015, 0.60, 0.1))
    assert e.revenue_per_accelerator_hour == pytest.approx(
        (174 * 0.15 + 300 * 0.015 + 192 * 0.60) / 1e6 / 20.0 * 3600)
