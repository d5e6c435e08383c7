"""``psgd launch``: a whole job from one command per machine.

Parameter-server mode starts this node's share of K ``psgd-server`` processes
and N ``psgd-worker`` processes, shows worker 0's progress, waits (within a
time limit) for this node's workers to finish, then reads the final weights
from the shards and prints their test accuracy.  All-reduce mode starts N
ranks (under mpiexec for MPI; one per GPU for NCCL) and evaluates the weights
rank 0 saved.  Each process writes its log to the run folder.

The launcher owns its children, as torchrun does:

- each child runs in a session of its own and is told by the kernel to stop
  (SIGTERM) when the launcher dies, even by SIGKILL (``PR_SET_PDEATHSIG``);
- SIGINT, SIGTERM and SIGHUP to the launcher are forwarded to every child (to a parameter-server job's
  workers as SIGINT: the job pauses),
  which gets ``GRACE`` seconds to leave cleanly before it is killed;
- the BLAS/OpenMP threads of the machine's cores are divided among the
  processes it starts (see :mod:`psgd.compute.threads`), said in one line;
- the current folder is on every child's import path and its own, as with
  ``python -m``, so ``--model mymodule:MyNet`` finds ``./mymodule.py``.

On many machines, ``nnodes``/``node_rank``/``hosts`` lay the job out so that
each node runs shards ``k`` with ``k % nnodes == node_rank`` (ports ``port``,
``port + 2``, ... on its host; each data port is the gRPC port + 1) and
workers ``r`` with ``r % nnodes == node_rank``; every node computes the same
addresses, so one command per machine needs no other coordination.

Where things live:

- ``run.py``: :func:`launch`, and the parameter-server mode's shards and workers;
- ``allreduce.py``: the all-reduce mode's ranks (MPI or NCCL);
- ``result.py``: what a launch ends with, the final evaluation of the weights;
- ``failures.py``: the record of each process of a launch that failed (:class:`ChildFailure`);
- ``layout.py``: :class:`Layout` (which shards and workers run here), the thread
  budget, :func:`find_mpiexec` and the flags that place a process (its device, its output);
- ``folder.py``: the run folder; ``certs.py``: the CA and certificate a single node makes for its job's TLS;
- ``supervise.py``: the children (:class:`Children`), signal forwarding, the
  stop signals and ``GRACE``, and the errors of a launch.

This package only re-exports their public names.
"""

from psgd.launcher.layout import Hosts, Layout, find_mpiexec
from psgd.launcher.result import EXIT_LOST_UPDATES, LaunchResult, lost_updates
from psgd.launcher.run import launch
from psgd.launcher.supervise import GRACE, STOP_SIGNALS, Children, LaunchError, LaunchInterrupted, child_environment

__all__ = [
    "launch",
    "LaunchResult",
    "EXIT_LOST_UPDATES",
    "lost_updates",
    "Hosts",
    "Layout",
    "find_mpiexec",
    "Children",
    "child_environment",
    "LaunchError",
    "LaunchInterrupted",
    "STOP_SIGNALS",
    "GRACE",
]
