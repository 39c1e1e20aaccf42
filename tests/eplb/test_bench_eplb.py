"""`deepinfer bench eplb`: a small simulation end to end through the CLI, the trace format, and recording
routing from real runs of the tiny MoE models."""

from __future__ import annotations

import json

import numpy as np
import pytest

from deepinfer.bench.eplb import EplbSimConfig, run, scaled_shares
from deepinfer.bench.eplb_trace import RoutingTrace, load_trace, max_over_mean, record_trace, write_trace
from deepinfer.cli import main

SMALL = ["--ranks", "8", "16", "--redundant", "0", "8", "16", "32", "48", "--experts", "32", "--top-k", "4",
         "--layers", "2", "--tokens-per-rank", "256", "--steps", "45", "--interval", "15", "--window", "15",
         "--zipf", "0.8"]


def _table(out: str) -> dict[tuple[int, str], dict[str, str]]:
    lines = [ln for ln in out.splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for ln in lines[2:]:
        cells = dict(zip(head, (c.strip() for c in ln.strip("|").split("|")), strict=True))
        rows[(int(cells["ranks"]), cells["R"])] = cells
    return rows


def _series(rows, ranks: int, rs: list[str], column: str) -> list[float]:
    return [float(rows[(ranks, "off")][column])] + [float(rows[(ranks, r)][column]) for r in rs]


def test_bench_eplb_end_to_end(capsys):
    # replicas free of weight reads (HBM "infinitely" fast): more replicas never make a step slower
    assert main(["bench", "eplb", *SMALL, "--hbm-gbps", "1e12"]) == 0
    out = capsys.readouterr().out
    rows = _table(out)
    assert "skipped (experts + R not a multiple of ranks): R=8 at 16 ranks\n" in out  # 40 % 16 != 0
    for ranks, rs in ((8, ["0", "8", "16", "32", "48"]), (16, ["0", "16", "32", "48"])):
        steps, imb = _series(rows, ranks, rs, "step ms"), _series(rows, ranks, rs, "imbalance")
        # more replicas: the step never gets slower and the ranks more even (2% slack: the per-step noise of
        # routing the same tokens with a different stale window, and at 8 ranks x 10 slots the packing of 32
        # experts' replicas is coarser than at 8 slots: R=48 1.082 vs R=32 1.063)
        for a, b in zip(steps, steps[1:], strict=False):
            assert b <= a * 1.02, (ranks, steps)
        for a, b in zip(imb, imb[1:], strict=False):
            assert b <= a * 1.02, (ranks, imb)
        assert imb[0] > 1.8 and imb[-1] < 1.15 and steps[-1] < 0.8 * steps[0], (ranks, imb, steps)
        assert rows[(ranks, "off")]["replica weights/rank"] == "0.00 GiB"
        assert float(rows[(ranks, "off")]["waiting rank-ms"]) > 5 * float(rows[(ranks, rs[-1])]["waiting rank-ms"])
    # memory: R / N slots per rank of 3 * H * I bytes per MoE layer, for 58 layers
    assert rows[(8, "48")]["replica weights/rank"] == f"{48 / 8 * 3 * 7168 * 2048 * 58 / 2**30:.2f} GiB"
    assert rows[(8, "off")]["moved/rebalance"] == "0" and int(rows[(8, "32")]["moved/rebalance"]) > 0


def test_bench_eplb_replicas_cost_weight_reads(capsys):
    # with the stated HBM cost each slot's weights are read every step: the gain flattens, then turns
    assert main(["bench", "eplb", *SMALL, "--ranks", "8"]) == 0
    rows = _table(capsys.readouterr().out)
    rs = ["0", "8", "16", "32", "48"]
    steps = dict(zip(["off", *rs], _series(rows, 8, rs, "step ms"), strict=True))
    best = min(steps, key=steps.get)
    assert best not in ("off", "0", "48") and steps["48"] > steps[best] and steps[best] < 0.8 * steps["off"]
    imb = _series(rows, 8, rs, "imbalance")
    assert all(b <= a * 1.02 for a, b in zip(imb, imb[1:], strict=False))  # see the test above


def test_waiting_and_step_time_by_hand():
    # one layer, 2 experts on 2 ranks, every token to expert 0 (top-1): rank 0 does all the work
    cfg = EplbSimConfig(experts=2, top_k=1, layers=1, ranks=(2,), redundant=(0, 2), steps=4, interval=2,
                        window=2, tflops=6 * 7168 * 2048 / 1e12 / 1e-6, hbm_gbps=1e30, a2a_latency_us=0,
                        link_gbps=1e30)  # t_token = 1 us, no slot or transfer cost
    from deepinfer.bench.eplb import simulate, stated_costs

    counts = np.zeros((4, 1, 2), dtype=np.int64)
    counts[:, 0, 0] = 100
    tokens = np.full(4, 100)
    off = simulate(cfg, counts, tokens, 2, None, stated_costs(cfg))
    assert off.step_ms == pytest.approx(0.1) and off.waiting_ms == pytest.approx(0.1) and off.imbalance == 2.0
    split = simulate(cfg, counts, tokens, 2, 2, stated_costs(cfg))  # expert 0 on both ranks after a rebalance
    assert split.step_ms == pytest.approx(0.05) and split.waiting_ms == pytest.approx(0) and split.imbalance == 1.0


def test_scaled_shares_keep_the_profile():
    curve = np.array([0.4, 0.3, 0.2, 0.1])
    s = scaled_shares(curve, 256)
    assert s.sum() == pytest.approx(1.0) and len(s) == 256 and (np.diff(s) <= 1e-15).all()
    # the hottest quarter of the 256 carries about what the hottest of the 4 did
    assert s[:64].sum() == pytest.approx(0.4, abs=0.05)
    assert max_over_mean(scaled_shares(np.ones(8), 256)) == pytest.approx(1.0)


def test_trace_roundtrip_and_bad_files(tmp_path):
    counts = np.array([[[3, 1, 0, 0]], [[1, 1, 1, 1]]])
    t = RoutingTrace(4, 2, ("layers.0.mlp.gate",), np.array([2, 2]), counts, {"model": "x"})
    path = tmp_path / "t.jsonl"
    write_trace(path, t)
    back = load_trace(path)
    assert back.num_experts == 4 and back.top_k == 2 and np.array_equal(back.counts, counts)
    assert back.expert_shares()[0].tolist() == [0.5, 0.25, 0.125, 0.125]
    lines = path.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines[0] + "\n" + json.dumps({"step": 0, "tokens": 2, "counts": [[3, 1, 0, 1]]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: counts must"):
        load_trace(bad)
    bad.write_text('{"format": "something else"}\n')
    with pytest.raises(ValueError, match="header"):
        load_trace(bad)
    assert main(["bench", "eplb", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["bench", "eplb", "--redundant", "-1"]) == 2
    assert main(["bench", "eplb", "--record-trace", str(tmp_path / "x.jsonl")]) == 2  # no --record-model


def test_simulating_from_a_trace_and_replaying_it_directly(tmp_path, capsys):
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(30):  # 16 experts top-2, expert 3 hot
        c = np.zeros(16, dtype=np.int64)
        for _ in range(64):
            c[rng.choice(16, 2, replace=False, p=np.r_[[0.04] * 3, [0.4], [0.04] * 12])] += 1
        steps.append(c[None])
    path = tmp_path / "t.jsonl"
    write_trace(path, RoutingTrace(16, 2, ("l0",), np.full(30, 64), np.stack(steps), {"model": "synthetic"}))
    assert main(["bench", "eplb", "--trace", str(path), "--replay-direct", "--experts", "16", "--ranks", "4",
                 "--redundant", "0", "4", "--steps", "30", "--interval", "10", "--window", "10"]) == 0
    rows = _table(capsys.readouterr().out)
    assert float(rows[(4, "4")]["imbalance"]) < float(rows[(4, "0")]["imbalance"]) < float(rows[(4, "off")]["imbalance"])
    report, _ = run(EplbSimConfig(trace=str(path), ranks=(8,), redundant=(0, 8), experts=32, top_k=4, layers=1,
                                  tokens_per_rank=16, steps=30, interval=10, window=10))
    assert "recorded expert max/mean per layer" in report


def _check_recording(flat: RoutingTrace, skewed: RoutingTrace, e: int, k: int, layers: int, skew: float) -> None:
    from deepinfer.bench.eplb_trace import skew_bias

    assert flat.num_experts == e and flat.top_k == k and len(flat.layers) == layers
    # one prefill step of 3 prompts * 5 tokens, then one token per prompt per decode step
    assert flat.tokens.tolist() == [15, 3, 3, 3]
    assert (flat.counts.sum(axis=2) == flat.tokens[:, None] * k).all()
    assert skewed.source["skew"] == skew
    # the gate bias -s ln(1 + rank) sends most pairs of the top-k layers to the experts of bias rank < k
    favoured = sorted(np.argsort(-skew_bias(e, skew, 0).numpy())[:k].tolist())
    for i in range(layers):
        share = skewed.counts[:, i, favoured].sum() / skewed.counts[:, i].sum()
        assert share > 0.9 and max_over_mean(skewed.expert_shares()[i]) > max_over_mean(flat.expert_shares()[i])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_record_routing_from_a_tiny_model(tiny_models, tmp_path, arch):
    out = tmp_path / "trace.jsonl"
    flat = record_trace(str(tiny_models[arch]), out, skew=0.0, prompts=3, prompt_len=5, new_tokens=4)
    skewed = record_trace(str(tiny_models[arch]), out, skew=4.0, prompts=3, prompt_len=5, new_tokens=4)
    assert load_trace(out).counts.tolist() == skewed.counts.tolist()
    # qwen3_moe: 8 experts top 2, layer 1 of 3 dense; mixtral: 4 experts top 2, both layers sparse
    _check_recording(flat, skewed, *((8, 2, 2) if arch == "qwen3_moe" else (4, 2, 2)), 4.0)


@pytest.mark.slow
def test_record_routing_from_a_tiny_deepseek_v4(tmp_path, default_model_dir):
    from tests.models.v4_tiny import build_v4

    path = tmp_path / "v4"
    build_v4(path, tokenizer_dir=default_model_dir)  # layer 0 hash-routed, layers 1 and 2 top-k; 4 experts top 2
    flat = record_trace(str(path), tmp_path / "a.jsonl", skew=0.0, prompts=3, prompt_len=5, new_tokens=4)
    skewed = record_trace(str(path), tmp_path / "b.jsonl", skew=4.0, prompts=3, prompt_len=5, new_tokens=4)
    assert flat.layers == ("layers.0.ffn", "layers.1.ffn", "layers.2.ffn")
    # the hash layer routes by token id: the bias does not change it (the prompts' step; the generated tokens differ)
    assert skewed.counts[0, 0].tolist() == flat.counts[0, 0].tolist()
    top_k_only = RoutingTrace(4, 2, skewed.layers[1:], skewed.tokens, skewed.counts[:, 1:], skewed.source)
    _check_recording(RoutingTrace(4, 2, flat.layers[1:], flat.tokens, flat.counts[:, 1:], flat.source), top_k_only,
                     4, 2, 2, 4.0)


@pytest.mark.slow
def test_recording_a_dense_model_is_refused(default_model_dir, tmp_path):
    with pytest.raises(ValueError, match="no MoE router"):
        record_trace(str(default_model_dir), tmp_path / "t.jsonl", prompts=1, prompt_len=2, new_tokens=1)


def test_topk_counts_sample_without_replacement():
    from deepinfer.bench.eplb import topk_counts

    rng = np.random.default_rng(1)
    w = np.array([100.0, 1.0, 1.0, 1.0, 1.0])
    c = topk_counts(rng, w, 4000, 2)
    # expert 0 is left out only when both picks miss it: (4 / 104) * (3 / 103) = 0.11%; never taken twice
    assert c.sum() == 8000 and 3980 <= c[0] <= 4000
    # the second pick is uniform over the other four
    assert np.allclose(c[1:] / 4000, 0.25, atol=0.04)
    # against Gumbel-top-k (the same distribution) on a skewed 64-expert prior
    w = (np.arange(64) + 1.0) ** -1.0
    ours = topk_counts(rng, w, 20000, 4) / 20000
    g = np.log(w) - np.log(rng.exponential(size=(20000, 64)))
    ref = np.bincount(np.argpartition(g, -4, axis=1)[:, -4:].ravel(), minlength=64) / 20000
    assert np.abs(ours - ref).max() < 0.02


def test_simulated_replica_choice_is_the_engines():
    """`route_rows` (the simulation) sends each source rank's rows where the engine's `_choose_slots` does:
    random rows per (expert, rank) from 0 to 3 x SPLIT_ROWS, on a placement with 1-3 replicas per expert."""
    import torch

    from deepinfer.bench.eplb import preference_table, route_rows
    from deepinfer.eplb.placement import Placement
    from deepinfer.eplb.policy import SPLIT_ROWS, chunk_rows
    from deepinfer.layers.ep_moe import ExpertParallelExperts
    from deepinfer.layers.moe import RoutedExperts

    experts, ranks = 8, 4
    p = Placement(experts, ranks, (0, 2, 3, 1, 4, 5, 0, 1, 6, 1, 7, 2))
    base = RoutedExperts(experts, 16, 12)
    engine = [ExpertParallelExperts(base, p, r, None) for r in range(ranks)]
    rng = np.random.default_rng(0)
    for _ in range(20):
        rows = rng.integers(0, 3 * SPLIT_ROWS, size=(experts, ranks))
        slot_rows, flow = route_rows(p, preference_table(p), rows, SPLIT_ROWS)
        want_slots = np.zeros(len(p.physical_to_logical))
        want_flow = np.zeros((ranks, ranks))
        for r, ep in enumerate(engine):
            flat = torch.tensor([e for e in range(experts) for _ in range(int(rows[e, r]))], dtype=torch.long)
            slots = ep._choose_slots(flat, torch.bincount(flat, minlength=experts)).numpy()
            np.add.at(want_slots, slots, 1)
            np.add.at(want_flow[r], slots // p.slots_per_rank, 1)
        assert (slot_rows == want_slots).all() and (flow == want_flow).all()
    assert chunk_rows(50, 3) == [17, 17, 16] and chunk_rows(31, 2) == [31, 0] and chunk_rows(0, 2) == [0, 0]
