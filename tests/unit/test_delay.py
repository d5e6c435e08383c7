import numpy as np
import pytest

from psgd.training.delay import DelayError, parse_delay


def test_kinds_and_ranks():
    rng = np.random.default_rng(0)
    assert parse_delay(None).seconds(1.0, rng) == 0 and not parse_delay("").applies_to(0)
    assert parse_delay("fixed:0.25").seconds(1.0, rng) == 0.25
    assert parse_delay("slowdown:4").seconds(0.01, rng) == pytest.approx(0.03)
    draws = [parse_delay("exp:0.1").seconds(0, rng) for _ in range(4000)]
    assert abs(np.mean(draws) - 0.1) < 0.01
    assert all(0.1 <= parse_delay("uniform:0.1:0.2").seconds(0, rng) <= 0.2 for _ in range(100))
    only0 = parse_delay("slowdown:3@0,2")
    assert only0.applies_to(0) and only0.applies_to(2) and not only0.applies_to(1)
    assert parse_delay("fixed:1").applies_to(7)


@pytest.mark.parametrize(
    "spec", ["slow:2", "fixed", "fixed:a", "uniform:2:1", "slowdown:0.5", "fixed:1@x", "exp:-1", "uniform:1"]
)
def test_bad_specs(spec):
    with pytest.raises(DelayError):
        parse_delay(spec)
