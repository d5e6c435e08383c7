"""Operating a running job from outside it: reaching its shards (:mod:`psgd.ops.reach`), a view of the cluster
(:mod:`psgd.ops.view`, for ``psgd status``) and the preflight checks (:mod:`psgd.ops.checks`, for ``psgd doctor``).
The commands in :mod:`psgd.cli` parse their flags and call these."""
