"""`benchmarks/swa_replay.py --quick` end to end on tiny models (Gemma 3, Qwen2 with sliding layers, DeepSeek-V4):
the script runs, prints its table and writes every field per model and mode, and bounded replay (b) computes
fewer prefill tokens than recomputing (a). Slow: three engines per model, ~30-60 s on 2 cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.models.v4_tiny import build_v4

ROOT = Path(__file__).resolve().parents[2]
MODE_FIELDS = ("prefill_tokens_computed", "prompt_tokens", "cached_tokens", "replayed_tokens", "ttft_ms_median",
               "ttft_ms_per_turn", "store_bytes_per_token")
QUALITY_FIELDS = ("greedy_agree_prefix_mean", "greedy_equal_positions_mean", "kl_first_token_mean_turns_2_on",
                  "kl_agreeing_positions_mean")


@pytest.mark.slow
def test_quick_mode_on_tiny_models(tiny_models, default_model_dir, tmp_path):
    v4 = tmp_path / "v4"
    build_v4(v4, tokenizer_dir=default_model_dir)
    out = tmp_path / "swa.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "swa_replay.py"), "--quick", "--dtype", "float32",
           "--model", f"gemma3={tiny_models['gemma3']}", "--model", f"qwen2_swa={tiny_models['qwen2_swa']}",
           "--model", f"v4={v4}", "--json", str(out), "--workdir", str(tmp_path / "work")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for label in ("gemma3", "qwen2_swa", "v4"):
        assert f"{label}: 4 turns" in proc.stdout
    assert "(c) is emulated" in proc.stdout
    res = json.loads(out.read_text())["models"]
    for label in ("gemma3", "qwen2_swa"):
        modes = res[label]["modes"]
        for m in "abc":
            assert all(f in modes[m] for f in MODE_FIELDS), (label, m, modes[m])
        for m in "bc":
            assert all(f in modes[m] for f in QUALITY_FIELDS), (label, m)
        a, b, c = modes["a"], modes["b"], modes["c"]
        assert a["cached_tokens"] == 0 and a["prefill_tokens_computed"] == a["prompt_tokens"]
        assert b["prefill_tokens_computed"] < a["prefill_tokens_computed"]
        assert b["replayed_tokens"] > 0 and b["replayed_tokens"] == b["engine_swa_replayed_tokens"]
        assert b["cached_by_tier"]["store"] > 0 and b["store_bytes_per_token"] > 0
        assert c["replayed_tokens"] == 0 and c["cached_by_tier"]["device"] == c["cached_tokens"] > 0
        assert c["prefill_tokens_computed"] <= b["prefill_tokens_computed"]
        assert 0 < b["store_bytes_vs_c"] < 1
    v4modes = res["v4"]["modes"]
    assert v4modes["a"]["prefill_tokens_computed"] == v4modes["a"]["prompt_tokens"]
    assert v4modes["c"]["prefill_tokens_computed"] < v4modes["a"]["prefill_tokens_computed"]
    if "status" in v4modes["b"]:  # no V4 store in this tree: a projection of its compressed entries
        assert v4modes["b"]["status"].startswith("n/a") and v4modes["b"]["store_bytes_per_token_projected"] > 0
    else:
        assert v4modes["b"]["prefill_tokens_computed"] < v4modes["a"]["prefill_tokens_computed"]
