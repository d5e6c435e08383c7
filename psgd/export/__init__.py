"""Keeping a trained model.

- :mod:`psgd.export.shards`: a job's weights joined from its shards, running or checkpointed.

The joined weights are written as :mod:`psgd.weights` writes a model's weights, and scored by
:func:`psgd.training.evaluation.evaluate_file`.
"""
