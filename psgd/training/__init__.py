"""Training: the one loop every mode shares and what it drives.

- :mod:`psgd.training.loop`: batches, the evaluation schedule, metrics, progress and a clean stop; the exchange
  that tells the modes apart.
- :mod:`psgd.training.evaluation`: the weights scored on the test split, and the records each evaluation leaves
  (psgd's own loop and a loop of one's own under ``psgd.join()`` keep the same).
- :mod:`psgd.training.local`: the exchange of ``psgd train``, one process applying its own optimizer (the
  reference every other mode is compared with).
- :mod:`psgd.training.delay`: injected slowdowns, to play stragglers on one machine.
- :mod:`psgd.training.divergence`: the guard that tells a run which is not training why, once.

The parameter server's exchange is the worker's (:mod:`psgd.worker.exchange`), all-reduce's the collectives'
(:mod:`psgd.collective.exchange`).
"""
