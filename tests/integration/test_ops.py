"""Operating a cluster: the Prometheus endpoint scraped during a run, ``psgd status`` and ``psgd doctor``.

Shards run in this process (real gRPC and data ports on 127.0.0.1) and workers in threads, so nothing here
depends on how the command-line tools wire the metrics in.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import free_port, free_port_pair, make_ca, make_cert, make_job, run_threads, shards
from prometheus_client.parser import text_string_to_metric_families

from psgd.cli.main import main
from psgd.compute import backend
from psgd.config import to_toml
from psgd.job import describe_job
from psgd.observe.prometheus import MetricsError, ShardMetrics, WorkerMetrics, serve_metrics
from psgd.ops.reach import Connect
from psgd.ops.view import collect
from psgd.server import build_shard
from psgd.server.durable import recovery
from psgd.server.net.service import ShardServer
from psgd.worker.exchange import run_worker

SMALL = ("model.name=softmax", "cluster.workers=2", "cluster.shards=2")


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """``{sample name: {sorted label items: value}}`` from a Prometheus text endpoint."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for key, v in samples.get(name, {}).items() if all((k, labels[k]) in key for k in labels))


@contextlib.contextmanager
def observed_shards(job):
    """Every shard of ``job`` on 127.0.0.1 with its metrics endpoint; yields (the job with its servers filled in,
    servers, metrics)."""
    servers, metrics = [], []
    try:
        for k in range(job.cluster.shards):
            core = build_shard(describe_job(job), k)
            m = ShardMetrics(core)
            servers.append(
                ShardServer(
                    core, "127.0.0.1:0", transport=job.cluster.links.transport, interceptors=m.interceptors
                ).start()
            )
            m.endpoint = serve_metrics("127.0.0.1:0", m.registry)
            metrics.append(m)
        yield job.override("cluster.servers", [s.address for s in servers]), servers, metrics
    finally:
        for m in metrics:
            m.stop()
        for s in servers:
            s.stop(grace=1.0)


@pytest.mark.parametrize(
    "transport", [pytest.param("shm", marks=pytest.mark.slow), "tcp", pytest.param("grpc", marks=pytest.mark.slow)]
)
def test_metrics_endpoint_is_scraped_during_a_run_counters_move_and_staleness_fills(transport):
    job = make_job(*SMALL, "train.epochs=3", "cluster.policy=async", f"cluster.transport={transport}")
    with observed_shards(job) as (job, servers, metrics):
        worker = WorkerMetrics(0)
        worker.endpoint = serve_metrics("127.0.0.1:0", worker.registry)
        scrapes = {}

        def on_step(point):
            worker.on_step(point)
            if point["clock"] in (5, 30):  # scrape mid-run, from inside the run
                scrapes[point["clock"]] = (scrape(metrics[0].endpoint.url), scrape(worker.endpoint.url))

        try:
            run_threads(
                [
                    lambda: run_worker(job, 0, job.cluster.servers, progress=False, on_step=on_step),
                    lambda: run_worker(job, 1, job.cluster.servers, progress=False),
                ],
                timeout=60,
            )
            final = scrape(metrics[0].endpoint.url)
            final_worker = scrape(worker.endpoint.url)
        finally:
            worker.stop()
        status = servers[0].core.status()

    (early, early_w), (late, late_w) = scrapes[5], scrapes[30]
    for name in (
        "psgd_shard_pushes_total",
        "psgd_shard_pulls_total",
        "psgd_shard_received_bytes_total",
        "psgd_shard_sent_bytes_total",
        "psgd_shard_version",
    ):
        assert 0 < total(early, name) < total(late, name) <= total(final, name), name
    assert total(final, "psgd_shard_pushes_total") == status["counters"]["pushes"]
    served = ("psgd_shard_data_requests_total", "psgd_shard_data_request_cpu_seconds_total")
    for name in served:  # the data port's requests and the CPU time they took (none over gRPC alone)
        assert (transport == "grpc") == (total(final, name) == 0), name
    assert total(final, served[0]) == status["counters"]["data_requests"]
    assert total(final, "psgd_shard_copied_updates_total") == status["counters"]["copied_updates"]
    assert total(final, "psgd_shard_revoked_reads_total") == 0 and total(final, "psgd_shard_oldest_read_seconds") == 0
    assert total(final, "psgd_shard_push_outcomes_total", outcome="applied") == status["counters"]["applied"]
    # the staleness histogram: one observation per applied push, spread over the buckets
    assert 0 < total(early, "psgd_shard_staleness_count") < total(late, "psgd_shard_staleness_count")
    assert (
        total(final, "psgd_shard_staleness_count")
        == status["counters"]["applied"]
        == sum(status["staleness_histogram"])
    )
    assert total(final, "psgd_shard_staleness_bucket", le="+Inf") == status["counters"]["applied"]
    assert total(final, "psgd_shard_staleness_bucket", le="0.0") == status["staleness_histogram"][0]
    # workers, as the shard sees them: live while training (mid-run; under async worker 1, never slowed
    # by these scrapes, may have finished already, or, its thread started later, not have joined yet),
    # done at the end, and never expired
    assert total(late, "psgd_shard_live_workers") >= 1
    assert sum(total(late, "psgd_shard_workers", state=s) for s in ("pending", "live", "done")) == 2
    assert total(final, "psgd_shard_workers", state="done") == 2
    assert total(late, "psgd_shard_worker_clock", worker="0") >= 30
    # RPC latency from the interceptor, by method and code
    assert total(final, "psgd_shard_rpc_seconds_count", method="Register", code="OK") == 2
    assert total(final, "psgd_shard_rpc_seconds_count", method="Done", code="OK") == 2
    if transport == "grpc":
        assert (
            total(late, "psgd_shard_rpc_seconds_count", method="Push", code="OK")
            > total(early, "psgd_shard_rpc_seconds_count", method="Push", code="OK")
            > 0
        )
        assert total(final, "psgd_shard_rpc_seconds_count", method="Pull") > 0
    # the worker's own endpoint
    assert total(early_w, "psgd_worker_steps_total") == 6 and total(late_w, "psgd_worker_steps_total") == 31
    assert total(late_w, "psgd_worker_clock") == 31
    assert total(final_worker, "psgd_worker_pulls_total") == 2 * total(final_worker, "psgd_worker_steps_total")
    assert total(final_worker, "psgd_worker_pushes_total", outcome="applied") == 2 * total(
        final_worker, "psgd_worker_steps_total"
    )
    assert total(final_worker, "psgd_worker_staleness_count") == total(final_worker, "psgd_worker_steps_total")
    assert total(late_w, "psgd_worker_pull_seconds_count") == 31 and total(late_w, "psgd_worker_bytes_total") > 0
    assert total(final_worker, "psgd_worker_info", rank="0") == 1


