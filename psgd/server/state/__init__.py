"""The shard without any transport: its core (:mod:`~psgd.server.state.core`), the weights and the update pass over
them, a sync round in the making, the push remedies, the rows of its tables, who may join it, its rollbacks, and its
state taken and given whole, with the checkpoint files that state is written as.  Imports neither
:mod:`psgd.server.net` nor :mod:`psgd.server.durable` (tests/unit/test_layering.py)."""
