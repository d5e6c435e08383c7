"""Datasets (bundled digits, synthetic teacher data, IDX and NPZ files) and rank sharding.

This module only re-exports the public API; the work lives in ``base``,
``readers``, ``synthetic``, ``datasets`` and ``sharding``.
"""

from psgd.data.base import DataError, Dataset, stratified_split
from psgd.data.datasets import load_dataset, load_idx_dir, load_npz
from psgd.data.readers import read_digits, read_idx, read_npz
from psgd.data.sharding import (
    Batch,
    ShardedBatches,
    epoch_batch_indices,
    epoch_batches,
    epoch_permutation,
    shard_indices,
    steps_per_epoch,
)
from psgd.data.synthetic import make_synthetic

__all__ = [
    "Batch",
    "DataError",
    "Dataset",
    "ShardedBatches",
    "epoch_batch_indices",
    "epoch_batches",
    "epoch_permutation",
    "load_dataset",
    "load_idx_dir",
    "load_npz",
    "make_synthetic",
    "read_digits",
    "read_idx",
    "read_npz",
    "shard_indices",
    "stratified_split",
    "steps_per_epoch",
]