def test_checkpoint_age_and_metrics_flags(tmp_path):
    import argparse

    from psgd.observe.prometheus import add_metrics_arguments

    job = make_job(*SMALL)
    core = build_shard(describe_job(job), 0)
    parser = argparse.ArgumentParser()
    add_metrics_arguments(parser)
    # without --metrics-port: nothing is served and nothing needs stopping
    quiet = ShardMetrics.from_args(core, parser.parse_args([]))
    assert list(quiet.interceptors) == [] and quiet.start().endpoint is None
    with WorkerMetrics.from_args(parser.parse_args([]), 0) as w:
        w.on_step({"clock": 0})
    with pytest.raises(MetricsError, match="PORT or HOST:PORT"):
        ShardMetrics.from_args(core, parser.parse_args(["--metrics-port", "nine"]))
    # with it: the endpoint with the process metrics, and the checkpoint age once there is a checkpoint
    metrics = ShardMetrics.from_args(core, parser.parse_args(["--metrics-port", "127.0.0.1:0"])).start()
    try:
        first = scrape(metrics.endpoint.url)
        assert "psgd_shard_checkpoint_age_seconds" not in first  # no checkpoint yet
        assert "process_cpu_seconds_total" in first or "python_info" in first
        recovery.write(core, tmp_path, force=True)
        then = scrape(metrics.endpoint.url)
        assert 0 <= total(then, "psgd_shard_checkpoint_age_seconds") < 30
        assert total(then, "psgd_shard_checkpoint_version") == 0
    finally:
        metrics.stop()
    with pytest.raises(MetricsError, match="cannot serve metrics on 127.0.0.1"):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            ShardMetrics.from_args(core, parser.parse_args(["--metrics-port", str(taken.getsockname()[1])])).start()


