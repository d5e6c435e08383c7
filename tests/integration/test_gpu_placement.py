"""Workers and all-reduce ranks on a machine with several GPUs, as torchrun places local ranks: worker r of
this node on GPU r mod G.  A fake CuPy 14 with 4 devices (tests/fake_cupy.py) stands in for the GPUs; the
shards are real ``psgd-server`` processes, the workers' command lines are the launcher's own, and each one
is started the way ``psgd-worker`` starts (its flags parsed, its job built) in a thread of its own."""

from __future__ import annotations

import logging
import re
import sys

import fake_cupy
import pytest
from helpers import run_threads

from psgd.cli import worker as psgd_worker
from psgd.cli.common import job_from_args
from psgd.config import JobConfig
from psgd.data import load_dataset
from psgd.job import build_job
from psgd.launcher import launch
from psgd.launcher.layout import Layout, place_on_gpus
from psgd.launcher.supervise import Children, LaunchError, LaunchInterrupted


@pytest.fixture
def four_gpus(monkeypatch):
    return fake_cupy.install(monkeypatch, fake_cupy.FakeCupy(devices=4))


@pytest.mark.parametrize(
    "device, workers, placed",
    [
        ("cuda", 4, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),
        ("cuda", 6, ["cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:0", "cuda:1"]),
        ("gpu", 2, ["cuda:0", "cuda:1"]),
        ("cuda:0,2", 4, ["cuda:0", "cuda:2", "cuda:0", "cuda:2"]),
        ("cuda:3", 2, ["cuda:3", "cuda:3"]),
        ("cpu", 3, ["cpu", "cpu", "cpu"]),
    ],
)
def test_worker_r_goes_to_gpu_r_mod_g(four_gpus, device, workers, placed):
    devices, said = place_on_gpus(device, list(range(workers)))
    assert list(devices.values()) == placed
    if device == "cpu":
        assert said == ""
        return
    assert said.startswith("workers on GPUs: 0 on " + placed[0]) and "4 visible" in said
    assert "shards on the CPU" in said
    assert ("share" in said) == (workers > len(set(placed)))


def test_the_workers_of_a_second_node_take_the_gpus_from_the_first(four_gpus):
    """Local ranks: node 1 of 2 runs workers 1, 3, 5 and puts them on its own GPUs 0, 1, 2."""
    ranks = Layout(nnodes=2, node_rank=1, hosts=("10.0.0.5", "10.0.0.6")).workers_here(6)
    assert place_on_gpus("cuda", ranks)[0] == {1: "cuda:0", 3: "cuda:1", 5: "cuda:2"}


@pytest.mark.parametrize(
    "device, words",
    [
        ("cuda:4", "cuda:4 was requested but this machine has 4 CUDA device(s)"),
        ("cuda:1,1", "names a GPU more than once"),
        ("cuda:0,9", "cuda:9 was requested"),
        ("tpu", "unknown device 'tpu'"),
    ],
)
def test_gpus_that_are_not_there_are_refused_before_anything_starts(four_gpus, device, words):
    with pytest.raises(LaunchError, match=f"--device {re.escape(device)}: .*{re.escape(words)}"):
        place_on_gpus(device, [0, 1])


def test_without_cupy_the_refusal_says_what_to_install(monkeypatch):
    from psgd.compute import backend

    monkeypatch.setattr(backend, "_cupy", None)
    monkeypatch.setattr(backend, "_import_error", ImportError("No module named 'cupy'"))
    with pytest.raises(LaunchError, match=r"--device cuda: .*pip install 'cupy-cuda12x\[ctk\]' nvidia-nccl-cu12"):
        place_on_gpus("cuda", [0])


def test_a_list_of_gpus_is_for_launch_only(four_gpus):
    from psgd.compute import backend

    with pytest.raises(backend.DeviceError, match="several GPUs, such as 'cuda:0,2', are for psgd launch"):
        backend.get_device("cuda:0,2")


