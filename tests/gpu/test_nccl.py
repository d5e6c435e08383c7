"""The nccl backend on a real GPU: one rank (world size 1) on cuda:0, through CuPy's NCCL bindings.

With one rank every reduction returns its input, so these tests check the
plumbing (pointers, counts, dtypes, streams, the watchdog) against real NCCL.
CuPy is reached only through ``psgd.compute.backend``.
"""

from __future__ import annotations

import numpy as np
import pytest

from psgd.collective.base import Bucketer, CollectiveError
from psgd.compute import backend


@pytest.fixture
def gpu():
    return backend.get_device("cuda:0")


@pytest.fixture
def group(gpu, tmp_path):
    from psgd.collective.nccl import NcclCollective

    g = NcclCollective(0, 1, gpu, rendezvous=f"file:{tmp_path / 'nccl-id.json'}", timeout=60.0)
    yield g
    g.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_allreduce_of_one_rank_returns_the_input(group, gpu, dtype, op):
    xp = gpu.xp
    x = (xp.arange(1000, dtype=dtype) * 1.5 - 300.0).reshape(10, 100)
    expected = backend.to_host(x).copy()
    assert group.allreduce_(x, op=op) is x
    np.testing.assert_array_equal(backend.to_host(x), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.int64])
def test_allreduce_of_the_other_supported_dtypes(group, gpu, dtype):
    x = gpu.xp.arange(17, dtype=dtype)
    group.allreduce_(x, op="sum")
    np.testing.assert_array_equal(backend.to_host(x), np.arange(17, dtype=dtype))


@pytest.mark.gpu
def test_a_large_allreduce(group, gpu):
    x = gpu.xp.full(16 << 20, 0.25, dtype=np.float32)  # 64 MiB
    group.allreduce_(x)
    assert float(x.min()) == float(x.max()) == 0.25


@pytest.mark.gpu
def test_allreduce_on_a_non_default_stream(group, gpu):
    xp = gpu.xp
    stream = xp.cuda.Stream(non_blocking=True)
    with stream:
        x = xp.arange(4096, dtype=np.float32)
        group.allreduce_(x, op="max")
        assert stream.done  # the watchdog waited for this stream, not the default one
    np.testing.assert_array_equal(backend.to_host(x), np.arange(4096, dtype=np.float32))


@pytest.mark.gpu
def test_broadcast_and_barrier(group, gpu):
    x = gpu.xp.arange(12, dtype=np.float32)
    assert group.broadcast_(x, root=0) is x
    np.testing.assert_array_equal(backend.to_host(x), np.arange(12, dtype=np.float32))
    group.barrier()
    group.barrier()
    with pytest.raises(CollectiveError, match="root must be in 0..0"):
        group.broadcast_(x, root=1)


@pytest.mark.gpu
def test_host_arrays_and_unsupported_dtypes_are_refused(group, gpu):
    with pytest.raises(CollectiveError, match="needs device \\(CuPy\\) arrays"):
        group.allreduce_(np.zeros(3, dtype=np.float32))
    with pytest.raises(CollectiveError, match="cannot reduce uint8"):
        group.allreduce_(gpu.xp.zeros(3, dtype=np.uint8))
    with pytest.raises(CollectiveError, match="cannot reduce bool"):
        group.broadcast_(gpu.xp.zeros(3, dtype=bool))
    with pytest.raises(CollectiveError, match="contiguous"):
        group.allreduce_(gpu.xp.zeros((4, 4), dtype=np.float32)[:, 1])
    group.barrier()  # refusals leave the communicator usable


@pytest.mark.gpu
def test_remembered_checks_reduce_several_shapes_and_dtypes_in_a_row(group, gpu, rng):
    """After its first call, an all-reduce skips the checks of its (type, dtype, op): calls that alternate
    shapes, dtypes and reductions, three rounds over, each still passes the right pointer, count and type."""
    xp = gpu.xp
    cases = [
        ((1000,), np.float32, "sum"),
        ((10, 100), np.float32, "max"),
        ((7,), np.float64, "min"),
        ((3, 5, 2), np.int32, "sum"),
        ((1 << 20,), np.float16, "sum"),
        ((33,), np.int64, "max"),
        ((4 << 20,), np.float32, "sum"),
        ((1,), np.float64, "sum"),
    ]
    for _ in range(3):
        for shape, dtype, op in cases:
            host = (rng.standard_normal(shape) * 100).astype(dtype)
            x = xp.asarray(host) * 1  # a kernel writes it just before: the call waits for it on the stream
            assert group.allreduce_(x, op=op) is x
            np.testing.assert_array_equal(backend.to_host(x), host)


