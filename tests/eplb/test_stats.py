"""The expert load window: steps older than the window drop out; imbalance under a placement."""

from __future__ import annotations

import pytest
import torch

from deepinfer.eplb import ExpertLoadWindow, balanced_placement, initial_placement
from deepinfer.eplb.stats import imbalance


def test_window_sums_the_last_steps_only():
    w = ExpertLoadWindow(num_layers=2, num_experts=4, window_steps=3)
    steps = [torch.tensor([[s, 0, 0, 1], [0, s, 1, 0]]) for s in range(1, 6)]
    for n, c in enumerate(steps, 1):
        w.record(c)
        expected = torch.stack(steps[max(0, n - 3):n]).sum(0)
        assert torch.equal(w.window_load(), expected)
        assert w.steps_in_window == min(n, 3) and w.steps_recorded == n
        rows = w.window_steps_rows()  # the steps in the window, one row each (ring order)
        assert sorted(rows[:, 0, 0].tolist()) == list(range(max(1, n - 2), n + 1))
    assert w.window_load()[0].tolist() == [3 + 4 + 5, 0, 0, 3]  # steps 1 and 2 dropped out
    w.window_load()[0, 0] = 999  # a copy: the window is not changed through it
    assert w.window_load()[0, 0] == 12
    w.reset()
    assert w.window_load().sum() == 0 and w.steps_recorded == 0


def test_one_layer_takes_a_flat_vector_and_bad_counts_are_refused():
    w = ExpertLoadWindow(1, 3, 2)
    w.record([1, 2, 3])
    assert w.window_load().tolist() == [[1, 2, 3]]
    with pytest.raises(ValueError, match="shape"):
        w.record([1, 2])
    with pytest.raises(ValueError, match=">= 0"):
        w.record([1, -2, 3])
    with pytest.raises(ValueError):
        ExpertLoadWindow(1, 3, 0)


def test_imbalance_of_placements():
    w = ExpertLoadWindow(1, 8, 4)
    assert w.imbalance(initial_placement(8, 4, 0)) == 1.0  # nothing recorded yet
    for _ in range(4):
        w.record([40, 20, 10, 10, 5, 5, 5, 5])
    # contiguous: ranks hold (0, 1), (2, 3), (4, 5), (6, 7): 60, 20, 10, 10 of mean 25
    assert w.imbalance(initial_placement(8, 4, 0)) == pytest.approx(60 / 25)
    balanced = balanced_placement(w.window_load()[0].tolist(), 4, 4)  # expert 0 split in two, 20-ish per rank
    assert w.imbalance(balanced) < 1.15
    assert imbalance([0, 0]) == 1.0 and imbalance([3, 1]) == 1.5
    with pytest.raises(ValueError, match="layer"):
        w.imbalance(balanced, layer=1)
    with pytest.raises(ValueError, match="placement of 4 experts"):
        w.imbalance(initial_placement(4, 2, 0))
