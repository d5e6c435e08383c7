"""How training speed scales with the model's width, the workers and the mode, run as a user runs it.

``psgd bench scaling`` (and ``benchmarks/scaling.py``) starts real ``psgd
train`` and ``psgd launch`` processes for the MLP at widths 64-4096 and the
CNN, one process and 1-4 workers under sync, async and all-reduce, beside a
1-BLAS-thread peer and a no-thread-budget column, and reports steps/s,
per-worker steps/s and scaling efficiency.  The full account is the command's
help text, :data:`psgd.bench.scaling.command.DESCRIPTION`.

Which file holds what:

- ``plan.py``: the widths, worker counts and configurations, ``Run`` (one run's command line), ``Settings``
  and its plan, the column labels;
- ``measure.py``: steps/s from what the processes recorded (pure functions), ``MeasureError``, ``SOURCES``;
- ``runner.py``: starting, stopping and measuring each run; ``run_benchmark`` goes round them all;
- ``report.py``: the medians (``tabulate``), ``table.md``, ``scaling.json`` and ``scaling.png``;
- ``command.py``: the command line: ``DESCRIPTION``, ``add_arguments``, ``settings_from_args``, ``run_from_args``.
"""
