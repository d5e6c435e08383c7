"""The command a stopped launch says continues its run: the whole command, typed again as it was (psgd run's
script with its own arguments, the flags the run folder does not keep), shell-quoted, with --resume RUN in place
of what the run folder keeps (the job file, the job's flags, the folder itself)."""

from __future__ import annotations

import shlex
import signal
from pathlib import Path

import pytest

import psgd.launcher
from psgd.cli import main as psgd_main
from psgd.launcher import LaunchInterrupted
from psgd.launcher.folder import resume_command, status_command
from psgd.wire.tls import NO_TLS, TLSFiles


def test_psgd_runs_line_keeps_the_scripts_own_arguments_shell_quoted():
    script = ["/home/me/own loop.py", "--warmup", "100", "--clip", "5.0", "--note", "it's"]
    line = resume_command(Path("runs/own-resume"), script)
    assert shlex.split(line) == ["psgd", "run", "--resume", "runs/own-resume", *script]
    assert line == shlex.join(["psgd", "run", "--resume", "runs/own-resume", *script])


def test_the_flags_a_run_folder_does_not_keep_are_said_again():
    line = resume_command(Path("runs/a b"), (), ["--timeout", "60.0", "--save", "w.npz"])
    assert shlex.split(line) == ["psgd", "launch", "--timeout", "60.0", "--save", "w.npz", "--resume", "runs/a b"]


def test_the_watch_command_parses_as_psgd_status_with_the_job_file_token_and_tls():
    run = Path("runs/a b")
    tls = TLSFiles(str(run / "tls/job.pem"), str(run / "tls/job.key"), str(run / "tls/ca.pem"))
    line = status_command(run, tls, token_kept=True)
    token = "PSGD_TOKEN=$(cat 'runs/a b/.token') "
    assert line.startswith(token), line
    argv = shlex.split(line[len(token) :])
    args = psgd_main.build_parser().parse_args(argv[1:])
    assert argv[0] == "psgd" and (args.command, args.config, args.tls_ca, args.tls_cert, args.tls_key) == (
        "status",
        "runs/a b/job.toml",
        "runs/a b/tls/ca.pem",
        "runs/a b/tls/job.pem",
        "runs/a b/tls/job.key",
    )
    # the user's own token (in $PSGD_TOKEN) and no TLS: the job file alone
    assert shlex.split(status_command(run, NO_TLS, token_kept=False)) == ["psgd", "status", "-c", "runs/a b/job.toml"]


@pytest.fixture
def launched(monkeypatch):
    """psgd.launcher.launch as the commands call it, stopped at once by SIGTERM: the keywords it was given."""
    given = {}

    def launch(config, **keys):
        given.update(keys)
        raise LaunchInterrupted(signal.SIGTERM, 0)

    monkeypatch.setattr(psgd.launcher, "launch", launch)
    return given


def test_psgd_run_hands_the_launcher_the_flags_to_say_again_and_the_scripts_arguments(tmp_path, monkeypatch, launched):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "own_loop.py").write_text("")
    status = psgd_main.main(
        [
            "run",
            "--epochs",
            "3",
            "--set",
            "train.batch_size=16",
            "--run-dir",
            "runs/x",
            "--timeout",
            "60",
            "--save",
            "my w.npz",
            "--no-tls",
            "-v",
            "-v",
            "own_loop.py",
            "--warmup",
            "100",
            "--clip",
            "5.0",
        ]
    )
    assert status == 128 + signal.SIGTERM
    assert launched["script"] == [str(tmp_path / "own_loop.py"), "--warmup", "100", "--clip", "5.0"]
    # the job's flags are in RUN/job.toml, the folder is --resume's: the rest is said again, in the parser's order
    assert launched["resume_flags"] == ["--save", "my w.npz", "--timeout", "60.0", "--no-tls", "-v", "-v"]


def test_psgd_launch_hands_the_launcher_its_own_flags_to_say_again(tmp_path, monkeypatch, launched):
    monkeypatch.chdir(tmp_path)
    psgd_main.main(["launch", "--workers", "3", "--no-progress", "--json", "--accept-lost-updates"])
    assert launched["resume_flags"] == ["--json", "--no-progress", "--accept-lost-updates"]

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "job.toml").write_text("")
    launched.clear()  # a resumed run stopped again: continued the same way
    psgd_main.main(["launch", "--resume", "run", "--timeout", "30"])
    assert launched["resume_flags"] == ["--timeout", "30.0"]