@pytest.mark.gpu
def test_a_call_after_a_remembered_one_is_still_checked(group, gpu):
    """The same type, dtype and op as a call already made, but a strided view: refused every time; so are a
    host array and a dtype NCCL cannot reduce, between accepted calls, and the communicator stays usable."""
    xp = gpu.xp
    good = xp.arange(16, dtype=np.float32).reshape(4, 4)
    for _ in range(3):
        assert group.allreduce_(good) is good
        with pytest.raises(CollectiveError, match="contiguous"):
            group.allreduce_(good[:, 1])
        with pytest.raises(CollectiveError, match="contiguous"):
            group.allreduce_(good.T)
        with pytest.raises(CollectiveError, match="needs device \\(CuPy\\) arrays"):
            group.allreduce_(np.zeros(3, dtype=np.float32))
        with pytest.raises(CollectiveError, match="cannot reduce uint8"):
            group.allreduce_(xp.zeros(3, dtype=np.uint8))
        with pytest.raises(CollectiveError, match="unknown reduction"):
            group.allreduce_(good, op="prod")
    if xp.cuda.runtime.getDeviceCount() > 1:
        with xp.cuda.Device(1):
            elsewhere = xp.zeros(16, dtype=np.float32)
        for _ in range(2):
            with pytest.raises(CollectiveError, match="on cuda:1"):
                group.allreduce_(elsewhere)
    np.testing.assert_array_equal(backend.to_host(good), np.arange(16, dtype=np.float32).reshape(4, 4))
    group.barrier()


@pytest.mark.gpu
def test_an_allreduce_behind_queued_work_is_waited_for(group, gpu):
    """Work queued ahead keeps the stream busy at the call's first query: the watchdog's wait takes over and
    returns once the stream has finished."""
    xp = gpu.xp
    a = xp.ones((2048, 2048), dtype=np.float32)
    for _ in range(20):
        a = a @ a / 2048.0
    x = xp.arange(8, dtype=np.float32)
    group.allreduce_(x)
    assert xp.cuda.get_current_stream().done
    assert float(a[0, 0]) == 1.0
    np.testing.assert_array_equal(backend.to_host(x), np.arange(8, dtype=np.float32))


@pytest.mark.gpu
def test_an_allreduce_while_another_device_is_current(group, gpu):
    xp = gpu.xp
    if xp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs a second GPU to make current")
    x = xp.arange(64, dtype=np.float32)
    with xp.cuda.Device(1):
        group.allreduce_(x)
        assert xp.cuda.runtime.getDevice() == 1
    np.testing.assert_array_equal(backend.to_host(x), np.arange(64, dtype=np.float32))


@pytest.mark.gpu
def test_bucketer_mean_over_cupy_grads(group, gpu, rng):
    xp = gpu.xp
    shapes = {"w1": (8, 16), "b1": (16,), "w2": (16, 4), "b2": (4,)}
    grads = {k: xp.asarray(rng.standard_normal(s).astype(np.float32)) for k, s in shapes.items()}
    bucketer = Bucketer(shapes, np.float32, xp, bucket_bytes=256)  # small buckets: several all-reduces
    assert len(bucketer.buffers) > 1
    mean = bucketer.allreduce_mean(group, grads)
    assert set(mean) == set(shapes)
    for name, grad in grads.items():
        assert mean[name].shape == grad.shape
        np.testing.assert_allclose(backend.to_host(mean[name]), backend.to_host(grad), rtol=1e-6)


@pytest.mark.gpu
def test_check_agreement_passes(group):
    group.check_agreement('{"plan": "abc"}', "the plan")


