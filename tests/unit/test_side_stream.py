"""psgd.compute.backend.SideStream: transfers and collectives on a CUDA stream of their own, ordered after the compute
stream's work by events (run on NumPy, and on CuPy where a GPU is present)."""

from __future__ import annotations

import threading

import numpy as np

from psgd.compute import backend


def slow_fill(device, value: float, n: int = 2048):
    """An (n, n) array that the compute stream fills with ``value`` only after many products (on a GPU the
    host has long returned by then)."""
    xp = device.xp
    a = xp.ones((n, n), dtype=np.float32)
    for _ in range(30 if device.is_gpu else 1):
        a = a @ a / n
    out = xp.zeros((n, n), dtype=np.float32)
    out[...] = a * value
    return out


def test_a_copy_to_host_waits_for_the_kernels_queued_before_its_mark(device):
    side = backend.SideStream(device)
    g = slow_fill(device, 3.0)
    out = backend.host_empty(g.shape, g.dtype, device)
    out[...] = -1.0
    side.to_host_after(side.mark(), g, out)
    side.synchronize()
    assert float(out.min()) == float(out.max()) == 3.0


def test_a_strided_array_is_copied_too(device):
    side = backend.SideStream(device)
    g = slow_fill(device, 2.0, n=512)[:, ::2]
    out = backend.host_empty(g.shape, g.dtype, device)
    side.to_host_after(side.mark(), g, out)
    side.synchronize()
    np.testing.assert_array_equal(out, np.full(g.shape, 2.0, dtype=np.float32))


def test_work_run_after_a_mark_on_another_thread_sees_the_kernels_before_it(device):
    """What a communication thread does: a bucket's reduction (here: scaling it) starts once the kernels that
    filled the bucket are done, and is finished when run_after returns."""
    side = backend.SideStream(device)
    g = slow_fill(device, 5.0)
    mark = side.mark()
    seen = {}

    def reduce_() -> None:
        g[...] *= 0.5
        seen["value"] = float(backend.to_host(g).min())

    thread = threading.Thread(target=side.run_after, args=(mark, reduce_))
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    assert seen["value"] == 2.5
    assert float(backend.to_host(g).max()) == 2.5
