"""The machine bounds a benchmark divides by: the best of several measurements."""

import pytest

from benchmarks.hw_bounds import Machine, ModelCost, best_of, fraction


def test_best_of_keeps_each_bounds_best_measurement():
    slow = Machine({"float32": 121e9}, 25.2e9)
    fast = Machine({"float32": 192e9, "bfloat16": 400e9}, 36.6e9)
    best = best_of(slow, fast)
    assert best.flops == {"bfloat16": 400e9, "float32": 192e9}
    assert best.read_bytes_per_s == 36.6e9
    assert best_of(fast, slow) == best


def test_the_best_bound_gives_the_smaller_fraction():
    """A bound measured in a slow moment overstated the fraction; the best of both does not."""
    cost = ModelCost(params=134.5e6, gguf_bytes=96.6e6)
    slow, fast = Machine({"float32": 121e9}, 25.2e9), Machine({"float32": 192e9}, 36.6e9)
    alone, _ = fraction(176.8, True, slow, cost, "float32", gguf=True)
    both, kind = fraction(176.8, True, best_of(slow, fast), cost, "float32", gguf=True)
    assert kind == "mem"
    assert both == pytest.approx(176.8 / (36.6e9 / 96.6e6))
    assert both < alone


def test_best_of_nothing_is_an_error():
    with pytest.raises(ValueError):
        best_of()


@pytest.mark.slow  # two processes that each load the default model's cost (~20 s); the functions are tested above
def test_the_command_line_divides_by_the_best_of_the_files_measurements(tmp_path):
    """What serve_compare.sh runs: `measure` lines in a file, `fraction` against the best of them, for the
    default model (its FLOPs per token from the HF copy, its GGUF's bytes for the memory bound)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from benchmarks.hw_bounds import RunBounds, _machine_to_json

    root = Path(__file__).resolve().parents[2]
    script = root / "benchmarks" / "hw_bounds.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    slow = Machine({"bfloat16": 200e9, "float32": 100e9}, 20e9)
    fast = Machine({"bfloat16": 450e9, "float32": 220e9}, 37e9)
    path = tmp_path / "bounds.jsonl"
    path.write_text(_machine_to_json(slow) + "\n" + _machine_to_json(fast) + "\n")
    cost = RunBounds(measure=False).cost

    def run(*args: str) -> str:
        done = subprocess.run([sys.executable, str(script), "fraction", str(path), *args], capture_output=True,
                              text=True, check=True, timeout=120, env=env)
        return done.stdout.strip()

    # several results in one call (each call loads the model's cost once)
    assert run("1000", "bfloat16", "500", "float32").splitlines() == [
        f"{1000 / (450e9 / cost.flops_per_token):.2f} cmp", f"{500 / (220e9 / cost.flops_per_token):.2f} cmp"]
    assert run("200", "float32", "--single-stream") == f"{200 / (37e9 / cost.gguf_bytes):.2f} mem"


def test_a_mixture_of_experts_counts_its_routed_experts_at_top_k_of_their_number(tmp_path):
    """A token multiplies num_experts_per_tok of the routed experts: FLOPs per token count them at that share
    (a real safetensors file and config; shared experts and dense tensors count whole)."""
    import json

    import torch
    from safetensors.torch import save_file

    from benchmarks.hw_bounds import model_cost

    tensors = {
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 8),  # 64, dense
        "model.layers.0.mlp.gate.weight": torch.zeros(4, 8),  # 32, the router
        "model.layers.0.mlp.shared_experts.up_proj.weight": torch.zeros(8, 16),  # 128, shared
        "model.embed_tokens.weight": torch.zeros(10, 8),  # untied: not multiplied
        "lm_head.weight": torch.zeros(10, 8),  # 80
    }
    for e in range(4):  # 4 routed experts of 8 x 16 each
        tensors[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = torch.zeros(8, 16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    dense = 64 + 32 + 128 + 80
    (tmp_path / "config.json").write_text(json.dumps({"num_experts": 4, "num_experts_per_tok": 1}))
    assert model_cost(str(tmp_path), None).params == dense + 4 * 128 / 4
    (tmp_path / "config.json").write_text(json.dumps({"n_routed_experts": 4, "num_experts_per_tok": 2}))
    assert model_cost(str(tmp_path), None).params == dense + 4 * 128 / 2
    (tmp_path / "config.json").write_text(json.dumps({}))  # not a mixture: every tensor counts whole
    assert model_cost(str(tmp_path), None).params == dense + 4 * 128
