"""TLS and mutual TLS on both transports, with certificates made here by openssl (as README shows)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from helpers import make_ca, make_cert, make_job

from psgd.config import Deadlines
from psgd.job import build_job, describe_job
from psgd.partition import PartitionPlan
from psgd.server import build_shard
from psgd.server.net.service import ShardServer
from psgd.wire.tls import TLSFiles
from psgd.worker.client import PSClient, PSError
from psgd.worker.exchange import run_worker

pytestmark = pytest.mark.lacks(shutil.which("openssl") is None, reason="openssl is not installed")


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    make_ca(d, "ca")
    make_cert(d, "shard", "ca", "IP:127.0.0.1,DNS:localhost")
    make_cert(d, "worker", "ca", "DNS:worker")
    make_ca(d, "stranger-ca")
    make_cert(d, "stranger", "stranger-ca", "DNS:worker")
    return d


def files(d: Path, cert: str | None = None, ca: str | None = None) -> TLSFiles:
    return TLSFiles(
        str(d / f"{cert}.pem") if cert else None,
        str(d / f"{cert}.key") if cert else None,
        str(d / f"{ca}.pem") if ca else None,
    )


def serve(job, tls: TLSFiles) -> ShardServer:
    return ShardServer(build_shard(describe_job(job), 0), "127.0.0.1:0", tls=tls).start()


def job():
    return make_job(
        "model.name=softmax",
        "cluster.workers=1",
        "cluster.shards=1",
        "train.epochs=1",
        "cluster.policy=async",
        "cluster.request_timeout=3",
        "cluster.join_timeout=3",
    )


def plan_of(j):
    return PartitionPlan(build_job(j).model.specs(), 1, j.cluster.links.slice_bytes)


@pytest.mark.parametrize("mutual", [False, True])
def test_training_over_tls_and_mutual_tls(certs, mutual):
    j = job()
    server = serve(j, files(certs, "shard", "ca" if mutual else None))
    try:
        client_tls = files(certs, "worker" if mutual else None, "ca")
        result = run_worker(j, 0, [server.address], progress=False, tls=client_tls)
        assert result.steps > 0 and server.core.version == result.steps  # every push went through
    finally:
        server.stop(1)


@pytest.mark.slow
def test_a_certificate_from_an_unknown_ca_is_refused(certs):
    j = job()
    server = serve(j, files(certs, "shard", "ca"))
    try:
        before = server.core.flat.copy()
        for client_tls in (
            files(certs, "stranger", "ca"),  # client cert from another CA
            files(certs, None, "ca"),  # no client cert at all
            files(certs, "worker", "stranger-ca"),
        ):  # does not trust the shard's CA
            with PSClient(
                [server.address], plan_of(j), 0, deadlines=Deadlines(request_timeout=0.5), tls=client_tls, config=j
            ) as client:
                with pytest.raises(PSError, match="UNAVAILABLE"):
                    client.register()
        with PSClient(
            [server.address], plan_of(j), 0, deadlines=Deadlines(request_timeout=0.5), config=j
        ) as plain:  # no TLS at all
            with pytest.raises(PSError):
                plain.register()
        assert np.array_equal(server.core.flat, before) and server.core.version == 0
    finally:
        server.stop(1)


def test_the_data_path_refuses_a_plaintext_or_untrusted_client(certs):
    from psgd.link import LinkError
    from psgd.link.tcp import DataConnection
    from psgd.wire.protocol import WireError

    j = job()
    server = serve(j, files(certs, "shard", "ca"))
    try:
        port, plan_hash = server.data.port, server.core.plan.hash
        with pytest.raises((WireError, LinkError)):
            DataConnection("127.0.0.1", port, 0, plan_hash, timeout=3)  # plaintext hello to a TLS port
        # TLS 1.3: a client learns that its certificate was refused at its first read, not in the handshake
        with pytest.raises((WireError, LinkError), match="(?i)unknown ca|certificate|handshake|EOF|reset"):
            DataConnection("127.0.0.1", port, 0, plan_hash, timeout=3, tls=files(certs, "stranger", "ca"))
        with pytest.raises(LinkError, match="TLS handshake"):  # the worker does not trust the shard
            DataConnection("127.0.0.1", port, 0, plan_hash, timeout=3, tls=files(certs, "worker", "stranger-ca"))
        ok = DataConnection("127.0.0.1", port, 0, plan_hash, timeout=3, tls=files(certs, "worker", "ca"))
        ok.close()
    finally:
        server.stop(1)


@pytest.mark.slow
def test_launch_runs_a_whole_job_over_mutual_tls(certs, tmp_path):
    """psgd launch knew no --tls-*: a TLS job could not be launched with one command."""
    run = tmp_path / "run"
    done = subprocess.run(
        [
            shutil.which("psgd") or "psgd",
            "launch",
            "--epochs",
            "2",
            "--workers",
            "2",
            "--shards",
            "2",
            "--run-dir",
            str(run),
            "--no-progress",
            "--json",
            "--tls-cert",
            str(certs / "shard.pem"),
            "--tls-key",
            str(certs / "shard.key"),
            "--tls-ca",
            str(certs / "ca.pem"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["test_accuracy"] > 0.8
    for k in (0, 1):
        assert "mutual TLS; policy sync" in (run / f"shard-{k}.log").read_text()
    for r in (0, 1):  # every worker trained to the end, over TLS (a plaintext client is refused)
        assert json.loads((run / f"worker-{r}.jsonl").read_text().splitlines()[-1])["event"] == "done"
    half = subprocess.run(
        [
            shutil.which("psgd") or "psgd",
            "launch",
            "--epochs",
            "1",
            "--tls-cert",
            str(certs / "shard.pem"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert half.returncode == 2 and "needs --tls-cert, --tls-key and --tls-ca together" in half.stderr


LOOP = """import psgd

