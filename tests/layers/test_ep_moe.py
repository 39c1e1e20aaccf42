"""ExpertParallelExperts against the single-process RoutedExperts, whatever the placement, the replicas, the
rank that computes a pair, or a switch of placement (real gloo processes for 2 ranks).

Bit-identical where every expert's matmul sees the same rows as the reference (one rank, no replicas: the
combine adds in the reference's order); otherwise within fp32 rounding, because a replica (or another
rank's tokens) changes an expert matmul's row count, and BLAS may round a row differently with the row
count (as it does between two batches in one process)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer.eplb.placement import Placement, balanced_placement, initial_placement
from deepinfer.layers.ep_moe import SPLIT_ROWS, ExpertComm, ExpertParallelExperts
from deepinfer.layers.moe import RoutedExperts

E, H, INTER, K = 8, 16, 12, 2


def _reference(seed: int = 0) -> RoutedExperts:
    torch.manual_seed(seed)
    ref = RoutedExperts(E, H, INTER)
    with torch.no_grad():
        ref.w13.normal_()
        ref.w2.normal_()
    return ref


def _copy_in(ref: RoutedExperts, ep: ExpertParallelExperts) -> None:
    with torch.no_grad():
        for e in range(E):
            for proj in ("gate", "up", "down"):
                dst = ep.expert_weight(e, proj)
                if dst is not None:
                    dst.copy_(ref.expert_weight(e, proj))
    ep.fill_replicas()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-4)


def _batch(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) if t else torch.zeros(0, K).long()
    w = torch.rand(t, K, generator=g)
    return x, ids, w


@torch.inference_mode()
def test_one_rank_matches_routed_experts_across_a_switch():
    ref = _reference()
    x, ids, w = _batch(9, 1)
    plain = ExpertParallelExperts(RoutedExperts(E, H, INTER), initial_placement(E, 1, 0), 0, None)
    _copy_in(ref, plain)
    assert torch.equal(plain(x, ids, w), ref(x, ids, w))  # same matmuls, same order of additions
    # one rank cannot hold replicas (placement: at most one copy of an expert per rank)
    with pytest.raises(ValueError, match="at most one replica per rank"):
        initial_placement(E, 1, 3)
    plain.apply_placement(balanced_placement([50, 1, 1, 1, 1, 1, 1, 30], 1, 0))
    assert plain.held_experts == tuple(range(E))
    assert _close(plain(x, ids, w), ref(x, ids, w))
    assert plain.stats.take()[1] == 2 * 9 * K  # pairs computed over the two forwards


def test_replica_choice_one_replica_for_few_rows_chunks_for_many():
    """The cost-aware rule (`layers/ep_moe.py`): an expert's few rows from one rank go to one replica (its own
    rank's where it holds one), rows that repay another weight read split into contiguous chunks; ranks
    without a replica rotate over the replicas."""
    # 4 ranks of 3 slots: expert 0 on ranks 0 and 2, expert 1 on ranks 1, 2 and 3, the rest once
    p = Placement(E, 4, (0, 2, 3, 1, 4, 5, 0, 1, 6, 1, 7, 2))
    base = RoutedExperts(E, H, INTER)
    ranks = [ExpertParallelExperts(base, p, r, None) for r in range(4)]
    for n in (1, 5, 2 * SPLIT_ROWS - 1):  # few rows: one replica, this rank's own where it holds one
        flat = torch.zeros(n, dtype=torch.long)
        counts = torch.bincount(flat, minlength=E)
        picked = [set(ep._choose_slots(flat, counts).tolist()) for ep in ranks]
        assert picked == [{0}, {0}, {6}, {6}]  # ranks 1 and 3 (no replica) rotate: slot 0, then slot 6
    flat = torch.tensor([1] * (3 * SPLIT_ROWS + 2) + [3, 0])
    slots = ranks[2]._choose_slots(flat, torch.bincount(flat, minlength=E)).tolist()
    # 50 rows of expert 1: three chunks (17, 17, 16) in pair order, rank 2's own slot 7 first, then 9, then 3
    assert slots[:3 * SPLIT_ROWS + 2] == [7] * 17 + [9] * 17 + [3] * 16
    assert slots[-2:] == [2, 6]  # expert 3 has one slot; expert 0's single row stays on rank 2
    flat = torch.tensor([1] * (2 * SPLIT_ROWS))
    # rank 0 holds no replica of expert 1 and is the first such rank: it starts at replica (0 + 1) % 3
    assert ranks[0]._choose_slots(flat, torch.bincount(flat, minlength=E)).tolist() == [7] * 16 + [9] * 16


def _rank_main(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        with torch.inference_mode():
            ref = _reference()
            ep = ExpertParallelExperts(RoutedExperts(E, H, INTER), initial_placement(E, 2, 2), rank,
                                       ExpertComm(None, rank, 2))
            _copy_in(ref, ep)
            out = []
            for placement in (None, Placement(E, 2, (7, 6, 5, 0, 1, 1, 2, 3, 4, 0))):
                if placement is not None:
                    ep.apply_placement(placement)  # experts move between the ranks
                for t in (6, 0, 3) if rank == 0 else (2, 5, 0):  # ranks with no tokens still take part
                    x, ids, w = _batch(t, 10 * rank + t)
                    out.append(_close(ep(x, ids, w), ref(x, ids, w)))
            # replicas of expert 0 on both ranks (slots 0 and 8 of the initial placement); rank 0 sends all
            # the rows, all routed to expert 0 and one cold expert (6, on rank 1)
            moved = (ep.placement.rank_experts(rank), ep.held_experts)
            ep.apply_placement(initial_placement(E, 2, 2))
            ep.stats.take()
            work = []
            for t in (5, 2 * SPLIT_ROWS + 4):
                x, _, w = _batch(t if rank == 0 else 0, 7)
                ids = torch.tensor([[0, 6]]).repeat(x.shape[0], 1)
                out.append(_close(ep(x, ids, w), ref(x, ids, w)))
                _, pairs, _, reads = ep.stats.take()
                work.append((pairs, reads))
            # bfloat16: the pairs' (slot, weight) travel as float32 bits inside the bf16 rows of x
            ep.to(torch.bfloat16)
            ref.to(torch.bfloat16)
            x, ids, w = _batch(7 if rank == 0 else 4, 30 + rank)
            got, want = ep(x.bfloat16(), ids, w.bfloat16()), ref(x.bfloat16(), ids, w.bfloat16())
            out.append(got.dtype == torch.bfloat16 and torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))
            results[rank] = (out, *moved, work)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes: ~8 s
def test_two_ranks_dispatch_combine_and_move_experts():
    from tests.server_utils import free_port

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(free_port(), results), nprocs=2)
        assert results[0][:3] == ([True] * 9, (7, 6, 5, 0, 1), (0, 1, 5, 6, 7))
        assert results[1][:3] == ([True] * 9, (1, 2, 3, 4, 0), (0, 1, 2, 3, 4))
        # (pairs computed, slot weight reads) per rank: 5 rows of expert 0 stay on rank 0's replica (one read,
        # not one per replica), expert 6's go to rank 1; 36 rows split 18 / 18 over both replicas
        few, many = 5, 2 * SPLIT_ROWS + 4
        assert [results[r][3][0] for r in (0, 1)] == [(few, 1), (few, 1)]
        assert [results[r][3][1] for r in (0, 1)] == [(many // 2, 1), (many // 2 + many, 2)]


def test_placement_and_config_validation(tiny_models):
    from deepinfer.config import EngineConfig, ParallelConfig
    from deepinfer.engine.engine import LLMEngine

    with pytest.raises(ValueError, match="must be a multiple of"):
        initial_placement(8, 3, 0)
    with pytest.raises(ValueError, match="needs expert_parallel_size >= 2"):
        ParallelConfig(enable_eplb=True, num_redundant_experts=2)
    with pytest.raises(ValueError, match="needs enable_eplb"):
        ParallelConfig(num_redundant_experts=2)
    with pytest.raises(ValueError, match="needs that many engine ranks"):
        LLMEngine(EngineConfig.from_kwargs(model=str(tiny_models["qwen3_moe"]), expert_parallel_size=2))
    with pytest.raises(ValueError, match="mixture-of-experts model"):
        LLMEngine(EngineConfig.from_kwargs(model=str(tiny_models["llama"]), enable_eplb=True, kv_store="none",
                                           kv_cache_memory="16MiB", profile_cost_model=False))
