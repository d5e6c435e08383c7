"""psgd bench comm: its front door, its checks of the flags, and a small real run."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest

PY = sys.executable


def bench(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "psgd.cli.main", "bench", "comm", *argv], capture_output=True, text=True, timeout=timeout
    )


def test_help_names_every_part_and_the_limits():
    done = bench("--help", timeout=60)
    assert done.returncode == 0, done.stderr
    for word in ("--parts", "--quick", "--json", "--rounds", "headline", "sweep", "latency", "scale", "loopback TCP"):
        assert word in done.stdout, word


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--parts", "sweep,warp"], ["--parts: unknown warp", "choose from"]),
        (["--sizes-mb", "4,lots"], ["--sizes-mb", "'4,lots'"]),
        (["--sizes-mb", "0"], ["at least"]),
        (["--steps", "0"], ["--steps must be at least 1"]),
        (["--rounds", "0"], ["--rounds must be at least 1"]),
        (["--focus-mb", "0"], ["--focus-mb"]),
    ],
)
def test_bad_flags_are_one_line_errors_before_anything_runs(argv, words):
    done = bench(*argv, timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == ""  # refused before the limits were measured
    assert done.stderr.startswith("psgd: error: ") and done.stderr.count("\n") == 1, done.stderr
    for word in words:
        assert word in done.stderr, (word, done.stderr)


@pytest.mark.slow
@pytest.mark.lacks(importlib.util.find_spec("mpi4py") is None, reason="the sweep's all-reduce needs the mpi extra")
def test_a_small_run_measures_each_part_against_the_limits(tmp_path):
    out = tmp_path / "comm.json"
    done = bench(
        "--parts",
        "headline,sweep,latency,optimizer",
        "--sizes-mb",
        "0.1",
        "--focus-mb",
        "0.2",
        "--rounds",
        "2",
        "--steps",
        "2",
        "--json",
        str(out),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "limits: raw loopback TCP" in done.stdout and "a small step's fixed cost" in done.stdout
    result = json.loads(out.read_text())
    for key in ("tcp_loopback_gbps", "tcp_model_sized_gbps", "memcpy_gbps"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    (row,) = result["sweep"]
    assert row["size_bytes"] == 100_000
    assert 0 < row["pull_s"] < row["step_s"] and 0 < row["push_s"] < row["step_s"]
    assert row["allreduce_s"] > 0 and row["step_over_tcp"] == pytest.approx(
        row["step_gbps"] / result["tcp_loopback_gbps"]
    )
    assert 0 < row["shard_peak_rss_mb"] < row["shard_rss_budget_mb"]
    headline = result["headline"]
    assert headline["size_bytes"] == 200_000 and len(headline["rounds"]) == 2
    for r in headline["rounds"]:
        assert r["step_over_tcp"] == pytest.approx(r["step_gbps"] / r["tcp_loopback_gbps"])
    assert headline["median_step_over_tcp"] == pytest.approx(
        sum(r["step_over_tcp"] for r in headline["rounds"]) / 2
    )  # the median of two is their mean
    latency = result["latency"]  # a launch and one process as users run them, then each link's small step
    assert "as users run it" in done.stdout and len(latency["launch_steps_per_s"]) == 1
    assert latency["launch_over_single"] == pytest.approx(
        latency["launch_steps_per_s"][0] / latency["single_steps_per_s"][0]
    )
    limit = latency["floor"]  # the same step split across two processes with nothing between them but memory
    assert len(limit["one_process_steps_per_s"]) == len(limit["two_processes_steps_per_s"]) == 3
    assert 0 < limit["split_over_one"] < 1.5 and "the floor: that step in one process" in done.stdout
    assert [(r["size_bytes"], r["link"]) for r in latency["steps"]] == [
        (size, link) for size in (64, 19_240) for link in ("tcp", "shm", "grpc")
    ]
    for r in latency["steps"]:
        assert r["one_round_trip_s"] > 0 and r["two_round_trips_s"] > 0
        shard = r["shard_s"] or 0.0  # the shard counts the time of its data port's requests, not gRPC's
        assert (r["shard_s"] is None) == (r["link"] == "grpc") and shard < r["one_round_trip_s"]
        bare = latency[
            "bare_grpc_rtt_s"
            if r["link"] == "grpc"
            else "bare_tcp_watched_rtt_s"
            if latency["busy_poll_us"]
            else "bare_tcp_rtt_s"
        ]
        assert r["bare_s"] == bare and r["rest_s"] == pytest.approx(r["one_round_trip_s"] - shard - bare)
    assert set(result["optimizer_gbps"]) == {"sgd", "momentum", "adam"}
    assert "grid" not in result and "scale" not in result  # only the parts asked for


@pytest.mark.slow
def test_the_shm_part_sets_shared_memory_against_the_data_port_on_one_shard(tmp_path):
    out = tmp_path / "comm.json"
    done = bench("--parts", "shm", "--sizes-mb", "0.1", "--focus-mb", "0.2", "--steps", "2", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "shared memory (shm) against the data port (tcp)" in done.stdout
    result = json.loads(out.read_text())
    rows = result["shm"]
    assert [(r["size_bytes"], r["workers"]) for r in rows] == [(100_000, 1), (200_000, 2), (200_000, 4)]
    for r in rows:
        for link in ("shm", "tcp"):
            assert 0 < r[link]["pull_s"] < r[link]["step_s"] and 0 < r[link]["push_s"] < r[link]["step_s"]
        assert r["shm_of_memcpy"] == pytest.approx(r["shm"]["step_gbps"] / result["memcpy_gbps"])
        assert r["tcp_over_shm"] == pytest.approx(r["tcp"]["step_s"] / r["shm"]["step_s"])
    assert set(result) >= {"shm", "memcpy_gbps", "tcp_loopback_gbps"} and "sweep" not in result


@pytest.mark.lacks(importlib.util.find_spec("mpi4py") is None, reason="the all-reduce benchmark needs the mpi extra")
def test_the_allreduce_benchmark_sets_mpi_beside_the_parameter_server_for_the_same_bytes(tmp_path):
    """benchmarks/allreduce.py, as small as it goes: one 100 kB gradient, two MPI ranks against one worker and one
    shard, beside the machine's loopback and memory copy."""
    out = tmp_path / "allreduce.json"
    done = subprocess.run(
        [PY, "-m", "psgd.bench.allreduce", "--sizes-mb", "0.1", "--ranks", "2", "--repeats", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["ranks"] == 2 and result["tcp_loopback_gbps"] > 0 and result["memcpy_gbps"] > 0
    (row,) = result["rows"]
    assert row["size_bytes"] == 100_000 and row["mpi_allreduce_s"] > 0 and row["ps_pull_push_s"] > 0
    assert row["ps_over_mpi"] == pytest.approx(row["ps_pull_push_s"] / row["mpi_allreduce_s"])
    assert "raw loopback TCP" in done.stdout and "PS/mpi" in done.stdout