with psgd.join() as w:
    while w.clock < w.steps and not w.stopping:
        params = w.pull()
        x, y = w.batch()
        loss, grads = w.model.loss_and_grads(params, x, y)
        w.push(grads, loss=loss)
"""


def test_psgd_run_runs_its_scripts_over_mutual_tls(certs, tmp_path):
    """psgd run refused TLS: a script's worker could not join a job whose shards demand client certificates."""
    (tmp_path / "loop.py").write_text(LOOP)
    done = subprocess.run(
        [
            shutil.which("psgd") or "psgd",
            "run",
            "--epochs",
            "1",
            "--workers",
            "2",
            "--shards",
            "1",
            "--run-dir",
            "run",
            "--json",
            "--tls-cert",
            str(certs / "shard.pem"),
            "--tls-key",
            str(certs / "shard.key"),
            "--tls-ca",
            str(certs / "ca.pem"),
            "loop.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1])["test_accuracy"] > 0.5
    assert "mutual TLS; policy sync" in (tmp_path / "run" / "shard-0.log").read_text()
    for r in (0, 1):  # each script's worker trained to the end, over mutual TLS
        assert json.loads((tmp_path / "run" / f"worker-{r}.jsonl").read_text().splitlines()[-1])["event"] == "done"


@pytest.mark.slow
def test_launch_takes_tls_from_the_job_file(certs, tmp_path):
    """The certificate, key and CA may live in the job file's [tls] table (paths from the job file's folder):
    every process of the launch uses them, as with the flags."""
    job = tmp_path / "job.toml"
    rel = os.path.relpath(certs, tmp_path)
    job.write_text(f'[tls]\ncert = "{rel}/shard.pem"\nkey = "{rel}/shard.key"\nca = "{rel}/ca.pem"\n')
    run = tmp_path / "run"
    done = subprocess.run(
        [
            shutil.which("psgd") or "psgd",
            "launch",
            "-c",
            str(job),
            "--epochs",
            "1",
            "--workers",
            "2",
            "--shards",
            "1",
            "--run-dir",
            str(run),
            "--no-progress",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mutual TLS; policy sync" in (run / "shard-0.log").read_text()
    for r in (0, 1):
        assert json.loads((run / f"worker-{r}.jsonl").read_text().splitlines()[-1])["event"] == "done"
    job.write_text(f'[tls]\ncert = "{rel}/shard.pem"\n')
    half = subprocess.run(
        [shutil.which("psgd") or "psgd", "launch", "-c", str(job), "--epochs", "1", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert half.returncode == 2 and "[tls] needs cert, key and ca together" in half.stderr
