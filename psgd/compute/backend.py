"""The array backend: the only module in psgd that imports CuPy.

Models, losses and optimizers are written once against an array module ``xp`` (NumPy or CuPy).  This module says
whether CuPy and a CUDA device are usable, keeps the reason when they are not, parses device names (``cpu``,
``cuda``, ``cuda:N``; ``cuda:0,2`` for a launch over several GPUs) and moves arrays between host and device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from psgd.errors import InputError

try:  # pragma: no cover - depends on the machine
    import cupy as _cupy

    _import_error: BaseException | None = None
except Exception as exc:  # ImportError, or a CUDA library that fails to load
    _cupy = None
    _import_error = exc

INSTALL_HINT = (  # the packages of pyproject.toml's cuda12 and cuda13 extras (psgd itself installs from its folder)
    "install CuPy with CUDA's libraries and NCCL for your CUDA version: `pip install 'cupy-cuda12x[ctk]' "
    "nvidia-nccl-cu12` (CUDA 12) or `pip install 'cupy-cuda13x[ctk]' nvidia-nccl-cu13` (CUDA 13), or run with "
    "--device cpu"
)
#: the CuPy major version psgd is written against (NCCL ids are bytes from 14 on)
CUPY_MAJOR = 14
#: device index -> why its kernels cannot run (None: they ran), checked once per process
_checked_devices: dict[int, str | None] = {}
#: cudaHostRegister's flags: the default, and the one a mapping this process may only read needs
HOST_REGISTER_DEFAULT, HOST_REGISTER_READ_ONLY = 0, 8
_registered: dict[int, int] = {}  # address -> bytes, of the host memory registered through register_host now
_refusal_said = ""  # the last reason logged for a refused registration, so that it is said once
log = logging.getLogger(__name__)


class DeviceError(InputError):
    """A device was asked for that this machine cannot provide."""


def cuda_device_count() -> int:
    """Number of CUDA devices CuPy can see (0 when CuPy or the driver is missing)."""
    if _cupy is None:
        return 0
    try:
        return int(_cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def cuda_available() -> bool:
    """True when CuPy imports, a CUDA device is visible and it runs CuPy's kernels."""
    try:
        check_cuda_available()
    except DeviceError:
        return False
    return True