@pytest.mark.gpu
def test_close_is_idempotent(gpu, tmp_path):
    from psgd.collective.nccl import NcclCollective

    with NcclCollective(0, 1, gpu, rendezvous=f"file:{tmp_path / 'id.json'}", timeout=60.0) as g:
        g.barrier()
    g.close()
    with pytest.raises(CollectiveError, match="closed"):
        g.barrier()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
def test_a_stalled_allreduce_is_aborted_by_the_watchdog(group, gpu):
    """Queue a lot of work ahead of the all-reduce and give it 1 ms: the watchdog must abort, not hang."""
    xp = gpu.xp
    a = xp.ones((4096, 4096), dtype=np.float32)
    for _ in range(50):
        a = a @ a / 4096.0
    x = xp.zeros(8, dtype=np.float32)
    group.timeout = 0.001
    with pytest.raises(CollectiveError, match="did not complete within 0.001 s"):
        group.allreduce_(x)
    with pytest.raises(CollectiveError, match="aborted"):
        group.barrier()
    backend.synchronize(gpu)  # the queued work still drains after the abort
    assert float(a[0, 0]) == 1.0


@pytest.mark.gpu
def test_one_nccl_rank_trains_as_one_process_on_the_cpu(tmp_path):
    """psgd-worker --mode allreduce --backend nccl, one rank on cuda:0, float64: the weights one process
    reaches on the CPU with the same batch (the GPU's arithmetic and NCCL's plumbing change nothing)."""
    import subprocess
    import sys

    from helpers import make_job

    from psgd.config import to_toml
    from psgd.training.local import train_local

    job = make_job(
        "model.hidden=[32]",
        "train.dtype=float64",
        "train.epochs=2",
        "train.batch_size=16",
        "optimizer.name=sgd",
        "optimizer.lr=0.1",
        "cluster.workers=1",
        "train.device=cuda:0",
    )
    path, saved = tmp_path / "job.toml", tmp_path / "w.npz"
    path.write_text(to_toml(job.to_dict()))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "psgd.cli.worker",
            "-c",
            str(path),
            "--mode",
            "allreduce",
            "--backend",
            "nccl",
            "--rank",
            "0",
            "--rendezvous",
            f"file:{tmp_path / 'id.json'}",
            "--no-progress",
            "-q",
            "--save",
            str(saved),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    job = job.override("train.device", "cpu")
    reference = train_local(job, progress=False).params
    with np.load(saved, allow_pickle=False) as f:
        for name, ref in reference.items():
            rel = np.linalg.norm(f[name] - ref) / np.linalg.norm(ref)
            assert f[name].dtype == np.float64 and rel <= 1e-5, f"{name}: relative error {rel:.2e}"


@pytest.mark.gpu
def test_one_nccl_rank_with_overlap_ends_with_the_weights_without_it(tmp_path):
    """[cluster] overlap = true: each bucket is reduced by NCCL on a stream of its own, started by an event
    once backward has filled it; float64 weights equal to the bit those of overlap = false."""
    import subprocess
    import sys

    from helpers import make_job

    from psgd.config import to_toml

    saved = {}
    for overlap in (False, True):
        job = make_job(
            "model.hidden=[1200, 600]",
            "train.dtype=float64",
            "train.epochs=1",
            "train.batch_size=16",
            "optimizer.name=sgd",
            "optimizer.lr=0.1",
            "cluster.workers=1",
            "train.device=cuda:0",
            f"cluster.overlap={str(overlap).lower()}",
        )
        path, saved[overlap] = tmp_path / f"job-{overlap}.toml", tmp_path / f"w-{overlap}.npz"
        path.write_text(to_toml(job.to_dict()))
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "psgd.cli.worker",
                "-c",
                str(path),
                "--mode",
                "allreduce",
                "--backend",
                "nccl",
                "--rank",
                "0",
                "--rendezvous",
                f"file:{tmp_path / f'id-{overlap}.json'}",
                "--no-progress",
                "-q",
                "--save",
                str(saved[overlap]),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    with np.load(saved[False], allow_pickle=False) as off, np.load(saved[True], allow_pickle=False) as on:
        assert off.files == on.files
        for name in off.files:
            np.testing.assert_array_equal(on[name], off[name])
