"""``psgd launch`` keeps the trained model in both modes (in its run folder, or where --save says); ``psgd eval``
scores it as the launch did;
a user's model in the current folder trains under ``psgd launch`` and ``psgd train``.

Every command runs as a user types it: the console scripts, in the user's folder, with the user's
environment (no PYTHONPATH pointing at the model's folder).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from helpers import TOKEN, free_port_pair

PSGD = shutil.which("psgd") or "psgd"
TANHNET = Path(__file__).resolve().parent.parent / "data" / "tanhnet.py"
JOB = ["--epochs", "3", "--optimizer", "sgd", "--lr", "0.1"]


def run(argv: list[str], cwd: Path, timeout: float = 240) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, f"{' '.join(argv)}: exit {done.returncode}\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def has_mpiexec() -> bool:
    from psgd.collective import BackendUnavailable
    from psgd.launcher import find_mpiexec

    try:
        find_mpiexec()
        import mpi4py  # noqa: F401
    except (BackendUnavailable, ImportError):
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode",
    [
        "ps",
        pytest.param(
            "allreduce", marks=pytest.mark.lacks(not has_mpiexec(), reason="needs mpi4py and mpiexec (the mpi extra)")
        ),
    ],
)
def test_launch_saves_weights_that_eval_scores_as_the_launch_did(tmp_path, mode):
    saved = tmp_path / "w.npz"
    launched = run([PSGD, "launch", "--mode", mode, "--no-progress", "--json", "--save", str(saved), *JOB], tmp_path)
    assert launched["saved"] == str(saved)
    with np.load(saved, allow_pickle=False) as weights:
        assert sorted(weights.files) == ["dense0/W", "dense0/b", "dense1/W", "dense1/b", "dense2/W", "dense2/b"]
    scored = run([PSGD, "eval", str(saved), "--json", *JOB], tmp_path)
    assert scored["test_accuracy"] == launched["test_accuracy"]
    assert scored["test_loss"] == pytest.approx(launched["test_loss"], rel=1e-6)
    assert launched["test_accuracy"] > 0.7  # trained: chance is 0.1


@pytest.mark.slow
def test_launch_keeps_the_trained_model_in_its_run_folder_unless_told_where(tmp_path):
    """As psgd.launch does: a launch without --save still keeps its final weights, in RUN/final.npz."""
    launched = run([PSGD, "launch", "--no-progress", "--json", "--run-dir", "run", *JOB], tmp_path)
    saved = tmp_path / "run" / "final.npz"
    assert launched["saved"] == str(Path("run") / "final.npz") and saved.is_file()
    scored = run([PSGD, "eval", str(saved), "--json", *JOB], tmp_path)
    assert scored["test_accuracy"] == launched["test_accuracy"]
    said = subprocess.run([PSGD, "launch", "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "(default: RUN/final.npz" in " ".join(said.split())


@pytest.mark.slow
def test_a_model_in_the_current_folder_trains_everywhere(tmp_path):
    shutil.copy(TANHNET, tmp_path / "tanhnet.py")
    model = ["--model", "tanhnet:TanhMLP", "--epochs", "2"]
    launched = run([PSGD, "launch", "--no-progress", "--json", "--save", "w.npz", *model], tmp_path)
    assert launched["test_accuracy"] > 0.8
    trained = run([PSGD, "train", "--no-progress", "--json", *model], tmp_path)
    assert trained["test_accuracy"] > 0.8
    scored = run([PSGD, "eval", "w.npz", "--json", *model], tmp_path)
    assert scored["test_accuracy"] == launched["test_accuracy"]


@pytest.mark.slow
def test_one_launch_per_node_trains_what_one_machine_trains(tmp_path):
    """Two nodes on loopback addresses 127.0.0.1 and 127.0.0.2, one command each, as on two machines;
    sync training is deterministic, so the result is the one-node run's to the last digit."""
    hosts = ["127.0.0.1", "127.0.0.2"]
    port = free_port_pair(hosts=tuple(hosts))
    job = [*JOB, "--shards", "2", "--workers", "2", "--no-progress", "--json"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PSGD_TOKEN"] = TOKEN  # the job's token, the same on every node
    nodes = [
        subprocess.Popen(
            [
                PSGD,
                "launch",
                "--nnodes",
                "2",
                "--node-rank",
                str(i),
                "--hosts",
                ",".join(hosts),
                "--port",
                str(port),
                "--run-dir",
                str(tmp_path / f"node{i}"),
                *job,
            ],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in (1, 0)
    ]
    try:
        outputs = [p.communicate(timeout=240) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
            p.wait(10)
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(err[-2000:] for _, err in outputs)
    for _, err in outputs:  # several nodes without certificates: plaintext, said once on each
        assert sum("WARNING no TLS: the token" in line for line in err.splitlines()) == 1, err[-2000:]
    node1, node0 = (json.loads(out.strip().splitlines()[-1]) for out, _ in outputs)
    assert node0["node_rank"] == 0 and node1["node_rank"] == 1
    assert (tmp_path / "node0" / "worker-0.jsonl").exists() and not (tmp_path / "node0" / "worker-1.jsonl").exists()
    assert (tmp_path / "node1" / "worker-1.jsonl").exists()
    assert "serving here (127.0.0.2:" in outputs[0][1]
    alone = run([PSGD, "launch", *job], tmp_path)
    assert node0["test_accuracy"] == alone["test_accuracy"]
    assert node0["test_loss"] == pytest.approx(alone["test_loss"], rel=1e-6)
