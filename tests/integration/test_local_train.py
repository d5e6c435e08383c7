"""The single-process reference trainer, end to end, through the library and the ``psgd`` command."""

import json
import subprocess
import sys

import numpy as np
import pytest

from psgd.cli.main import main
from psgd.config import JobConfig
from psgd.training.local import train_local


def job(**sets):
    j = JobConfig()
    j = j.apply_sets(f"{k}={v}" for k, v in sets.items())
    return j


def test_mlp_reaches_97_percent_on_digits():
    result = train_local(JobConfig(), progress=False)
    assert result.test_accuracy >= 0.97
    assert result.steps == 30 * (1438 // 32)
    assert [p["step"] for p in result.history][-1] == result.steps


def test_softmax_regression_reaches_95_percent_on_digits():
    assert train_local(job(**{"model.name": "softmax"}), progress=False).test_accuracy >= 0.95


def test_cnn_learns_digits():
    result = train_local(job(**{"model.name": "cnn", "train.epochs": 4}), progress=False)
    assert result.test_accuracy >= 0.9


def test_same_seed_same_weights_other_seed_other_weights():
    a = train_local(job(**{"train.epochs": 1}), progress=False).params
    b = train_local(job(**{"train.epochs": 1}), progress=False).params
    c = train_local(job(**{"train.epochs": 1, "train.seed": 1}), progress=False).params
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not all(np.array_equal(a[k], c[k]) for k in a)


def test_float64_and_adam_with_a_schedule():
    result = train_local(
        job(
            **{
                "train.dtype": "float64",
                "train.epochs": 5,
                "optimizer.name": "adam",
                "optimizer.lr": 0.01,
                "optimizer.schedule": "cosine",
                "optimizer.total_steps": 220,
            }
        ),
        progress=False,
    )
    assert all(v.dtype == np.float64 for v in result.params.values())
    assert result.test_accuracy >= 0.95


def test_evaluating_beside_training_leaves_the_training_alone(tmp_path):
    """[train] eval_beside: each evaluation runs on a copy of the weights on a thread of its own; the weights
    end the same to the bit, every evaluation due is made or counted as skipped, and each point carries the
    step and the time its copy was taken."""
    sets = {"train.dtype": "float64", "train.epochs": 2, "train.eval_every": 3}
    inline = train_local(job(**sets), progress=False)
    metrics = tmp_path / "m.jsonl"
    beside = train_local(job(**sets, **{"train.eval_beside": "true"}), progress=False, metrics_path=str(metrics))
    assert all(np.array_equal(inline.params[k], beside.params[k]) for k in inline.params)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    evals = [r for r in records if r["event"] == "eval"]
    done = [r for r in records if r["event"] == "done"][0]
    due = len(range(3, beside.steps, 3))
    assert len(evals) - 1 + done["evaluations_skipped"] == due  # and the final weights' own evaluation
    steps = [e["step"] for e in evals]
    assert steps == sorted(steps) and steps[-1] == beside.steps and all(s % 3 == 0 for s in steps[:-1])
    walls = {r["clock"]: r["wall"] for r in records if r["event"] == "step"}
    for e in evals[:-1]:  # taken before the step it was due at computed its gradient
        assert e["wall"] <= walls[e["step"]]
    inline_points = {p["step"]: p["test_accuracy"] for p in inline.history}
    assert all(inline_points[e["step"]] == e["test_accuracy"] for e in evals)  # the same weights evaluated


def test_cli_train_prints_accuracy_saves_weights_and_metrics(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the run's folder is made (runs/DATE-TIME-local)
    weights, metrics = tmp_path / "w.npz", tmp_path / "m.jsonl"
    code = main(
        ["train", "--epochs", "2", "--no-progress", "-q", "--json", "--save", str(weights), "--metrics", str(metrics)]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert (tmp_path / summary["run_dir"] / "m.csv").is_file() and not (tmp_path / "m.csv").exists()
    assert 0.8 < summary["test_accuracy"] <= 1.0
    with np.load(weights, allow_pickle=False) as saved:
        assert set(saved.files) == {"dense0/W", "dense0/b", "dense1/W", "dense1/b", "dense2/W", "dense2/b"}
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    # one line per step, an evaluation after each epoch (the second one of the final weights), the end
    steps = summary["steps"]
    assert [e["event"] for e in events] == ["step"] * (steps // 2) + ["eval"] + ["step"] * (steps // 2) + [
        "eval",
        "done",
    ]
    assert [e["step"] for e in events if e["event"] == "eval"] == [steps // 2, steps]
    assert events[-2]["test_accuracy"] == summary["test_accuracy"] and events[-1]["steps"] == steps
    assert all(e["role"] == "local" for e in events)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--model", "resnet"], "unknown model 'resnet'"),
        (["--model", "no_such_module_xyz:Net"], "no_such_module_xyz"),
        (["--dataset", "imagenet"], "imagenet"),
        (["--dataset", "npz:/no/such/file.npz"], "/no/such/file.npz"),
        (["--optimizer", "adan"], "unknown optimizer 'adan'"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--batch-size", "0"], "batch_size must be an integer from 1 to 16777216"),
        (["--set", "model.hidden=[0]"], "hidden"),
    ],
)
def test_cli_user_errors_are_one_line_and_exit_2(argv, words, capsys):
    assert main(["train", "--epochs", "1", "--no-progress", "-q", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and err.startswith("psgd: error:") and "\n" not in err and "Traceback" not in err


def test_cli_job_file_and_help(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[model]\nname = "softmax"\n[train]\nepochs = 1\n')
    out = subprocess.run(
        [sys.executable, "-m", "psgd.cli.main", "train", "-c", str(path), "--no-progress", "-q", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert json.loads(out)["steps"] == 1438 // 32
    help_text = subprocess.run(
        [sys.executable, "-m", "psgd.cli.main", "train", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for flag in ("--config", "--model", "--dataset", "--set", "--device", "--metrics"):
        assert flag in help_text


@pytest.mark.slow
def test_ctrl_c_leaves_psgd_trains_state_where_it_says_and_resume_ends_where_an_unstopped_run_ends(tmp_path):
    import signal
    import time

    argv = [sys.executable, "-m", "psgd.cli.main", "train", "--epochs", "60", "--dtype", "float64", "--json"]
    whole = subprocess.run([*argv, "--save", "whole.npz"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr
    stopped = subprocess.Popen(
        [*argv, "--checkpoint", "state.npz", "--metrics", "m.jsonl"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not ((tmp_path / "m.jsonl").exists() and (tmp_path / "m.jsonl").read_text().count('"step"') > 20):
        assert time.monotonic() < deadline and stopped.poll() is None, "psgd train took no step"
        time.sleep(0.02)
    stopped.send_signal(signal.SIGINT)
    _, err = stopped.communicate(timeout=60)
    assert stopped.returncode == 128 + signal.SIGINT, err
    assert (
        "psgd train: stopped by SIGINT after" in err
        and "its state is in state.npz: psgd train --resume state.npz goes on from there" in err
    )
    resumed = subprocess.run(
        [*argv, "--resume", "state.npz", "--save", "resumed.npz"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    with np.load(tmp_path / "whole.npz") as a, np.load(tmp_path / "resumed.npz") as b:
        for name in a.files:
            np.testing.assert_array_equal(a[name], b[name])  # bitwise
