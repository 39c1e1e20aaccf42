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
