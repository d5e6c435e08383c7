"""Chaos: the shards and workers of running jobs are faulted, and invariants are checked after each fault.

Small jobs on the bundled digits (2 shards, 2-3 workers, sync or async, data
path on or off) are started the way users start them and faulted while they
train: shards and workers killed, stopped and restarted, hostile connections,
network cuts, SIGTERM to everything.  One seed draws every job and fault, so
``--seed`` replays a run.  The full account of the faults and the invariants is
the command line's help text, :data:`psgd.bench.chaos.suite.DESCRIPTION`
(``python benchmarks/chaos.py --help``).

Which file holds what:

- ``settings.py``: the fault kinds (``KINDS``), the shape and pace of a job, every time bound;
- ``invariants.py``: the ``check_*`` functions, pure, on plain data;
- ``draws.py``: ``Fault``, ``RunSpec`` and the seeded ``Planner`` that draws them;
- ``processes.py``: starting processes as users do, free ports, log tails, leftover processes;
- ``hostile.py``: the clients of the faults that come from outside the job's processes;
- ``cluster.py``: ``Cluster``, one job's shards and workers, and ``Abort``;
- ``faults.py``: ``FaultInjection``, how each fault kind is injected (the fault half of ``Run``), the kinds
  below aside;
- ``disk.py``: the ``full-disk`` fault; ``flooding.py``: the ``flood``; ``insiders.py``: the faults of members
  of the job (``insider-follower``); ``pairs.py``: ``restart-primary-at-end``;
- ``run.py``: ``Run``, one job from start to its final checks;
- ``suite.py``: ``run_chaos``, ``summary`` and the command line ``main`` (also ``python -m psgd.bench.chaos``).
"""
