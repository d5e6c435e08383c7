"""Which examples each worker trains on, step by step.

The structure is fixed because other code relies on it to prove that a
synchronous run of N workers with batch B equals one process with batch N*B:

- each epoch has one permutation of the training set, from ``(seed, epoch)``;
- it is cut to ``m * world`` entries (``m = n // world``) and dealt round-robin,
  so rank r gets ``perm[r::world]``: disjoint shards of exactly ``m`` each;
- batch t of every rank is ``shard[t*B:(t+1)*B]``.

Then rank r's batch t is ``perm[t*B*world + r + k*world]`` for ``k < B``, and the
union over ranks of batch t is ``perm[t*B*world:(t+1)*B*world]``: exactly batch t
of one process with batch ``world*B`` (for which ``m*world = n``).  Since every
batch has the same size, the mean of the workers' mean gradients is the mean
gradient of the big batch.  Arrays stay on the host; callers move them.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from psgd.data.base import DataError


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise DataError(f"sharding: {name} must be an integer, got {value!r}")
    if value < minimum:
        raise DataError(f"sharding: {name} must be >= {minimum}, got {value}")
    return int(value)


def _check_rank(rank: object, world: object) -> tuple[int, int]:
    world = _check_int("world", world, 1)
    rank = _check_int("rank", rank, 0)
    if rank >= world:
        raise DataError(f"sharding: rank must be in [0, {world}) for world {world}, got {rank}")
    return rank, world


def epoch_permutation(n: int, epoch: int, seed: int) -> np.ndarray:
    """The order of the ``n`` training examples in ``epoch``: ``default_rng([seed, epoch]).permutation(n)``."""
    n = _check_int("n", n, 0)
    epoch = _check_int("epoch", epoch, 0)
    seed = _check_int("seed", seed, 0)
    return np.random.default_rng([seed, epoch]).permutation(n)


def shard_indices(n: int, rank: int, world: int, epoch: int, seed: int) -> np.ndarray:
    """Rank ``rank``'s examples in ``epoch``: ``perm[: m * world][rank::world]`` with ``m = n // world``.

    Shards are disjoint and all exactly ``m`` long; the ``n % world`` examples
    left over change every epoch, so none is left out for good.
    """
    rank, world = _check_rank(rank, world)
    n = _check_int("n", n, 0)
    m = n // world
    perm = epoch_permutation(n, epoch, seed)[: m * world]
    return perm[rank::world]


def steps_per_epoch(n: int, world: int, batch_size: int) -> int:
    """Batches each worker takes per epoch: ``(n // world) // batch_size``.

    The incomplete last batch is always dropped.  That way every worker takes
    the same number of steps, all of the same size, so no synchronous round
    waits on a worker that has run out of data, and averaged gradients weigh
    every example equally.  It also equals ``n // (world * batch_size)``, the
    steps of one process with batch ``world * batch_size``.
    """
    n = _check_int("n", n, 0)
    world = _check_int("world", world, 1)
    batch_size = _check_int("batch_size", batch_size, 1)
    return (n // world) // batch_size


def epoch_batch_indices(n: int, rank: int, world: int, batch_size: int, epoch: int, seed: int) -> np.ndarray:
    """Rank ``rank``'s batches of ``epoch`` as an index array of shape ``(steps, batch_size)``.

    Row t is ``shard_indices(...)[t*batch_size:(t+1)*batch_size]``.  A batch
    larger than the shard is a DataError, since the worker would take no step.
    """
    shard = shard_indices(n, rank, world, epoch, seed)
    batch_size = _check_int("batch_size", batch_size, 1)
    if batch_size > len(shard):
        raise DataError(
            f"sharding: batch_size {batch_size} is larger than the shard of {len(shard)} examples "
            f"({n} examples over {world} workers); use a smaller batch or fewer workers"
        )
    steps = len(shard) // batch_size
    return shard[: steps * batch_size].reshape(steps, batch_size)


def epoch_batches(
    x: np.ndarray, y: np.ndarray, rank: int, world: int, batch_size: int, epoch: int, seed: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield rank ``rank``'s ``(x_batch, y_batch)`` for ``epoch`` (see :func:`epoch_batch_indices`)."""
    if len(x) != len(y):
        raise DataError(f"sharding: x has {len(x)} rows but y has {len(y)}")
    for idx in epoch_batch_indices(len(x), rank, world, batch_size, epoch, seed):
        yield x[idx], y[idx]


class ShardedBatches:
    """One worker's view of the training set: its batches, epoch after epoch.

    ``global_step`` counts this worker's steps from 0 (its clock); epoch ``e``
    covers global steps ``[e * steps_per_epoch, (e + 1) * steps_per_epoch)``.
    """

    def __init__(
        self,
        x: np.ndarray,
        y: np.ndarray,
        *,
        rank: int,
        world: int,
        batch_size: int,
        seed: int,
        epochs: int | None = None,
    ) -> None:
        if len(x) != len(y):
            raise DataError(f"sharding: x has {len(x)} rows but y has {len(y)}")
        self.rank, self.world = _check_rank(rank, world)
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.seed = _check_int("seed", seed, 0)
        self.x, self.y = x, y
        self.n = len(x)
        shard = self.n // self.world
        if self.batch_size > shard:
            raise DataError(
                f"sharding: batch_size {self.batch_size} is larger than the shard of {shard} examples "
                f"({self.n} examples over {self.world} workers); use a smaller batch or fewer workers"
            )
        self.steps_per_epoch = steps_per_epoch(self.n, self.world, self.batch_size)
        #: the steps of a job of ``epochs`` (at which :meth:`at` says none is left), where given
        self.steps = None if epochs is None else self.steps_per_epoch * _check_int("epochs", epochs, 0)
        self._cached: tuple[int, np.ndarray] | None = None  # the epoch asked last, and its batches

    def __len__(self) -> int:
        return self.steps_per_epoch

    def indices(self, epoch: int) -> np.ndarray:
        """This worker's batches of ``epoch`` as indices, shape ``(steps_per_epoch, batch_size)``."""
        return epoch_batch_indices(self.n, self.rank, self.world, self.batch_size, epoch, self.seed)

    def at(self, step: int) -> tuple[int, np.ndarray] | None:
        """The epoch of this worker's step ``step`` (its clock) and the indices of its batch (an epoch's
        permutation is made once, for its first step asked); None past the job's last step."""
        if self.steps is not None and step >= self.steps:
            return None
        epoch, i = divmod(step, self.steps_per_epoch)
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, self.indices(epoch))
        return epoch, self._cached[1][i]

    def ahead(self, step: int) -> np.ndarray | None:
        """The indices of step ``step``'s batch, known before it is taken (to gather its rows ahead); None past
        the job's last step."""
        batch = self.at(step)
        return None if batch is None else batch[1]

    def epoch(self, epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(x_batch, y_batch)`` for each step of ``epoch``."""
        for idx in self.indices(epoch):
            yield self.x[idx], self.y[idx]
