"""A token anyone could guess is refused wherever a token enters: a flag, PSGD_TOKEN, a run folder's kept token,
psgd.join(); one line that says how to make one, exit status 2, and nothing started."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from psgd.cli import main as psgd_main
from psgd.cli import worker as psgd_worker

pytestmark = pytest.mark.usefixtures("keep_signal_handlers")  # psgd-worker's and psgd-server's main()

#: one a user may well type, one of a space, and the example deploy/psgd.env.example shows
WEAK = ["a", " ", "s3cret", "fifteen-chars-x", "replace-me-with-a-generated-token"]
HOW = "make one: python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"

SERVER = ["--workers", "1", "--shards", "1", "--bind", "127.0.0.1:0"]
WORKER = ["--rank", "0", "--workers", "1", "--shards", "1", "--servers", "127.0.0.1:1"]
ENTRIES = {
    "psgd-worker": (psgd_worker.main, WORKER),
    "psgd launch": (
        psgd_main.main,
        ["launch", "--workers", "1", "--shards", "1", "--epochs", "1", "--timeout", "60", "--no-progress"],
    ),
    "psgd status": (psgd_main.main, ["status", "127.0.0.1:1", "--timeout", "0.5"]),
    "psgd doctor": (psgd_main.main, ["doctor", "--shards", "1", "--servers", "127.0.0.1:1", "--timeout", "0.5"]),
    "psgd export": (psgd_main.main, ["export", "--servers", "127.0.0.1:1", "--timeout", "0.5", "out.npz"]),
}


def refused_in_one_line(capsys, source: str) -> None:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"token in {source}" in err and HOW in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "flag, env", [(["--token", "a"], {}), ([], {"PSGD_TOKEN": WEAK[-1]})], ids=["--token", "PSGD_TOKEN"]
)
def test_psgd_server_refuses_a_weak_token_before_it_serves(flag, env, tmp_path):
    """In a process of its own: a shard that took the token would serve until stopped."""
    environ = {**{k: v for k, v in os.environ.items() if k != "PSGD_TOKEN"}, **env}
    done = subprocess.run(
        [sys.executable, "-m", "psgd.cli.server", *SERVER, *flag],
        env=environ,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.startswith("psgd-server: error: the token in ") and HOW in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("token", WEAK, ids=repr)
@pytest.mark.parametrize("entry", ["psgd status"])
def test_a_weak_token_flag_is_refused(entry, token, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PSGD_TOKEN", raising=False)
    command, argv = ENTRIES[entry]
    assert command([*argv, "--token", token]) == 2
    refused_in_one_line(capsys, "--token")


@pytest.mark.parametrize("token", [WEAK[0], WEAK[-1]], ids=repr)
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_weak_psgd_token_is_refused_by_every_command(entry, token, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PSGD_TOKEN", token)
    command, argv = ENTRIES[entry]
    if entry == "psgd launch":
        argv = [*argv, "--run-dir", str(tmp_path / "run")]
    assert command(argv) == 2
    refused_in_one_line(capsys, "PSGD_TOKEN")
    assert not (tmp_path / "run" / "shard-0.log").exists()  # nothing was started


def test_a_weak_token_kept_in_a_run_folder_is_refused(capsys, tmp_path, monkeypatch):
    """psgd launch --resume reads the token an earlier launch of the run folder kept there: one planted there is no
    better."""
    monkeypatch.delenv("PSGD_TOKEN", raising=False)
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.toml").write_text("[cluster]\nworkers = 1\nshards = 1\n")  # as an earlier launch left it
    (run / ".token").write_text("a\n")
    command, argv = ENTRIES["psgd launch"]
    assert command([*argv, "--resume", str(run)]) == 2
    refused_in_one_line(capsys, str(run / ".token"))


@pytest.mark.parametrize("token", WEAK, ids=repr)
def test_psgd_join_refuses_a_weak_token(token, tmp_path, capsys):
    """The script ends as argparse ends one given bad arguments: one line, exit status 2."""
    import psgd

    (tmp_path / "job.toml").write_text('[cluster]\nservers = ["127.0.0.1:1"]\nworkers = 1\nshards = 1\n')
    environ = {"PSGD_JOB_FILE": str(tmp_path / "job.toml"), "PSGD_RANK": "0", "PSGD_TOKEN": token}
    with pytest.raises(SystemExit) as ended:
        psgd.join(environ)
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "token in PSGD_TOKEN" in err, err


@pytest.mark.parametrize("token", ["", "0123456789abcdef", "replace-me-with-a-generated-token-not"])
def test_no_token_or_one_of_16_characters_or_more_passes(token, monkeypatch):
    """Whether a process may go without a token is its own to say (psgd-server asks for --no-token)."""
    from psgd.wire.channel import read_token

    monkeypatch.setenv("PSGD_TOKEN", token)
    assert read_token() == token and read_token(token) == token