def check_cuda_available(index: int = 0) -> None:
    """Raise :class:`DeviceError` saying what is missing unless GPU ``index`` is usable."""
    if _cupy is None:
        raise DeviceError(
            f"a CUDA device was requested but CuPy could not be imported ({_import_error}); " + INSTALL_HINT
        )
    try:
        count = int(_cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        raise DeviceError(
            f"CuPy is installed but CUDA is not usable ({exc}); check the NVIDIA driver "
            "and that CUDA_VISIBLE_DEVICES names a GPU, or run with --device cpu"
        ) from exc
    if count == 0:
        raise DeviceError("CuPy is installed but no CUDA device is visible; run with --device cpu")
    if not 0 <= index < count:
        raise DeviceError(
            f"cuda:{index} was requested but this machine has {count} CUDA device(s) (cuda:0 .. cuda:{count - 1})"
        )
    if index not in _checked_devices:
        _checked_devices[index] = _kernels_fail(index)
    why = _checked_devices[index]
    if why is not None:
        raise DeviceError(
            f"CuPy sees cuda:{index} but cannot run kernels on it ({why}); CuPy's wheel does not "
            "bring CUDA's libraries (NVRTC, cuBLAS): " + INSTALL_HINT
        )


def _kernels_fail(index: int) -> str | None:
    """Why an elementwise kernel (compiled by NVRTC) and a product (cuBLAS) fail on GPU ``index``, or None."""
    try:
        with _cupy.cuda.Device(index):
            x = _cupy.arange(8, dtype=_cupy.float32)
            float((x @ x).item())
    except Exception as exc:  # CUDA, NVRTC or cuBLAS missing or broken: CuPy raises many types
        return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
    return None


@dataclasses.dataclass(frozen=True)
class Device:
    """Where arrays live: ``Device('cpu')`` or ``Device('cuda', n)``."""

    kind: str
    index: int = 0

    @property
    def xp(self) -> Any:
        """The array module for this device (``numpy`` or ``cupy``)."""
        return np if self.kind == "cpu" else _cupy

    @property
    def is_gpu(self) -> bool:
        return self.kind == "cuda"

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    def use(self) -> None:
        """Make this the current CUDA device of the calling thread (no-op on CPU).

        CuPy makes new arrays and runs kernels on the thread's current device, whatever device an
        array came from: a process that computes on ``cuda:N`` makes it current before anything."""
        if self.is_gpu:
            _cupy.cuda.Device(self.index).use()

    def asarray(self, a: Any, dtype: Any = None) -> Any:
        """``a`` as an array on this device (no copy when it is already there)."""
        return to_device(a, self, dtype=dtype)


CPU = Device("cpu")

_DEVICE_RE = re.compile(r"^(cpu|cuda|gpu)(?::(\d+))?$")


def get_device(spec: str | Device | None = "cpu") -> Device:
    """Parse ``cpu``, ``cuda``, ``cuda:N`` (or ``gpu``/``gpu:N``) and check it is usable."""
    if isinstance(spec, Device):
        device = spec
    else:
        text = (spec or "cpu").strip().lower()
        m = _DEVICE_RE.match(text)
        if not m:
            many = " (several GPUs, such as 'cuda:0,2', are for psgd launch)" if _GPUS_RE.match(text) else ""
            raise DeviceError(f"unknown device {spec!r}: use 'cpu', 'cuda' or 'cuda:N'{many}")
        kind = "cpu" if m.group(1) == "cpu" else "cuda"
        if kind == "cpu" and m.group(2) is not None:
            raise DeviceError(f"unknown device {spec!r}: 'cpu' takes no index")
        device = Device(kind, int(m.group(2) or 0))
    if device.is_gpu:
        check_cuda_available(device.index)
    return device


_GPUS_RE = re.compile(r"^(?:cuda|gpu):(\d+(?:,\d+)+)$")


def gpu_indices(spec: str) -> list[int]:
    """The GPUs a launch spreads its processes over: every visible one for ``cuda``, one for ``cuda:N``, those
    named for ``cuda:0,2``; none for ``cpu``.  Checks that CuPy sees them, without running a kernel (no CUDA
    context on every GPU for the launcher: each process checks its own)."""
    text = spec.strip().lower()
    m = _GPUS_RE.match(text)
    if not m:
        device = _DEVICE_RE.match(text)
        if not device:
            raise DeviceError(f"unknown device {spec!r}: use 'cpu', 'cuda', 'cuda:N' or GPUs such as 'cuda:0,2'")
        if device.group(1) == "cpu":
            get_device(text)  # 'cpu:1' says what is wrong with it
            return []
    count = cuda_device_count()
    if count == 0:
        check_cuda_available()  # raises, saying what is missing: CuPy, the driver or a visible GPU
    if m:
        indices = [int(i) for i in m.group(1).split(",")]
        if len(set(indices)) != len(indices):
            raise DeviceError(f"{spec!r} names a GPU more than once")
    elif device.group(2) is None:
        indices = list(range(count))
    else:
        indices = [int(device.group(2))]
    for index in indices:
        if index >= count:
            raise DeviceError(
                f"cuda:{index} was requested but this machine has {count} CUDA device(s) "
                f"(cuda:0 .. cuda:{count - 1}{_visible()})"
            )
    return indices


def _visible() -> str:
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"; CUDA_VISIBLE_DEVICES={named}" if named is not None else ""


def gpu_names() -> list[str]:
    """One line per visible GPU (``cuda:0 NVIDIA H100 80GB HBM3, 79.1 GiB``); empty without CuPy or a GPU."""
    out = []
    for index in range(cuda_device_count()):
        try:
            props = _cupy.cuda.runtime.getDeviceProperties(index)
            name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
            out.append(f"cuda:{index} {name}, {props['totalGlobalMem'] / 2**30:.1f} GiB")
        except Exception as exc:  # the driver's own error, whatever its type
            out.append(f"cuda:{index} (its properties cannot be read: {exc})")
    return out


def use_device(spec: str | Device | None = "cpu") -> Device:
    """:func:`get_device`, made the calling thread's current device: what a process computing on it does first."""
    device = get_device(spec)
    device.use()
    return device


def get_array_module(*arrays: Any) -> Any:
    """``cupy`` if any argument is a CuPy array, else ``numpy``."""
    if _cupy is not None:
        return _cupy.get_array_module(*arrays)
    return np


def is_device_array(a: Any) -> bool:
    return _cupy is not None and isinstance(a, _cupy.ndarray)


def scatter_add(target: Any, index: Any, values: Any) -> None:
    """``target[index] += values`` with repeated indices summed (NumPy's ``add.at``; CuPy's ``scatter_add``)."""
    if is_device_array(target):
        import cupyx

        cupyx.scatter_add(target, index, values)
    else:
        np.add.at(target, index, values)


def to_host(a: Any, out: np.ndarray | None = None) -> np.ndarray:
    """Copy ``a`` to a NumPy array (into ``out`` when given); NumPy input is returned as is."""
    if is_device_array(a):
        if out is not None:
            a.get(out=out)
            return out
        return a.get()
    if out is not None:
        np.copyto(out, a)
        return out
    return np.asarray(a)


def host_empty(shape: Any, dtype: Any, device: Device = CPU) -> np.ndarray:
    """A NumPy array to stage ``device``'s transfers in: page-locked (pinned) host memory when
    ``device`` is a GPU, so copies to and from it run at the bus's full rate by DMA; plain memory
    otherwise.  Pinned memory is a scarce system resource: allocate such buffers once and reuse them."""
    dtype = np.dtype(dtype)
    if not device.is_gpu:
        return np.empty(shape, dtype=dtype)
    count = int(np.prod(shape, dtype=np.int64))
    memory = _cupy.cuda.alloc_pinned_memory(max(count * dtype.itemsize, 1))
    return np.frombuffer(memory, dtype=dtype, count=count).reshape(shape)


class HostRegistration:
    """Host memory registered (page-locked) with a GPU's driver by :func:`register_host`, until :meth:`close`."""

    def __init__(self, address: int, nbytes: int, device: Device):
        self.address, self.nbytes, self.device = address, nbytes, device

    def close(self) -> None:
        """Unregister the memory (once; later calls do nothing).  Call it before the memory is unmapped."""
        if _registered.pop(self.address, None) is None:
            return
        try:
            with _cupy.cuda.Device(self.device.index):
                _cupy.cuda.runtime.hostUnregister(self.address)
        except Exception as exc:  # the driver is going away (the process exits): the memory goes with it
            log.debug("host memory at %#x could not be unregistered from %s: %s", self.address, self.device, exc)


def register_host(address: int, nbytes: int, device: Device, read_only: bool = False) -> HostRegistration | None:
    """Register ``nbytes`` of host memory at ``address`` (a mapping this process holds, a shared-memory segment)
    with ``device``'s driver (cudaHostRegister), so that copies between it and the device run by DMA, as from
    :func:`host_empty`'s; ``read_only`` for a mapping this process may only read.  None on a CPU, and where the
    driver refuses (the reason logged once, at INFO): copies then work as from any host memory, slower."""
    global _refusal_said
    if not device.is_gpu or nbytes <= 0:
        return None
    try:
        with _cupy.cuda.Device(device.index):
            _cupy.cuda.runtime.hostRegister(address, nbytes, HOST_REGISTER_READ_ONLY if read_only else 0)
    except Exception as exc:  # CUDARuntimeError: not supported, over the locked-memory limit, ...
        if (why := " ".join(f"{type(exc).__name__}: {exc}".split())[:300]) != _refusal_said:
            _refusal_said = why
            log.info(
                "host memory could not be registered with %s's driver (%s): copies to and from it run "
                "unregistered, slower",
                device,
                why,
            )
        return None
    _registered[address] = nbytes
    return HostRegistration(address, nbytes, device)


def registered_host_bytes() -> int:
    """Bytes of host memory registered through :func:`register_host`, and not closed yet."""
    return sum(_registered.values())


def copy_to_device(pairs: Iterable[tuple[Any, np.ndarray]], device: Device) -> None:
    """Copy the host array of each (device array, host array) pair into its device array on GPU ``device`` (one
    shape and dtype, contiguous), queued on the thread's current stream, and wait for them all: the host memory
    may change once this returns."""
    with _cupy.cuda.Device(device.index):
        stream = _cupy.cuda.get_current_stream()
        for dev, host in pairs:
            dev.set(host, stream=stream)
        stream.synchronize()


def copy_to_host(pairs: Iterable[tuple[Any, np.ndarray]], device: Device) -> None:
    """Copy each pair's device array into its host array: :func:`copy_to_device` the other way, waited for too."""
    with _cupy.cuda.Device(device.index):
        stream = _cupy.cuda.get_current_stream()
        for dev, host in pairs:
            dev.get(stream=stream, out=host, blocking=False)
        stream.synchronize()


def to_device(a: Any, device: Device | str = CPU, dtype: Any = None) -> Any:
    """Put ``a`` on ``device`` (a no-op when it is already there with the right dtype)."""
    device = get_device(device) if not isinstance(device, Device) else device
    if not device.is_gpu:
        return np.asarray(to_host(a), dtype=dtype)
    with _cupy.cuda.Device(device.index):
        return _cupy.asarray(a, dtype=dtype)


def nccl_module() -> Any:
    """CuPy's NCCL bindings (``cupy.cuda.nccl``), or raise :class:`DeviceError` saying what is missing."""
    if _cupy is None:
        raise DeviceError(f"the nccl backend needs CuPy ({_import_error}); " + INSTALL_HINT)
    version = str(getattr(_cupy, "__version__", "unknown"))
    major = version.split(".")[0]
    if not major.isdigit() or int(major) < CUPY_MAJOR:
        raise DeviceError(f"the nccl backend needs CuPy {CUPY_MAJOR} or later, this is CuPy {version}; " + INSTALL_HINT)
    try:
        from cupy.cuda import nccl
    except Exception as exc:
        raise DeviceError(
            f"CuPy is installed but its NCCL bindings are not usable ({exc}); install NCCL "
            "for your CUDA version (`pip install nvidia-nccl-cu12` or `nvidia-nccl-cu13`) or use --backend mpi"
        ) from exc
    if not getattr(nccl, "available", True):
        raise DeviceError(
            "CuPy was built without NCCL support; install NCCL for your CUDA version "
            "(`pip install nvidia-nccl-cu12` or `nvidia-nccl-cu13`) or use --backend mpi"
        )
    return nccl


def synchronize(device: Device) -> None:
    """Wait for all queued work on ``device`` (no-op on CPU); use before timing GPU code."""
    if device.is_gpu:
        with _cupy.cuda.Device(device.index):
            _cupy.cuda.get_current_stream().synchronize()


class SideStream:
    """A CUDA stream of its own beside the one computing, for transfers and collectives that run while the
    computation goes on (overlap); on a CPU every method simply runs or does nothing.

    Work is ordered across the two streams by events, never by waiting for the whole device: :meth:`mark`
    records what the calling thread's current stream has queued so far, and :meth:`run_after` or
    :meth:`to_host_after` starts on this stream only once that is done.  The compute stream is never made
    to wait: what the side stream wrote is read after :meth:`synchronize` (or after :meth:`run_after` has
    returned, which ends with it)."""

    def __init__(self, device: Device):
        self.device = device
        self.stream = None
        if device.is_gpu:
            with _cupy.cuda.Device(device.index):
                self.stream = _cupy.cuda.Stream(non_blocking=True)

    def mark(self) -> Any:
        """An event after everything the calling thread's current stream has queued (None on a CPU)."""
        if self.stream is None:
            return None
        with _cupy.cuda.Device(self.device.index):
            return _cupy.cuda.get_current_stream().record()

    def to_host_after(self, event: Any, a: Any, out: np.ndarray) -> None:
        """Start copying ``a`` into ``out`` (pinned, see :func:`host_empty`) once ``event`` has happened,
        without waiting for it; ``out`` holds the values after :meth:`synchronize`.  On a CPU: a copy now."""
        if self.stream is None:
            np.copyto(out, a)
            return
        with self.current(after=event):  # any kernel the copy needs (a strided array made contiguous) runs here too
            a.get(stream=self.stream, out=out, blocking=False)

    @contextlib.contextmanager
    def current(self, after: Any = None) -> Iterator[None]:
        """This stream as the calling thread's current one (kernels and NCCL calls made inside queue on it),
        its work starting once ``after`` (an event from :meth:`mark`) has happened; on a CPU: nothing."""
        if self.stream is None:
            yield
            return
        with _cupy.cuda.Device(self.device.index):
            if after is not None:
                self.stream.wait_event(after)
            with self.stream:
                yield

    def run_after(self, event: Any, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` with this stream current in the calling thread (e.g. a communication thread), called
        once ``event`` has happened, and waited for: its results are ready on return."""
        if self.stream is None:
            return fn(*args)
        # Waited for here, on the host, and not only by the stream: work that polls its stream under a
        # watchdog would otherwise poll, with growing sleeps, for all of backward.
        event.synchronize()
        with self.current(after=event):
            result = fn(*args)
        self.stream.synchronize()
        return result

    def synchronize(self) -> None:
        """Wait for everything started on this stream."""
        if self.stream is not None:
            self.stream.synchronize()