@pytest.mark.parametrize("device, expected", [("cuda", [0, 1, 2, 3]), ("cuda:0,2", [0, 2, 0, 2])])
def test_launch_starts_each_worker_on_its_gpu_and_says_so(tmp_path, four_gpus, monkeypatch, caplog, device, expected):
    """``psgd launch --device cuda`` with 4 workers: each worker's command line names its own GPU, and that
    worker, started from it, makes its own GPU current; with 4 GPUs for 4 workers no two share one."""
    started: dict[int, list[str]] = {}
    real_start = Children.start

    def start(self, name, argv, log_path, show=False, env={}):
        if name.startswith("shard"):
            return real_start(self, name, argv, log_path, show, env)  # real shards: they never touch a GPU
        started[int(name.split()[1])] = argv
        if len(started) == 4:  # every worker's command line is in: stop the launch here
            raise LaunchInterrupted(15, len(self.procs))
        return None

    monkeypatch.setattr(Children, "start", start)
    job = JobConfig.from_dict(
        {"train": {"device": device, "epochs": 1, "batch_size": 8}, "cluster": {"workers": 4, "shards": 2}}
    )
    caplog.set_level(logging.INFO, logger="psgd")
    with pytest.raises(LaunchInterrupted):
        launch(job, run_dir=str(tmp_path), progress=False, timeout=120)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("workers on GPUs")]
    assert said == [
        "workers on GPUs: "
        + ", ".join(f"{r} on cuda:{g}" for r, g in enumerate(expected))
        + f" (4 visible{'' if len(set(expected)) == 4 else '; 4 workers share 2 GPU(s)'}; shards on "
        "the CPU)"
    ]
    assert "device = \"cuda:" + str(expected[0]) + "\"" in (tmp_path / "job.toml").read_text()

    dataset = load_dataset("digits", dtype="float32")

    def worker(argv):
        assert argv[:3] == [sys.executable, "-m", "psgd.cli.worker"]
        args = psgd_worker.build_parser().parse_args(argv[3:])
        job = job_from_args(args)
        build_job(job, dataset)  # what psgd-worker does first: its device current before anything is built
        return four_gpus.current()

    current = run_threads([lambda a=started[r]: worker(a) for r in range(4)], timeout=60)
    assert current == expected
    if device == "cuda":
        assert len(set(current)) == 4  # G >= N: no two workers share a GPU


def test_nccl_ranks_need_a_gpu_each(four_gpus, tmp_path):
    job = JobConfig.from_dict({"train": {"device": "cuda:0,1"}, "cluster": {"workers": 3}})
    with pytest.raises(LaunchError, match="NCCL needs a GPU of its own for each of its 3 ranks.*gives 2"):
        launch(job, mode="allreduce", backend="nccl", run_dir=str(tmp_path), progress=False)


@pytest.mark.parametrize(
    "device, verdict",
    [
        ("cpu", "ok GPU: train.device is cpu: no GPU needed"),
        ("cuda:0,2", "ok GPU: cuda:0,2: cuda:0, cuda:2 run(s) CuPy's kernels"),
        ("cuda:5", "FAIL GPU: train.device is cuda:5, but cuda:5 was requested but this machine has 4 CUDA device(s)"),
    ],
)
def test_doctor_lists_the_gpus_it_sees(four_gpus, monkeypatch, capsys, device, verdict):
    from psgd.cli.main import main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    code = main(["doctor", "--device", device, "--timeout", "1"])
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines() if "GPU:" in line]
    assert len(lines) == 1 and lines[0].startswith(verdict), lines
    assert lines[0].endswith(
        "4 GPU(s) seen (CUDA_VISIBLE_DEVICES=4,5,6,7): cuda:0 Fake GPU, 80.0 GiB; "
        "cuda:1 Fake GPU, 80.0 GiB; cuda:2 Fake GPU, 80.0 GiB; cuda:3 Fake GPU, 80.0 GiB"
    )
    assert code == 1  # no shard answers at the job's addresses
