"""A launch's own TLS: on one node its shards serve mutual TLS with a CA made for the job (RUN/tls), unless told
--no-tls; several nodes without certificates stay plaintext, said in one WARNING line."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import threading

import pytest
from helpers import make_job

from psgd.cli import main as psgd_main
from psgd.launcher import launch
from psgd.ops.reach import Connect, try_status
from psgd.wire.tls import NO_TLS, TLSFiles

PSGD = shutil.which("psgd") or "psgd"


def _probe(run, seen: dict, caplog):
    """A launch monitor: the shards' Status read without TLS, and with the run's own files, as a user would; and
    the launch's hint for watching the shards, run in a shell as it is printed."""

    def monitor(addresses: list[str], stop: threading.Event, token: str, tls: TLSFiles) -> None:
        made = TLSFiles(str(run / "tls" / "job.pem"), str(run / "tls" / "job.key"), str(run / "tls" / "ca.pem"))
        seen["given"] = tls  # what the launch hands its monitor: the files of the job's own CA
        seen["plain"] = [try_status(a, Connect.using(NO_TLS, token, 3.0)) for a in addresses]
        seen["tls"] = [try_status(a, Connect.using(made, token, 3.0)) for a in addresses]
        hints = [m.group(1) for r in caplog.records if (m := re.search(r"to watch the shards[:,] (.*)$", r.message))]
        seen["hint"] = hints
        if hints:
            seen["watched"] = subprocess.run(
                ["bash", "-c", hints[-1]],
                capture_output=True,
                text=True,
                timeout=60,
                env={k: v for k, v in os.environ.items() if k != "PSGD_TOKEN"},
            )

    return monitor


@pytest.mark.slow
def test_a_launch_serves_mutual_tls_by_default(tmp_path, caplog, monkeypatch):
    """A default launch served plaintext: the token, keys, gradients and weights crossed loopback in the clear.
    Its hint for psgd status, pasted as printed, lacked the job file and the token."""
    caplog.set_level(logging.INFO, logger="psgd.launcher")
    monkeypatch.delenv("PSGD_TOKEN", raising=False)
    run, seen = tmp_path / "run", {}
    job = make_job("train.epochs=1", "cluster.workers=2", "cluster.shards=2")
    result = launch(job, run_dir=str(run), progress=False, timeout=240, monitor=_probe(run, seen, caplog))
    assert len(seen["hint"]) == 1, seen["hint"]
    token = f"PSGD_TOKEN=$(cat {run}/.token) "  # the token from where the launch keeps it
    assert seen["hint"][0].startswith(token), seen["hint"]
    argv = shlex.split(seen["hint"][0][len(token) :])
    assert argv[0] == "psgd", argv
    args = psgd_main.build_parser().parse_args(argv[1:])  # as psgd's own psgd status reads it
    assert (args.command, args.config, args.tls_ca, args.tls_cert, args.tls_key) == (
        "status",
        f"{run}/job.toml",
        f"{run}/tls/ca.pem",
        f"{run}/tls/job.pem",
        f"{run}/tls/job.key",
    )
    watched = seen["watched"]
    assert watched.returncode == 0 and "2 of 2 shard(s) answering" in watched.stdout, (
        watched.returncode,
        watched.stdout[-2000:],
        watched.stderr[-2000:],
    )
    assert result.test_accuracy > 0.8
    for status, why, code in seen["plain"]:  # a client without TLS gets no answer
        assert status is None and code == "UNAVAILABLE", why
    assert all(status is not None for status, _, _ in seen["tls"]), seen["tls"]
    assert seen["given"] == TLSFiles(*(str(run / "tls" / n) for n in ("job.pem", "job.key", "ca.pem")))
    for k in (0, 1):
        assert "(mutual TLS; policy sync" in (run / f"shard-{k}.log").read_text()
    for r in (0, 1):  # both workers trained to the end over it
        assert json.loads((run / f"worker-{r}.jsonl").read_text().splitlines()[-1])["event"] == "done"


@pytest.mark.slow
def test_no_tls_is_plaintext_and_a_resumed_launch_keeps_its_ca(tmp_path):
    run = tmp_path / "run"
    first = subprocess.run(
        [PSGD, "launch", "--epochs", "1", "--workers", "1", "--shards", "1", "--run-dir", str(run), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"TLS on (mutual; a CA made for this job, kept in {run}/tls)" in first.stderr
    assert (
        f"to watch the shards: PSGD_TOKEN=$(cat {run}/.token) psgd status -c {run}/job.toml --tls-ca "
        f"{run}/tls/ca.pem" in first.stderr
    )
    ca = (run / "tls" / "ca.pem").read_bytes()
    again = subprocess.run(
        [PSGD, "launch", "--resume", str(run), "--epochs", "2", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert (run / "tls" / "ca.pem").read_bytes() == ca  # psgd status pointed at it still reaches the shards
    assert "(mutual TLS; policy sync" in (run / "shard-0.log").read_text()
    # the resumed launch says its threads as the first did (it read "(--threads)"), and its token's command
    threads = [
        re.search(r"BLAS/OpenMP thread\(s\) each (\(.*\))$", e, flags=re.M).group(1)
        for e in (first.stderr, again.stderr)
    ]
    assert threads == ["(--threads N or OMP_NUM_THREADS to change)", "(--threads N to change)"], threads
    assert "psgd launch --resume reads it" in again.stderr
    done = subprocess.run(
        [PSGD, "launch", "--resume", str(run), "--no-progress"], capture_output=True, text=True, timeout=240
    )  # a job that has ended: no step left, and no train loss to say
    assert done.returncode == 0, done.stderr[-3000:]
    last = [line for line in (run / "worker-0.log").read_text().splitlines() if re.search(r"step (\d+)/\1:", line)]
    assert last and "train loss" not in last[-1], last

    plain = tmp_path / "plain"
    off = subprocess.run(
        [
            PSGD,
            "launch",
            "--epochs",
            "1",
            "--workers",
            "1",
            "--shards",
            "1",
            "--run-dir",
            str(plain),
            "--no-progress",
            "--no-tls",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert off.returncode == 0, off.stderr[-3000:]
    assert "(plaintext; policy sync" in (plain / "shard-0.log").read_text()
    assert not (plain / "tls").exists() and "TLS on" not in off.stderr


def test_no_tls_with_certificates_is_one_line(tmp_path):
    done = subprocess.run(
        [PSGD, "launch", "--no-tls", "--tls-ca", "ca.pem", "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].endswith(
        "--no-tls with --tls-cert/--tls-key/--tls-ca: give one or the other"
    )
    assert "Traceback" not in done.stderr
