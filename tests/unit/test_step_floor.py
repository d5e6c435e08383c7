"""psgd bench step's arithmetic: the model's bytes, the steady state of a run's step records, the floor."""

from __future__ import annotations

import pytest

from psgd.bench.step import StepBenchError, floor_seconds, model_bytes, steady
from psgd.model import build_model


@pytest.mark.parametrize("width", [64, 1024])
def test_model_bytes_are_the_mlps_own(width):
    model = build_model("mlp", (1024,), 10, hidden=[width, width])
    assert model_bytes(width) == sum(4 * int(__import__("math").prod(s.shape)) for s in model.specs())


def test_the_steady_state_is_the_second_half():
    # 10 steps: the first half slow (start-up), then one step every 10 ms
    walls = [1.0, 2.0, 3.0, 4.0, 5.0, 5.01, 5.02, 5.03, 5.04, 5.05]
    records = [
        {"wall": w, "seconds": {"weights": 0.0, "compute": 0.004 + i * 1e-4, "exchange": 0.006}}
        for i, w in enumerate(walls)
    ]
    out = steady(records)
    assert out["steps_per_s"] == pytest.approx(100.0)
    assert out["exchange_ms"] == pytest.approx(6.0) and out["compute_ms"] == pytest.approx(4.7)
    assert out["steps"] == 10


def test_too_few_steps_say_so():
    with pytest.raises(StepBenchError, match="too few"):
        steady([{"wall": 1.0}, {"wall": 2.0}])


def test_the_floor_moves_the_bytes_both_ways_and_passes_the_update_once():
    # 1 GB each way at 10 GB/s and 20 GB/s, and 1.5 copies of 1 GB at 30 GB/s
    assert floor_seconds(10**9, 10.0, 20.0, 30.0) == pytest.approx(0.1 + 0.05 + 0.05)
