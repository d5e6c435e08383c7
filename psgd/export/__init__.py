"""Keeping a trained model.

- :mod:`psgd.export.shards`: a job's weights joined from its shards, running or checkpointed.
- :mod:`psgd.export.weights`: a model's weights as one plain ``.npz`` file, and back, and scored.
"""
