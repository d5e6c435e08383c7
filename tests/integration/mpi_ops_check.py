"""Run under ``mpiexec -n N``: checks the mpi backend's collectives across real ranks.

Prints ``ok rank R`` on success; any failed check raises, and mpiexec exits non-zero.
"""

import numpy as np

from psgd.collective import Bucketer, CollectiveError
from psgd.collective.mpi import MpiCollective

group = MpiCollective()
r, n = group.rank, group.world_size

a = np.arange(5, dtype=np.float64) + r
group.allreduce_(a)
np.testing.assert_array_equal(a, n * np.arange(5) + n * (n - 1) / 2)
m = np.array([r, -r], dtype=np.int64)
group.allreduce_(m, op="max")
assert m.tolist() == [n - 1, 0]
group.allreduce_(m := np.array([r], dtype=np.float32), op="min")
assert m[0] == 0

b = np.full(7, float(r), dtype=np.float32)
group.broadcast_(b, root=n - 1)
assert (b == n - 1).all()
group.barrier()

# several buckets (tiny bucket size), views into reused buffers, mean over ranks
shapes = {"w": (3, 4), "b": (4,), "v": (10,)}
bucketer = Bucketer(shapes, "float32", np, bucket_bytes=48)  # 12 floats a bucket
assert len(bucketer.buffers) == 3
for step in range(2):
    grads = {k: np.full(s, float(r + step), dtype=np.float32) for k, s in shapes.items()}
    mean = bucketer.allreduce_mean(group, grads)
    for k, s in shapes.items():
        assert mean[k].shape == s
        np.testing.assert_allclose(mean[k], (n - 1) / 2 + step)

# rows of a table's gradient gathered from every rank, in rank order, uneven (rank 0 sends none): MPI's
# all-gather and the all-reduces every backend has give the same rows
ids = np.arange(2 * r, dtype=np.int64) + 100 * r
values = np.stack([ids * 0.5, -ids.astype(np.float64)], axis=1).astype(np.float32)
want_ids = np.concatenate([np.arange(2 * k) + 100 * k for k in range(n)])
for gathered_ids, gathered in (group.gather_rows(ids, values), super(MpiCollective, group).gather_rows(ids, values)):
    np.testing.assert_array_equal(gathered_ids, want_ids)
    np.testing.assert_array_equal(gathered, np.stack([want_ids * 0.5, -want_ids.astype(np.float64)], axis=1))
    assert gathered.dtype == np.float32

group.check_agreement("same model", "the model")
try:
    group.check_agreement(f"model of rank {r}", "the model")
except CollectiveError as exc:
    assert "disagree on the model" in str(exc)
else:
    raise AssertionError("disagreement not detected")
print(f"ok rank {r}", flush=True)
