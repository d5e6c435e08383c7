"""A short soak (the full one is benchmarks/soak.py): random worker kills and restarts under async."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from soak import soak  # noqa: E402


@pytest.mark.slow
def test_short_soak_with_random_worker_kills(tmp_path):
    result = soak(24, folder=str(tmp_path), say=lambda text: None)  # a kill every 2-5 s until 8 s before the end
    assert result["crashes"] == 0 and result["kills"] >= 3 and result["restarts"] == result["kills"]
    assert result["loss_fell"], (result["first"], result["last"])
    assert all(code == 0 for code in result["exit_codes"].values()), result["exit_codes"]
    assert result["updates"] > 500
