"""Datasets (bundled digits, synthetic teacher data, IDX and NPZ files) and rank sharding.

This module only re-exports the public API; the work lives in ``base``,
``readers``, ``synthetic``, ``datasets`` and ``sharding``.
"""

from psgd.data.base import DataError, Dataset, stratified_split
from psgd.data.datasets import DataShape, describe_dataset, load_dataset, load_idx_dir, load_npz
from psgd.data.own import dataset_from
from psgd.data.readers import read_digits, read_idx, read_idx_header, read_npz, read_npz_headers
from psgd.data.sharding import (
    ShardedBatches,
    epoch_batch_indices,
    epoch_batches,
    epoch_permutation,
    shard_indices,
    steps_per_epoch,
)
from psgd.data.synthetic import make_synthetic, synthetic_options

__all__ = [
    "DataError",
    "DataShape",
    "Dataset",
    "dataset_from",
    "ShardedBatches",
    "describe_dataset",
    "epoch_batch_indices",
    "epoch_batches",
    "epoch_permutation",
    "load_dataset",
    "load_idx_dir",
    "load_npz",
    "make_synthetic",
    "read_digits",
    "read_idx",
    "read_idx_header",
    "read_npz",
    "read_npz_headers",
    "shard_indices",
    "stratified_split",
    "steps_per_epoch",
    "synthetic_options",
]
