"""The ``nccl`` backend: collectives through NCCL (CuPy's ``cupy.cuda.nccl``), one rank per GPU.

Start one process per GPU, each with ``--rank R --device cuda:N`` and the same
``--rendezvous`` (see :mod:`psgd.collective.rendezvous`).  Arrays are CuPy
arrays reduced in place on the device, with no host copy; the work runs on the
device's current stream.  An all-reduce made inside :meth:`NcclCollective.queued` is only queued, so the
overlapped all-reduce mode queues each bucket on a stream of its own while backward goes on, with no
communication thread, and waits once for all of them (:meth:`NcclCollective.wait_queued`).

Every operation waits for completion under a watchdog: if it has not finished
within ``timeout`` seconds (or NCCL reports an asynchronous error), the
communicator is aborted and :class:`CollectiveError` is raised, so a rank that
died or stalled never hangs the others silently.  An all-reduce's stream is
queried once right after the call; only one still running (or failed) goes on
to the watchdog's polling, which asks NCCL for asynchronous errors: one that
has finished is complete, and a dead peer stops the next call from finishing.
An all-reduce checks its array fully the first time it sees its (array type,
dtype, reduction) and then only the array's device and contiguity.

This is the only psgd module that touches the NCCL bindings; it gets them from
:func:`psgd.compute.backend.nccl_module` and never imports CuPy itself.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from psgd.collective.base import OPS, Collective, CollectiveError
from psgd.collective.rendezvous import exchange
from psgd.compute.backend import get_device, is_device_array, nccl_module, to_host

log = logging.getLogger(__name__)

DEFAULT_RENDEZVOUS = "file:/tmp/psgd-nccl-id.json"

#: numpy dtype name -> name of the NCCL datatype constant in ``cupy.cuda.nccl``
_DTYPES = {
    "float16": "NCCL_FLOAT16",
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
    "int32": "NCCL_INT32",
    "int64": "NCCL_INT64",
}
#: reduction -> name of the NCCL op constant
_OPS = {"sum": "NCCL_SUM", "max": "NCCL_MAX", "min": "NCCL_MIN"}

CUDA_SUCCESS, CUDA_ERROR_NOT_READY = 0, 600  # cudaStreamQuery's two answers that are not errors

_MAX_CHECKED = 64  # (array type, dtype, op) triples an all-reduce remembers as checked; more empties the memo
_FIRST_SLEEP = 20e-6  # watchdog polling: sleeps grow from this ...
_MAX_SLEEP = 1e-3  # ... to this, so a finished operation is noticed within about a millisecond


# ---------------------------------------------------------------- pure helpers (tested without a GPU)


def _nccl_dtype(dtype: Any, nccl: Any) -> int:
    """The NCCL datatype constant for ``dtype``, or CollectiveError naming the supported ones."""
    dt = np.dtype(dtype)
    name = _DTYPES.get(dt.name) if dt.isnative else None
    if name is None:
        raise CollectiveError(f"the nccl backend cannot reduce {dt} arrays; use one of {', '.join(_DTYPES)}")
    return getattr(nccl, name)


def _nccl_op(op: str, nccl: Any) -> int:
    """The NCCL reduction constant for ``op`` (sum, max, min), or CollectiveError."""
    if op not in OPS:
        raise CollectiveError(f"unknown reduction {op!r}; use one of {', '.join(OPS)}")
    return getattr(nccl, _OPS[op])


def _wait(
    done: Callable[[], bool],
    timeout: float,
    on_timeout: Callable[[], None],
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Poll ``done()`` until it is true; after ``timeout`` seconds call ``on_timeout()`` and raise.

    ``on_timeout`` is expected to clean up (abort) and raise its own, more
    precise error; if it returns, a generic CollectiveError is raised.
    Exceptions from ``done`` propagate.
    """
    deadline = clock() + timeout
    delay = _FIRST_SLEEP
    while not done():
        remaining = deadline - clock()
        if remaining <= 0:
            on_timeout()
            raise CollectiveError(f"operation did not complete within {timeout:g} s")
        sleep(min(delay, remaining))
        delay = min(delay * 2, _MAX_SLEEP)


