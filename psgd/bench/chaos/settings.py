"""The chaos suite's fixed settings: the fault kinds, the shape and pace of a job, and every time bound."""

from __future__ import annotations

import sys

KINDS = (
    "kill-shard",
    "restart-shard",
    "kill-worker",
    "stop-shard",
    "stop-worker",
    "stop-mid-pull",
    "hostile",
    "trickled-push",
    "duplicate-rank",
    "outsider",
    "corrupt-checkpoint",
    "squatter",
    "full-disk",
    "netcut",
    "flood",
    "insider-follower",
    "restart-primary-at-end",
    "rollback-storm",
    "sigterm",
)
PY = sys.executable

SHARDS = 2
FAULTS_PER_RUN = 3  # draws per run (``sigterm`` among them ends the run)
STEPS_PER_WORKER = 420  # about how many steps each worker trains (epochs are rounded from it)
PACE = "fixed:0.02"  # psgd-worker --delay: steps of a known length, whatever the model (about 10 s a job)
KEEP = 2  # --keep-checkpoints
CUT_ROUNDS = 25  # [cluster] checkpoint_rounds of a sync run: a killed shard takes the job back to a cut
CHECKPOINT_EVERY = 0.3  # --checkpoint-every
LEASE = 2.0  # [cluster] lease_seconds: a dropped worker stalls a sync round this long
REQUEST_TIMEOUT = 15.0  # [cluster] request_timeout
JOIN_TIMEOUT = 30.0  # [cluster] join_timeout (processes start slowly on a loaded machine)
STOP_BOUND = 10.0  # every process must be gone this long after SIGTERM
START_BOUND = 45.0  # a shard must listen, a worker log its first step, within this
STALL_BOUND = 40.0  # no worker clock moving for this long while training: a hang
RUN_BOUND = 240.0  # no run may take longer
MIN_ACCURACY = 0.8  # a finished job on the digits must have learned something
SUBNET = "10.99.1"
NS_PORT = 50051
