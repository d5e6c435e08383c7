"""The thread budget: how many BLAS/OpenMP threads each psgd process may use.

NumPy's BLAS (OpenBLAS, MKL) starts one thread per core in every process.
With several psgd processes on one machine (``psgd launch`` starts shards and
workers side by side) those threads spin against each other, and once the
matrices cross the library's threading threshold a step can take fifty times
as long.  So every psgd process limits its own pools with ``threadpoolctl``
(at run time, not by changing the environment after NumPy was imported):

- ``[train] threads = N`` or ``--threads N``: N threads, whatever else is set;
- otherwise an ``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` (or MKL, BLIS,
  vecLib) variable set by the user is left to rule, as the libraries read it;
- otherwise a lone process keeps every core, and ``psgd launch`` divides the
  cores of the machine among the processes it starts on it (torchrun sets
  ``OMP_NUM_THREADS=1`` in the same situation), writing its choice into the job
  file of the run.

:func:`budget` makes that choice, and the one line that says it, both for
``psgd launch`` and for training in one process (``psgd train``, ``psgd.train``).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

#: The variables through which a user sets BLAS/OpenMP threads; the first set one is reported.
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
)

_limiter = None  # the active threadpool_limits; kept so the limit holds for the life of the process


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. a container's or Slurm's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def user_setting(environ: dict[str, str] | None = None) -> str | None:
    """``NAME=VALUE`` of the first thread variable set in the environment, or None."""
    environ = os.environ if environ is None else environ
    for name in THREAD_VARIABLES:
        if environ.get(name, "").strip():
            return f"{name}={environ[name].strip()}"
    return None


def share_of_cores(processes: int, cores: int | None = None) -> int:
    """Threads per process when ``processes`` psgd processes share this machine's cores."""
    cores = available_cores() if cores is None else cores
    return max(1, cores // max(1, processes))


def budget(threads: int, processes: int) -> tuple[int, str]:
    """Threads for each of ``processes`` psgd processes on this machine (``threads``: the job's ``[train]
    threads``, 0 for automatic; 0 back: left to the environment), and the one line that says so: what
    ``psgd launch`` picks for the processes it starts, and training in one process for itself."""
    cores = available_cores()
    if threads:
        return threads, (
            f"{processes} process(es) on {cores} core(s): {threads} BLAS/OpenMP thread(s) each (--threads N to change)"
        )
    explicit = user_setting()
    if explicit:
        return 0, f"{processes} process(es) on {cores} core(s): BLAS/OpenMP threads as {explicit} says"
    share = share_of_cores(processes, cores)
    return share, (
        f"{processes} process(es) on {cores} core(s): {share} BLAS/OpenMP thread(s) each "
        "(--threads N or OMP_NUM_THREADS to change)"
    )


def apply(threads: int) -> str:
    """Limit this process's BLAS/OpenMP pools to ``threads`` (0: automatic); returns what holds, in words."""
    global _limiter
    if threads <= 0:
        explicit = user_setting()
        return f"{explicit} from the environment" if explicit else f"all {available_cores()} cores"
    import numpy  # noqa: F401  (load NumPy's BLAS first, so that the limit reaches it)
    from threadpoolctl import threadpool_limits

    _limiter = threadpool_limits(limits=threads)
    return f"{threads} thread(s)"
