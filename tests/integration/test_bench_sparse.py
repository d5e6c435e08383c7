"""psgd bench sparse: its checks of the flags, and a small real run whose figures hang together."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

PY = sys.executable


def bench(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "psgd.cli.main", "bench", "sparse", *argv], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--rows", "1e5,many"], ["--rows", "'1e5,many'"]),
        (["--rows", "0"], ["at least"]),
        (["--steps", "0"], ["--steps must be at least 1"]),
        (["--alpha", "0.5"], ["--alpha must lie between 1 and 3"]),
    ],
)
def test_bad_flags_are_one_line_errors_before_anything_runs(argv, words):
    done = bench(*argv, timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == ""
    assert done.stderr.startswith("psgd: error: ") and done.stderr.count("\n") == 1, done.stderr
    for word in words:
        assert word in done.stderr, (word, done.stderr)


@pytest.mark.lacks(importlib.util.find_spec("mpi4py") is None, reason="the all-reduce baselines need the mpi extra")
def test_the_parameter_servers_step_moves_the_rows_touched_and_the_dense_all_reduce_the_table(tmp_path):
    out = tmp_path / "sparse.json"
    done = bench("--rows", "2000,200000", "--dim", "8", "--steps", "3", "--lookups", "500", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "crossover:" in done.stdout
    result = json.loads(out.read_text())
    small, large = result["sizes"]
    for row in (small, large):
        ps, ar, dense = row["ps"], row["allreduce"], row["dense"]
        # a worker's step moves its distinct rows' ids and values, down and up, and the one dense weight
        per_row = 2 * (8 + 8 * 4)
        assert 0 < ps["rows_per_step"] <= 500
        assert ps["bytes_per_step"] == pytest.approx(per_row * ps["rows_per_step"] + 8, rel=0.25)
        assert ps["rows_per_s_per_shard"] > 0 and ps["fill_rows_per_s_per_shard"] > 0
        assert min(ps["shard_rss_mb"]) > 0 and ar["rank_rss_mb"] > 0 and ar["step_s"] > 0
        assert dense["bytes_per_step"] == pytest.approx(row["rows"] * 8 * 4)  # 2 ranks: a ring sends it once
    # 100 times the rows: the dense all-reduce moves 100 times the bytes, the parameter server about the same
    assert large["dense"]["bytes_per_step"] == pytest.approx(100 * small["dense"]["bytes_per_step"])
    assert large["ps"]["bytes_per_step"] < 2 * small["ps"]["bytes_per_step"]
    assert large["allreduce"]["table_bytes"] > 50 * small["allreduce"]["table_bytes"]  # every rank holds every row
    assert result["crossover_rows"] in (None, 2000, 200000)
