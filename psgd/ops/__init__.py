"""Operating a job from outside it: reaching its shards (:mod:`psgd.ops.reach`), a view of the cluster
(:mod:`psgd.ops.view`, for ``psgd status``), the preflight checks (:mod:`psgd.ops.checks`, for ``psgd doctor``) and a
run read back from its folder (:mod:`psgd.ops.report`, for ``psgd report``).
The commands in :mod:`psgd.cli` parse their flags and call these."""
