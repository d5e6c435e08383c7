"""``psgd bench elastic`` as a user runs it: a launch scaled 2 -> 4 -> 2 with psgd scale, and the same job fixed
at 2 and 4; its figures are the launches' own."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_elastic_scales_a_launch_and_loses_no_step(tmp_path):
    out = tmp_path / "elastic.json"
    argv = [sys.executable, "-m", "psgd.cli.main", "bench", "elastic", "--policy", "async", "--compare", "sync"]
    done = subprocess.run(
        argv + ["--model", "mlp", "--epochs", "400", "--json", str(out)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(out.read_text())
    (scaled,) = figures["scaled"]
    assert scaled["policy"] == "async" and scaled["job_batches"] == 400 * (1438 // 32)
    assert scaled["steps_lost"] == 0 and scaled["worker_steps"][2] > 0 and scaled["worker_steps"][3] > 0
    for change in ("quiet", "control", "scale_up", "scale_down"):
        assert scaled[change]["longest_step_s"] > 0 and scaled[change]["median_step_after_s"] > 0, scaled
    assert [r["workers"] for r in figures["compared"]] == ["2", "4", "2:4"]
    assert all(r["test_accuracy"] > 0.8 and r["median_step_s"] > 0 for r in figures["compared"])
    assert "async  2->4->2: 17600 of 17600 batches trained (0 lost)" in done.stdout
