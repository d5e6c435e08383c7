"""The documentation's Python examples (docs/howto/python.md) run as a user runs them: ``python train_blobs.py``
trains a network and a dataset class of its own in the script's process; ``python launch_blobs.py`` launches shards
and workers on a class they import by name, with the script's arrays handed to them as a file; ``psgd run ...
hardest.py`` runs a loop psgd's own cannot express on every worker, and stops it cleanly on SIGTERM."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_rejoined_at_once, wait_for

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "howto" / "python.md"


def page_files(folder: Path) -> None:
    """Each ``# NAME.py`` block of the page, written to ``folder`` as that file."""
    for block in re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), flags=re.S):
        name = re.match(r"# (\w+\.py):", block)
        if name:
            (folder / name.group(1)).write_text(block)


def run(script: str, folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, script], cwd=folder, capture_output=True, text=True, timeout=300)


def test_the_page_runs_each_command_it_shows():
    commands = re.findall(r"^python (\S+)$", PAGE.read_text(encoding="utf-8"), flags=re.M)
    assert commands == ["train_blobs.py", "launch_blobs.py", "regress.py"]
    assert re.findall(r"^psgd run .* (\S+)$", PAGE.read_text(encoding="utf-8"), flags=re.M) == ["hardest.py"]


def test_a_network_and_a_dataset_class_of_ones_own_train_from_a_script(tmp_path):
    page_files(tmp_path)
    done = run("train_blobs.py", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    accuracy = float(re.search(r"^test accuracy ([\d.]+) after (\d+) steps$", done.stdout, re.M).group(1))
    assert accuracy > 0.9, done.stdout
    assert len(re.findall(r"^  epoch \d+: test accuracy", done.stdout, re.M)) == 5
    assert "hidden/W (4, 16)" in done.stdout and "out/b (3,)" in done.stdout


def test_launch_from_a_script_hands_the_workers_its_class_by_name_and_its_arrays_as_a_file(tmp_path):
    page_files(tmp_path)
    done = run("launch_blobs.py", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    said = re.search(
        r"^test accuracy ([\d.]+) after (\d+) steps \((\d+) \+ (\d+), worker by worker\); run folder "
        r"(\S+)$",
        done.stdout,
        re.M,
    )
    assert said and float(said.group(1)) > 0.8, done.stdout
    folder = tmp_path / said.group(5)
    each = [int(said.group(3)), int(said.group(4))]  # each worker's steps, as its own metrics lines end
    assert each == [
        json.loads(path.read_text().splitlines()[-1])["clock"]
        for path in (folder / "worker-0.jsonl", folder / "worker-1.jsonl")
    ]
    assert int(said.group(2)) == sum(each) and each[0] > 0
    with np.load(folder / "data.npz", allow_pickle=False) as data:
        assert sorted(data.files) == ["num_classes", "target", "x_test", "x_train", "y_test", "y_train"]
        assert str(data["target"]) == "classes"
        assert len(data["x_train"]) + len(data["x_test"]) == 900
    with np.load(folder / "final.npz", allow_pickle=False) as weights:
        assert weights["hidden/W"].shape == (4, 16)
    assert 'name = "nets:TwoLayers"' in (folder / "job.toml").read_text()


@pytest.mark.slow
def test_regression_from_a_script_is_launched_trained_and_scored_by_r2(tmp_path):
    """Float targets are values: the built-in MLP takes the squared error, the workers read them from RUN/data.npz
    as values, and the run is scored by R² (its metrics lines and psgd report say so)."""
    page_files(tmp_path)
    done = run("regress.py", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 values per example of shape (2,)" in done.stdout
    said = re.search(r"^test R² ([\d.-]+), test loss ([\d.]+); run folder (\S+)$", done.stdout, re.M)
    assert said and float(said.group(1)) > 0.9, done.stdout
    folder = tmp_path / said.group(3)
    with np.load(folder / "data.npz", allow_pickle=False) as data:
        assert str(data["target"]) == "values" and data["y_train"].shape[1:] == (2,)
    evals = [json.loads(line) for line in (folder / "worker-0.jsonl").read_text().splitlines() if '"eval"' in line]
    assert evals and all("test_r2" in e and "test_accuracy" not in e for e in evals)
    assert evals[-1]["test_r2"] > evals[0]["test_r2"]
    report = subprocess.run(
        [sys.executable, "-m", "psgd.cli.main", "report", str(folder)], capture_output=True, text=True, timeout=120
    )
    assert re.search(r"worker-0: .*test R² 0\.9", report.stdout), report.stdout + report.stderr


def psgd_run(folder: Path, *argv: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "psgd.cli.main", "run", *argv],
        cwd=folder,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **popen,
    )


@pytest.mark.slow
def test_psgd_run_runs_the_pages_script_as_every_worker_with_a_loop_of_its_own(tmp_path):
    page_files(tmp_path)
    (command,) = re.findall(r"^psgd run (.*)$", PAGE.read_text(encoding="utf-8"), flags=re.M)
    done = psgd_run(tmp_path, "--run-dir", "run", *command.split())
    out, err = done.communicate(timeout=300)
    assert done.returncode == 0, err[-3000:]
    assert "worker 0: 110 steps, each on the hardest 32 of 128 candidates" in out  # worker 0's own print
    accuracy = float(re.search(r"^final test accuracy: ([\d.]+) \(.*2 copies of hardest.py", out, re.M).group(1))
    assert accuracy > 0.9, out
    for r in (0, 1):
        records = [json.loads(line) for line in (tmp_path / "run" / f"worker-{r}.jsonl").read_text().splitlines()]
        steps = [x for x in records if x["event"] == "step"]
        assert [x["clock"] for x in steps] == list(range(110)) and all(x["loss"] > 0 for x in steps)
        assert records[-1]["event"] == "done" and records[-1]["clock"] == 110


def test_a_script_that_is_not_started_by_psgd_run_is_told_how_to_start_it(tmp_path):
    page_files(tmp_path)
    done = run("hardest.py", tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr  # one line, as a command says it
    (line,) = done.stderr.splitlines()
    assert line.startswith("psgd.join(): error: PSGD_JOB_FILE, PSGD_RANK not set: start this script with psgd run")


def stopped_by_sigterm(folder: Path, epochs: int, *flags: str) -> tuple[subprocess.Popen, str, list[Path]]:
    """psgd run (``flags`` its own) of the page's hardest.py (2 workers, 1 shard; arguments it ignores) into
    RUN=run, sent SIGTERM once both workers have pushed a step: the launcher (ended), its stderr and the workers'
    metrics files."""
    page_files(folder)
    launcher = psgd_run(
        folder,
        "--run-dir",
        "run",
        "--workers",
        "2",
        "--shards",
        "1",
        "--epochs",
        str(epochs),
        *flags,
        "hardest.py",
        *SCRIPT_ARGS,
    )
    metrics = [folder / "run" / f"worker-{r}.jsonl" for r in (0, 1)]
    err = sigterm_once(
        launcher, lambda: all(p.exists() and p.stat().st_size for p in metrics), "both workers' first push"
    )
    return launcher, err, metrics


#: the script's own arguments, which the command that continues the run repeats
SCRIPT_ARGS = ("--warmup", "100", "--note", "a b")


def sigterm_once(launcher: subprocess.Popen, ready: Callable[[], bool], what: str) -> str:
    """SIGTERM to ``launcher`` once ``ready()`` (``what`` it waits for: polled for up to 60 s); its stderr."""
    try:
        deadline = time.monotonic() + 60
        while not ready():
            assert time.monotonic() < deadline and launcher.poll() is None, f"no {what}"
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
    return err


def test_sigterm_to_psgd_run_stops_every_script_worker_cleanly(tmp_path):
    launcher, err, metrics = stopped_by_sigterm(tmp_path, 400, "--timeout", "120")
    assert launcher.returncode == 128 + signal.SIGTERM, err
    again = ["psgd", "run", "--timeout", "120.0", "--resume", "run", str(tmp_path / "hardest.py"), *SCRIPT_ARGS]
    assert f"continue with {shlex.join(again)}" in err
    assert "psgd run --resume reads it" in err  # the token's line names the command that continues the run
    for path in metrics:  # each left between steps: its last line says so, no step was cut short
        last = json.loads(path.read_text().splitlines()[-1])
        assert last["event"] == "done" and 0 < last["clock"] < 400 * 11, last
    for r in (0, 1):
        assert "Traceback" not in (tmp_path / "run" / f"worker-{r}.log").read_text()


@pytest.mark.slow
def test_psgd_run_stopped_goes_on_from_its_shards_checkpoints_with_resume(tmp_path):
    launcher, err, metrics = stopped_by_sigterm(tmp_path, 15)
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert f"continue with psgd run --resume run {tmp_path / 'hardest.py'} --warmup 100 --note 'a b'" in err
    stopped = [json.loads(p.read_text().splitlines()[-1])["clock"] for p in metrics]
    # each worker hears the stop at its own moment: one may have pushed a step more than the other
    assert abs(stopped[0] - stopped[1]) <= 1 and 0 < min(stopped) <= max(stopped) < 330, stopped
    again = psgd_run(tmp_path, "--resume", "run", "hardest.py", *SCRIPT_ARGS)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    assert re.search(r"^final test accuracy: 0\.9", out, re.M), out
    assert_rejoined_at_once(tmp_path / "run", err)
    assert_each_step_once(metrics, stopped, 330)


def assert_each_step_once(metrics: list[Path], stopped: list[int], total: int) -> None:
    """Each worker's second part began at the clock it stopped at and went on to the job's end: every step once."""
    for path, at in zip(metrics, stopped):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        ends = [i for i, x in enumerate(records) if x["event"] == "done"]
        assert len(ends) == 2 and records[ends[0] + 1]["clock"] == at and records[-1]["clock"] == total, path.name
        clocks = [x["clock"] for x in records if x["event"] == "step"]
        assert clocks == list(range(total)), path.name


# held.py: while the file "hold" is there, both workers compute step 2 and say so; worker 1 then holds its push
# until it is asked to stop, and leaves without it
HELD = """import pathlib, time
import psgd

with psgd.join() as w:
    while w.clock < w.steps and not w.stopping:
        params = w.pull()
        x, y = w.batch()
        loss, grads = w.model.loss_and_grads(params, x, y)
        if w.clock == 2 and pathlib.Path("hold").exists():
            pathlib.Path(f"at-2-{w.rank}").touch()
            if w.rank == 1:
                deadline = time.monotonic() + 60
                while not w.stopping and time.monotonic() < deadline:
                    time.sleep(0.01)
                break
        w.push(grads, loss=loss)
"""


@pytest.mark.slow
def test_a_sync_job_stopped_with_one_worker_a_step_ahead_resumes_with_every_step_once(tmp_path):
    """The stop race, made to happen: each worker hears a stop at its own moment, so under sync one may push a
    step its peer does not.  Here worker 0 pushes step 2 and worker 1 holds it until the launch is stopped.  Each
    worker used to tell its shard it left: worker 1's goodbye closed round 2 with worker 0's push alone, and the
    resumed worker 1 went on at clock 3, its step 2 never taken.  A stopped launch pauses its workers: round 2
    stays open in the shard's last checkpoint, and the resumed worker 1 pushes its step 2 into it."""
    (tmp_path / "held.py").write_text(HELD)
    (tmp_path / "hold").touch()
    launcher = psgd_run(tmp_path, "--run-dir", "run", "--workers", "2", "--shards", "1", "--epochs", "1", "held.py")
    metrics = [tmp_path / "run" / f"worker-{r}.jsonl" for r in (0, 1)]
    err = sigterm_once(
        launcher, lambda: all((tmp_path / f"at-2-{r}").exists() for r in (0, 1)), "step 2 reached by both workers"
    )
    assert launcher.returncode == 128 + signal.SIGTERM, err
    stopped = [json.loads(p.read_text().splitlines()[-1])["clock"] for p in metrics]
    assert stopped == [3, 2], stopped
    (tmp_path / "hold").unlink()
    again = psgd_run(tmp_path, "--resume", "run", "held.py")
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    assert_each_step_once(metrics, stopped, 22)


@pytest.mark.slow
def test_the_data_pages_augmentation_runs_by_name_in_a_launchs_workers(tmp_path):
    page = (ROOT / "docs" / "howto" / "your-data.md").read_text(encoding="utf-8")
    (tmp_path / "augment.py").write_text(re.search(r"```python\n(# augment.py.*?)```", page, re.S).group(1))
    (command,) = re.findall(r"^psgd launch (--set train.augment=.*)$", page, flags=re.M)
    common = ["--epochs", "2", "--workers", "2", "--shards", "1", "--json"]
    losses = []
    for run, flags in (("shifted", command.split()), ("plain", [])):
        done = subprocess.run(
            [sys.executable, "-m", "psgd.cli.main", "launch", *flags, *common, "--run-dir", run],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        losses.append(json.loads(done.stdout.splitlines()[-1])["test_loss"])
    assert 'augment = "augment:shift"' in (tmp_path / "shifted" / "job.toml").read_text()
    assert losses[0] != losses[1]  # sync is deterministic: the workers' batches were shifted


STOPPED = """\
import psgd
try:
    psgd.launch(epochs=3000, run_dir="run", progress=False, timeout=120)
except KeyboardInterrupt as exc:
    print(type(exc).__name__, isinstance(exc, psgd.LaunchInterrupted), isinstance(exc, psgd.PsgdError))
    raise
"""


@pytest.mark.slow
def test_ctrl_c_under_psgd_launch_is_a_keyboard_interrupt_that_says_how_to_go_on(tmp_path):
    """Ctrl-C under psgd.launch ended in a long traceback of the launcher's own RuntimeError, which psgd did not
    export, and which said to go on with psgd launch --resume alone."""
    (tmp_path / "stopped.py").write_text(STOPPED)
    launcher = subprocess.Popen(
        [sys.executable, "stopped.py"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics = tmp_path / "run" / "worker-0.jsonl"
    try:
        wait_for(
            lambda: launcher.poll() is not None or (metrics.exists() and metrics.stat().st_size),
            60,
            "worker 0's first step",
        )
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
    assert out.split() == ["LaunchInterrupted", "True", "True"], (out, err[-3000:])
    assert launcher.returncode != 0 and err.count('  File "') <= 2, err  # the script's line and psgd.launch's
    last = err.strip().splitlines()[-1]
    assert (
        "stopped by SIGINT" in last
        and "continue with psgd.launch(..., run_dir='run', resume=True) from Python, or psgd launch --resume run"
        in last
    ), last
