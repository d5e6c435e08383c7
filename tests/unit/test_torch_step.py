"""The benchmark against PyTorch (benchmarks/torch_step.py), without PyTorch: psgd's side of every network builds,
trains and has the parameters PyTorch's has; a child answers its chunks; a missing PyTorch or a bad flag ends it
with exit 2 in one line; psgd itself never imports torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from psgd.bench.turns import Side

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch_step  # noqa: E402

#: what benchmarks/torch_peer.py's networks count, by PyTorch 2.13 (sum of numel over parameters())
TORCH_PARAMETERS = {
    "mlp-64": 4810,
    "mlp-256": 19210,
    "mlp-1024": 76810,
    "cnn": 6058,
    "convnet": 14186,
    "gru": 16394,
    "transformer": 34122,
}


@pytest.mark.parametrize("key", torch_step.INPUTS)
def test_each_network_trains_in_psgd_with_pytorchs_parameter_count(key):
    step, parameters = torch_step.make_step(key, 8)
    losses = [step() for _ in range(8)]
    assert parameters == TORCH_PARAMETERS[key]
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


def test_a_child_answers_its_chunks_in_seconds():
    child = Side(
        "psgd",
        [sys.executable, str(ROOT / "benchmarks" / "torch_step.py"), "--child", "mlp-64", "4"],
        {**os.environ, **torch_step.THREADS},
        str(ROOT),
    )
    try:
        assert child.facts["parameters"] == TORCH_PARAMETERS["mlp-64"]
        assert 0 < child.seconds("3", "3 steps") < 60
    finally:
        child.close()
    assert child.proc.returncode == 0


def test_a_python_without_pytorch_ends_it_in_one_line(tmp_path, capsys):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
    python.chmod(0o755)
    assert torch_step.main(["--torch-python", str(python), "--networks", "mlp-64", "--cpu", "-1"]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [
        f"torch_step: {python} has no PyTorch (ModuleNotFoundError: No module named 'torch'); nothing "
        "to measure against"
    ]
    assert torch_step.main(["--torch-python", str(tmp_path / "absent"), "--cpu", "-1"]) == 2
    assert "cannot run" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--networks", "mlp-64,lstm"], "unknown network(s) lstm"),
        (["--rounds", "0"], "at least 1"),
        (["--cpu", "-1"], "--torch-python: name the Python"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv, says, capsys):
    with pytest.raises(SystemExit) as ended:
        torch_step.main(argv)
    assert ended.value.code == 2 and says in capsys.readouterr().err


def test_the_peer_without_pytorch_says_so_and_exits_2():
    try:
        import torch  # noqa: F401

        pytest.skip("PyTorch is installed here")
    except ImportError:
        pass
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "torch_peer.py"), "mlp-64", "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "no PyTorch" in done.stderr


def test_the_profile_names_the_steps_functions(capsys):
    assert torch_step.main(["--profile", "gru", "--rounds", "1", "--steps", "2", "--cpu", "-1"]) == 0
    assert "gru_cell" in capsys.readouterr().out