# -- psgd status ---------------------------------------------------------------------------------
def test_status_shows_every_worker_and_shard_of_a_running_cluster(capsys, tmp_path):
    job = make_job(*SMALL, "train.epochs=4", "cluster.policy=sync")
    seen = {}
    with shards(job) as (job, servers):
        addresses = job.cluster.servers

        def on_step(point):
            if point["clock"] == 20:  # while both workers are live
                view = collect(addresses, Connect(timeout=2))
                seen["view"], seen["text"] = view, view.render()

        run_threads(
            [
                lambda: run_worker(job, 0, addresses, progress=False, on_step=on_step),
                lambda: run_worker(job, 1, addresses, progress=False),
            ],
            timeout=60,
        )
        recovery.write(servers[1].core, tmp_path, force=True)
        code = main(["status", *addresses, "--sample", "0"])
        after = capsys.readouterr().out
        code_json = main(["status", *addresses, "--json", "--watch", "0.05", "--count", "2"])
        polls = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        versions = [s.core.version for s in servers]

    view, text = seen["view"], seen["text"]
    assert view.healthy() and not view.problems()
    assert [r["state"] for r in view.worker_rows()] == ["live", "live"]
    clocks = [r["clock"] for r in view.worker_rows()]
    assert clocks[0] == 21 and clocks[1] in (21, 22)  # worker 0 has pushed clock 20; worker 1 is at most a round on
    for address in addresses:
        assert address in text
    lines = text.splitlines()
    assert lines[0].startswith("psgd status at ") and "2 of 2 shard(s) answering, policy sync" in lines[0]
    assert "2 live" in "\n".join(lines[:2])
    assert any(line.startswith("0/2 ") and "SERVING" in line for line in lines)
    assert any(line.startswith("1/2 ") and "SERVING" in line for line in lines)
    worker_lines = [line for line in lines if line.split()[:2] in (["0", "live"], ["1", "live"])]
    assert len(worker_lines) == 2 and all(socket.gethostname() in line for line in worker_lines)

    assert code == 0
    for address in addresses:
        assert address in after
    rows: dict[str, str] = {}  # a shard's cells, from every block of columns (80 wide: the table wraps)
    for line in after.splitlines():
        if line[:4] in ("0/2 ", "1/2 "):
            rows[line.split()[0]] = rows.get(line.split()[0], "") + line
    assert max(map(len, after.splitlines())) <= 80
    assert f"v{versions[1]}, 0s ago" in rows["1/2"] and ", 0s ago" not in rows["0/2"]
    done = [line.split() for line in after.splitlines() if line.split()[:2] in (["0", "done"], ["1", "done"])]
    assert len(done) == 2 and all(row[2] == str(4 * (1438 // 2 // 32)) for row in done)
    assert code_json == 0 and len(polls) == 2
    assert [s["version"] for s in polls[1]["shards"]] == versions
    assert all(s["pushes_per_second"] == 0 for s in polls[1]["shards"])  # finished: nothing moves
    assert all("pushes_per_second" not in s for s in polls[0]["shards"])
    assert [w["state"] for w in polls[1]["workers"]] == ["done", "done"]


def test_status_says_plainly_when_an_address_does_not_answer(capsys):
    job = make_job("model.name=softmax", "cluster.workers=1", "cluster.shards=1")
    closed = free_port()
    with shards(job) as (job, _):
        start = time.monotonic()
        code = main(["status", job.cluster.servers[0], f"127.0.0.1:{closed}", "--sample", "0", "--timeout", "2"])
        took = time.monotonic() - start
    out = capsys.readouterr().out
    assert code == 1 and took < 10
    assert f"nothing listens at 127.0.0.1:{closed} (connection refused)" in out
    assert "UNREACHABLE" in out and "SERVING" in out and "1 of 2 shard(s) answering" in out
    assert main(["status", "not-an-address"]) == 2
    assert "is not an address" in capsys.readouterr().err


def test_status_command_line_with_a_job_file(tmp_path):
    job = make_job("model.name=softmax", "cluster.workers=1", "cluster.shards=2")
    with shards(job) as (job, _):
        path = tmp_path / "job.toml"
        path.write_text(to_toml(job.to_dict()))
        done = subprocess.run(
            [sys.executable, "-m", "psgd.cli.main", "status", "-c", str(path), "--sample", "0.2"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 0, done.stderr
    assert "2 of 2 shard(s) answering" in done.stdout and "pending" in done.stdout
    assert "Traceback" not in done.stderr


# -- psgd doctor ---------------------------------------------------------------------------------
@contextlib.contextmanager
def cli_layout_shards(job, transport: str = "auto"):
    """Every shard of ``job`` with a data port named for it: gRPC on a port P, the data port on P + 1; yields the job
    with its servers filled in, and the shards."""
    servers = []
    try:
        for k in range(job.cluster.shards):
            port = free_port_pair()  # gRPC on P, data on P + 1 (psgd-server --data-port)
            servers.append(
                ShardServer(
                    build_shard(describe_job(job), k), f"127.0.0.1:{port}", transport=transport, data_port=port + 1
                ).start()
            )
        yield job.override("cluster.servers", [s.address for s in servers]), servers
    finally:
        for s in servers:
            s.stop(grace=1.0)


def write_job(tmp_path: Path, job, servers=None) -> str:
    spec = job.to_dict()
    if servers is not None:
        spec["cluster"]["servers"] = servers
    path = tmp_path / "job.toml"
    path.write_text(to_toml(spec))
    return str(path)


def test_doctor_passes_a_healthy_cluster(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PSGD_TOKEN", raising=False)
    job = make_job(*SMALL)
    with cli_layout_shards(job) as (job, _):
        code = main(["doctor", "-c", write_job(tmp_path, job)])
        out = capsys.readouterr().out
        assert main(["doctor", "--health", job.cluster.servers[1]]) == 0
        assert capsys.readouterr().out.strip() == f"{job.cluster.servers[1]}: SERVING"
        monkeypatch.setenv("PSGD_HEALTH_ADDRESS", job.cluster.servers[0])
        assert main(["doctor", "--health"]) == 0
    assert code == 0, out
    assert "FAIL" not in out and out.rstrip().endswith("warning(s)).")
    for k, address in enumerate(job.cluster.servers):
        assert f"shard {k} at {address}: gRPC port" in out and f"shard {k} at {address}: data port" in out
        assert f"shard {k} at {address}: health check: SERVING" in out
        assert f"shard {k} at {address}: answers as shard {k} of 2, policy sync" in out
        assert "same partition plan" in out
    assert "resolves to 127.0.0.1 (loopback: a job on this machine)" in out  # the pages' one-machine job: no warning
    assert not [line for line in out.splitlines() if line.split()[:2] == ["warn", "shard"]], out
    assert "token: none set" in out and "GPU: train.device is cpu" in out


def test_doctor_warns_of_a_shard_on_loopback_beside_shards_elsewhere():
    from psgd.ops.checks import Doctor

    job = make_job(*SMALL)
    job = job.override("cluster.servers", ["127.0.0.1:1", "192.0.2.1:2"])  # 192.0.2.0/24: documentation, unreachable
    found, _ = Doctor(job, Connect(timeout=0.5)).check_shard(0, "127.0.0.1:1", None)
    assert found[0].level == "warn" and "other shards are elsewhere" in found[0].message


@pytest.mark.parametrize(
    "sets, said",
    [
        (("cluster.policy=async", "cluster.checkpoint_rounds=4"), "which only a sync policy has (this job's: async)"),
        (("cluster.checkpoint_rounds=4", "cluster.backup_workers=1"), "closes rounds without some: use one of them"),
    ],
)
def test_doctor_refuses_what_a_starting_shard_would(tmp_path, capsys, sets, said):
    """The rules across [cluster] keys live in the job file's validation (psgd.config), which psgd doctor, every
    command and a starting shard share: doctor used to pass a job whose shards would refuse to start."""
    path = tmp_path / "job.toml"
    spec = make_job("model.name=softmax", "cluster.workers=2").to_dict()
    for item in sets:
        dotted, _, value = item.partition("=")
        section, key = dotted.split(".")
        spec[section][key] = value if not value.isdigit() else int(value)
    path.write_text(to_toml(spec))
    assert main(["doctor", "-c", str(path), "--timeout", "1"]) == 2
    err = capsys.readouterr().err
    assert said in err and str(path) in err and len(err.strip().splitlines()) == 1, err


def test_doctor_names_each_problem_in_plain_words(tmp_path, capsys):
    job = make_job(*SMALL)
    other = make_job("model.name=mlp", "cluster.workers=3", "cluster.shards=2", "cluster.policy=async")
    closed = free_port()
    with shards(other) as (other, running):
        servers = [running[1].address, running[0].address]  # shard order swapped
        path = write_job(tmp_path, job, servers)
        start = time.monotonic()
        code = main(["doctor", "-c", path, "--timeout", "2"])
        out = capsys.readouterr().out
        took = time.monotonic() - start
    assert code == 1 and took < 20
    assert "it is shard 1, but the job file lists it as shard 0: [cluster] servers must be in shard order" in out
    assert "its policy is async, the job file's is sync" in out
    assert "it expects 3 worker(s), the job file has 2" in out
    assert "this job file makes" in out and "started from another model" in out
    assert out.rstrip().endswith("fix the FAIL lines above.")

    path = write_job(tmp_path, job, ["no-such-host.invalid:50051", f"127.0.0.1:{closed}"])
    code = main(
        [
            "doctor",
            "-c",
            path,
            "--timeout",
            "2",
            "--device",
            "cuda:7",
            "--tls-cert",
            str(tmp_path / "no.pem"),
            "--tls-key",
            str(tmp_path / "job.toml"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "shard 0 at no-such-host.invalid:50051: cannot resolve 'no-such-host.invalid'" in out
    assert (
        f"shard 1 at 127.0.0.1:{closed}: gRPC port {closed}: nothing listens on 127.0.0.1:{closed} "
        "(connection refused)" in out
    )
    assert f"TLS: certificate {tmp_path / 'no.pem'} does not exist" in out
    if not backend.cuda_available():
        assert "GPU: train.device is cuda:7, but" in out
    assert (
        main(["doctor", "-c", write_job(tmp_path, job, ["0.0.0.0:50051", "127.0.0.1:1"]), "--timeout", "1", "--json"])
        == 1
    )
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert any("is a bind address, not one to connect to" in f["message"] for f in report["findings"])

    assert main(["doctor", "--health", f"127.0.0.1:{closed}", "--timeout", "1"]) == 1
    assert "UNREACHABLE" in capsys.readouterr().out


def test_doctor_data_port_closed(tmp_path, capsys):
    job = make_job("model.name=softmax", "cluster.workers=1", "cluster.shards=1")
    with cli_layout_shards(job, transport="grpc") as (job, _):  # the job wants a data port, the shard serves none
        code = main(["doctor", "-c", write_job(tmp_path, job), "--timeout", "2"])
    out = capsys.readouterr().out
    assert code == 1
    assert "data port: the shard serves none" in out and 'transport = "grpc"' in out


def test_doctor_and_status_report_a_refused_token(tmp_path, capsys, monkeypatch):
    job = make_job("model.name=softmax", "cluster.workers=1", "cluster.shards=1", "cluster.transport=grpc")
    server = ShardServer(
        build_shard(describe_job(job), 0), "127.0.0.1:0", token="s3cret-of-this-job", transport="grpc"
    ).start()
    try:
        path = write_job(tmp_path, job, [server.address])
        monkeypatch.setenv("PSGD_TOKEN", "wrong-but-long-enough")
        assert main(["doctor", "-c", path]) == 1
        out = capsys.readouterr().out
        assert "refused the token (UNAUTHENTICATED): set PSGD_TOKEN or --token" in out
        assert main(["status", server.address, "--sample", "0"]) == 1
        assert "refused the token" in capsys.readouterr().out
        assert main(["doctor", "-c", path, "--token", "s3cret-of-this-job"]) == 0
        assert "token: accepted by every shard" in capsys.readouterr().out
    finally:
        server.stop(grace=1.0)


@pytest.mark.lacks(shutil.which("openssl") is None, reason="openssl is not installed")
def test_doctor_and_status_with_tls(tmp_path, capsys):
    from psgd.wire.tls import TLSFiles

    make_ca(tmp_path, "ca")
    make_cert(tmp_path, "shard", "ca", "IP:127.0.0.1")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    ca, cert, key = (str(tmp_path / name) for name in ("ca.pem", "shard.pem", "shard.key"))

    job = make_job("model.name=softmax", "cluster.workers=1", "cluster.shards=1", "cluster.transport=grpc")
    server = ShardServer(
        build_shard(describe_job(job), 0), "127.0.0.1:0", transport="grpc", tls=TLSFiles(cert, key)
    ).start()
    try:
        path = write_job(tmp_path, job, [server.address])
        assert main(["doctor", "-c", path, "--tls-ca", ca]) == 0
        out = capsys.readouterr().out
        assert f"TLS: files parse: CA {ca}" in out and "health check: SERVING" in out
        assert main(["status", server.address, "--sample", "0", "--tls-ca", ca]) == 0
        assert "SERVING" in capsys.readouterr().out
        # plain text to a TLS shard: named, with the way out
        assert main(["status", server.address, "--sample", "0", "--timeout", "2"]) == 1
        assert "pass --tls-ca" in capsys.readouterr().out
        # files that do not parse, or are not there
        assert (
            main(["doctor", "-c", path, "--tls-ca", str(garbage), "--tls-cert", cert, "--tls-key", str(garbage)]) == 1
        )
        assert f"TLS: CA certificate {garbage} is not a PEM certificate" in capsys.readouterr().out
        assert main(["doctor", "-c", path, "--tls-ca", ca, "--tls-cert", cert, "--tls-key", str(garbage)]) == 1
        assert "do not load together" in capsys.readouterr().out
        assert main(["status", server.address, "--tls-ca", str(tmp_path / "missing.pem")]) == 2
        assert f"--tls-ca {tmp_path / 'missing.pem'}: No such file or directory" in capsys.readouterr().err
    finally:
        server.stop(grace=1.0)
