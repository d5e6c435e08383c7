"""Shared test fixtures.

Tests marked ``gpu`` need CuPy and a CUDA device.  Without one they are
skipped, unless ``PSGD_REQUIRE_GPU=1`` is set, in which case they fail: a
GPU machine that silently skips its GPU tests proves nothing.

Tests that need more of the machine than Python (network namespaces, tc, a
tmpfs mount, openssl, /proc, MPI) are marked ``lacks(condition, reason=...)``
or call ``helpers.skip_or_fail(why)``: skipped where the machine lacks it,
failed instead when ``PSGD_REQUIRE_NET=1`` is set.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import textwrap
import uuid

import numpy as np
import pytest

from psgd.compute import backend


def gpu_required() -> bool:
    return os.environ.get("PSGD_REQUIRE_GPU", "") not in ("", "0")


def pytest_collection_modifyitems(config, items):
    if not (backend.cuda_available() or gpu_required()):
        skip = pytest.mark.skip(reason="no CUDA GPU with CuPy on this machine (" + _why_no_gpu() + ")")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    # else run them: pytest_runtest_setup fails each one when the GPU is required but missing
    if not docker_required() and any("docker" in item.keywords for item in items):
        why = _why_no_docker()
        if why:
            skip = pytest.mark.skip(reason=f"no usable Docker engine: {why}")
            for item in items:
                if "docker" in item.keywords:
                    item.add_marker(skip)


def pytest_runtest_setup(item):
    for mark in item.iter_markers("lacks"):
        if mark.args[0]:
            import helpers

            helpers.skip_or_fail(mark.kwargs["reason"])
    if "gpu" in item.keywords and gpu_required() and not backend.cuda_available():
        pytest.fail("PSGD_REQUIRE_GPU=1 but no usable CUDA GPU: " + _why_no_gpu(), pytrace=False)
    if "docker" in item.keywords and docker_required():
        why = _why_no_docker()
        if why:
            pytest.fail(f"PSGD_REQUIRE_DOCKER=1 but no usable Docker engine: {why}", pytrace=False)


def docker_required() -> bool:
    return os.environ.get("PSGD_REQUIRE_DOCKER", "") not in ("", "0")


@functools.cache
def _why_no_docker() -> str | None:
    """Why tests marked ``docker`` cannot run here (asked once per session), or None."""
    import dockerlab

    return dockerlab.unavailable()


def _why_no_gpu() -> str:
    try:
        backend.check_cuda_available()
    except backend.DeviceError as exc:
        return str(exc)
    return "unknown"


@pytest.fixture
def keep_signal_handlers():
    """Give back the stop signals' handlers: psgd-worker's and psgd-server's main() take them over in-process."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.fixture(autouse=True)
def _psgd_logging_restored():
    """Give back the ``psgd`` logger as each test found it.

    A CLI called in-process (``main([...])``) sets up logging as a process does
    (``psgd.observe.logs.setup_logging``: its own handler, no propagation). Left so, the
    next test's ``caplog`` depends on which tests ran before it and on pytest's
    version (9.2 also attaches its handler to non-propagating loggers).
    """
    logger = logging.getLogger("psgd")
    kept = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = kept


@pytest.fixture(autouse=True)
def _job_token_restored():
    """Give back ``PSGD_TOKEN`` as each test found it: a benchmark run in-process sets it, as a user's shell holds
    it, for the processes it starts (psgd.bench.chaos.processes.job_token).  Left so, a later test's ``psgd run`` or
    ``psgd launch`` takes it for the user's own and keeps no token of its own (seen: the SIGTERM test of psgd run,
    after the benchmarks' quick runs in the default tier, found no line naming ``RUN/.token``)."""
    kept = os.environ.get("PSGD_TOKEN")
    yield
    if kept is None:
        os.environ.pop("PSGD_TOKEN", None)
    else:
        os.environ["PSGD_TOKEN"] = kept


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Run a test once on NumPy and once on CuPy (the latter marked ``gpu``)."""
    return backend.get_device(request.param)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """``write(source)`` writes a uniquely named module into tmp_path (on sys.path) and returns its name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(source: str) -> str:
        name = f"psgd_test_user_{uuid.uuid4().hex[:12]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)