def _call_with_deadline(fn: Callable[[], Any], timeout: float, on_timeout: Callable[[], None]) -> Any:
    """``fn()`` run in a helper thread; its result, or its exception re-raised.

    If it has not returned after ``timeout`` seconds, ``on_timeout()`` is
    called (it should raise; otherwise a generic CollectiveError is raised).
    A call that never returns cannot be cancelled: its daemon thread is left
    behind, and the process should exit.
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed to the caller below
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="psgd-nccl-init", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        on_timeout()
        raise CollectiveError(f"operation did not complete within {timeout:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _stream_finished(runtime: Any, stream: Any, status: int | None = None) -> bool:
    """Whether ``stream``'s work is done (``status``: its query's answer when already asked); a CUDA error on
    it is raised (CuPy's ``Stream.done`` is ``streamQuery(...) == 0``, which reports a failed stream as merely
    unfinished)."""
    if status is None:
        status = runtime.streamQuery(stream.ptr)
    if status == CUDA_SUCCESS:
        return True
    if status == CUDA_ERROR_NOT_READY:
        return False
    raise runtime.CUDARuntimeError(status)


# ---------------------------------------------------------------- the backend


class NcclCollective(Collective):
    """One rank of an NCCL group on one GPU."""

    backend = "nccl"
    queues = True  # NCCL calls are queued on a stream: overlap needs no communication thread

    def __init__(
        self, rank: int, world_size: int, device: Any, rendezvous: str = DEFAULT_RENDEZVOUS, timeout: float = 300.0
    ):
        self._comm: Any = None  # first, so close() works whatever fails below
        self._aborted = False
        self._queued = False
        self._barrier_buf: Any = None
        self._checked: dict[tuple[Any, Any, Any], tuple[int, int]] = {}  # (type, dtype, op) -> NCCL constants
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise CollectiveError(f"the nccl backend needs a positive integer world size, not {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise CollectiveError(f"the nccl backend needs a rank in 0..{world_size - 1}, not {rank!r}")
        if not timeout > 0:
            raise CollectiveError(f"the nccl backend needs a positive timeout, not {timeout!r}")
        self.rank, self.world_size, self.timeout = rank, world_size, float(timeout)
        self.rendezvous = rendezvous
        self._nccl = nccl_module()  # DeviceError saying what to install
        self.device = get_device(device)
        if not self.device.is_gpu:
            raise CollectiveError(
                f"rank {rank}: the nccl backend runs on GPUs but this rank's device is "
                f"{self.device}; run with --device cuda:N (one GPU per rank), or use "
                "--backend mpi on CPUs"
            )
        self._cuda = self.device.xp.cuda  # CuPy's cuda namespace: Device contexts and streams
        self._runtime, self._index = self._cuda.runtime, self.device.index
        unique = exchange(rendezvous, rank, world_size, self._nccl.get_unique_id, self.timeout)
        log.info("rank %d of %d: creating the NCCL communicator on %s", rank, world_size, self.device)
        self._comm = _call_with_deadline(lambda: self._create(unique), self.timeout, self._init_timed_out)
        self._check_async = self._async_error_check()

    def _create(self, unique: list[int]) -> Any:
        # Runs in a helper thread (CuPy releases the GIL inside ncclCommInitRank), so the device
        # must be made current here: NCCL binds the communicator to the calling thread's device.
        # CuPy 14 takes the id as the bytes its get_unique_id() returned (psgd.compute.backend requires 14).
        self.device.use()
        return self._nccl.NcclCommunicator(self.world_size, bytes(unique), self.rank)

    def _init_timed_out(self) -> None:
        raise CollectiveError(
            f"rank {self.rank}: creating the NCCL communicator for {self.world_size} ranks did not finish within "
            f"{self.timeout:g} s although every rank got the id through {self.rendezvous}: a rank has probably "
            "died or is stuck; restart all ranks (this process cannot cancel the stuck initialisation and "
            "should exit)"
        )

    def _async_error_check(self) -> Callable[[], None] | None:
        """``comm.check_async_error`` when this NCCL has it (2.4+), so a peer's failure shows up early."""
        check = getattr(self._comm, "check_async_error", None)
        if check is None:
            return None
        try:
            check()
        except Exception as exc:  # RuntimeError on NCCL < 2.4, where it is not available
            log.debug("rank %d: NCCL async error checks unavailable: %s", self.rank, exc)
            return None
        return check

    # ------------------------------------------------------------ operations

    def allreduce_(self, array: Any, op: str = "sum") -> Any:
        try:  # the checks that depend only on the array's type, its dtype and op: passed once already?
            checked = self._checked.get((type(array), getattr(array, "dtype", None), op))
        except TypeError:  # an unhashable op, refused below
            checked = None
        if checked is None:  # first sight: every check, in their usual order
            datatype, nccl_op = self._check_allreduce(array, op)
        else:
            datatype, nccl_op = checked
            if array.device.id != self._index or not array.flags.c_contiguous:
                self._datatype(array, "all-reduce")  # raises, saying which
        comm = self._comm
        if comm is None:
            self._live_comm()  # raises: closed, or aborted
        size = array.size
        if size:
            if self._runtime.getDevice() == self._index:  # the rank's device is current already (one per process)
                self._allreduce_on_current(comm, array, size, datatype, nccl_op, op)
            else:
                with self._cuda.Device(self._index):
                    self._allreduce_on_current(comm, array, size, datatype, nccl_op, op)
        return array

    def _check_allreduce(self, array: Any, op: str) -> tuple[int, int]:
        nccl_op = _nccl_op(op, self._nccl)
        datatype = self._datatype(array, "all-reduce")
        if len(self._checked) >= _MAX_CHECKED:
            self._checked.clear()
        self._checked[(type(array), array.dtype, op)] = datatype, nccl_op
        return datatype, nccl_op

    def _allreduce_on_current(self, comm: Any, array: Any, size: int, datatype: int, nccl_op: int, op: str) -> None:
        """Queue the all-reduce on the current stream of the current device (the rank's), then wait unless queued:
        a stream that has finished at the first query is done; any other answer goes to the watchdog."""
        stream = self._cuda.get_current_stream()
        ptr = array.data.ptr
        try:
            comm.allReduce(ptr, ptr, size, datatype, nccl_op, stream.ptr)
        except Exception as exc:  # NcclError: the communicator is unusable from here on
            self._refused(exc, f"all-reduce ({op}) of {array.nbytes} bytes")
        if not self._queued:
            status = self._runtime.streamQuery(stream.ptr)
            if status != CUDA_SUCCESS:
                self._finish(stream, f"all-reduce ({op}) of {array.nbytes} bytes", status)

    @contextlib.contextmanager
    def queued(self) -> Iterator[None]:
        self._queued = True
        try:
            yield
        finally:
            self._queued = False

    def wait_queued(self, what: str) -> None:
        with self._cuda.Device(self.device.index):
            self._finish(self._cuda.get_current_stream(), what)

    def broadcast_(self, array: Any, root: int = 0) -> Any:
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < self.world_size:
            raise CollectiveError(f"rank {self.rank}: broadcast root must be in 0..{self.world_size - 1}, not {root!r}")
        datatype = self._datatype(array, "broadcast")
        comm = self._live_comm()
        if array.size:
            what = f"broadcast from rank {root} of {array.nbytes} bytes"
            with self._cuda.Device(self.device.index):
                stream = self._cuda.get_current_stream()
                self._enqueue(lambda: comm.bcast(array.data.ptr, array.size, datatype, int(root), stream.ptr), what)
                self._finish(stream, what)
        return array

    def barrier(self) -> None:
        if self._barrier_buf is None:
            self._barrier_buf = self.device.asarray(np.zeros(1, dtype=np.int32))
        self.allreduce_(self._barrier_buf, op="max")  # stays 0: nothing accumulates across barriers

    def _host_allreduce(self, array: np.ndarray, op: str) -> np.ndarray:
        staged = self.device.asarray(array)
        self.allreduce_(staged, op=op)
        return to_host(staged)

    def close(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            try:
                comm.destroy()
            except Exception as exc:  # cleanup: report, do not mask the caller's own error
                log.warning("rank %d: destroying the NCCL communicator failed: %s", self.rank, exc)

    # ------------------------------------------------------------ internals

    def _datatype(self, array: Any, what: str) -> int:
        if not is_device_array(array):
            kind = type(array)
            raise CollectiveError(
                f"rank {self.rank}: the nccl backend needs device (CuPy) arrays on {self.device} "
                f"for {what}, got {kind.__module__}.{kind.__name__}; put it on the GPU first "
                "(device.asarray) or use --backend mpi for host arrays"
            )
        if array.device.id != self.device.index:
            raise CollectiveError(
                f"rank {self.rank}: {what} of an array on cuda:{array.device.id}, but this "
                f"rank's communicator is on {self.device}"
            )
        if not array.flags.c_contiguous:
            raise CollectiveError(
                f"rank {self.rank}: {what} needs a contiguous array, got a strided view of shape {array.shape}"
            )
        return _nccl_dtype(array.dtype, self._nccl)

    def _live_comm(self) -> Any:
        if self._comm is None:
            if self._aborted:
                raise CollectiveError(
                    f"rank {self.rank}: the NCCL communicator was aborted after an earlier failure; restart all ranks"
                )
            raise CollectiveError(f"rank {self.rank}: the NCCL communicator is closed")
        return self._comm

    def _abort(self) -> None:
        comm, self._comm = self._comm, None
        self._aborted = True
        if comm is not None:
            try:
                comm.abort()
            except Exception as exc:
                log.warning("rank %d: aborting the NCCL communicator failed: %s", self.rank, exc)

    def _enqueue(self, call: Callable[[], None], what: str) -> None:
        try:
            call()
        except Exception as exc:  # NcclError: the communicator is unusable from here on
            self._refused(exc, what)

    def _refused(self, exc: Exception, what: str) -> None:
        self._abort()
        raise CollectiveError(
            f"rank {self.rank}: NCCL refused the {what} ({exc}); the communicator was aborted, restart all ranks"
        ) from exc

    def _finish(self, stream: Any, what: str, status: int | None = None) -> None:
        """Wait for ``stream`` under the watchdog; abort the communicator on timeout or error.  ``status``: the
        answer of a query of the stream made just before, taken as the first poll's (after NCCL's error check)."""
        check = self._check_async
        runtime = self._runtime
        first = [] if status is None else [status]

        def done() -> bool:
            if check is not None:
                check()  # raises NcclError when NCCL saw a peer fail
            return _stream_finished(runtime, stream, first.pop() if first else None)

        def timed_out() -> None:
            self._abort()
            raise CollectiveError(
                f"rank {self.rank}: {what} did not complete within {self.timeout:g} s: another rank has probably "
                "died or stalled; the NCCL communicator was aborted, restart all ranks (or raise the timeout "
                "if a step legitimately takes this long)"
            )

        try:
            _wait(done, self.timeout, timed_out)
        except CollectiveError:
            raise
        except Exception as exc:  # NcclError or a CUDA error from the stream
            self._abort()
            raise CollectiveError(
                f"rank {self.rank}: {what} failed ({exc}): another rank has probably died; "
                "the NCCL communicator was aborted, restart all ranks"
            ) from exc
