"""A job's identity: everything the processes of one job must agree on, and its fingerprint.

Every shard and worker derives the same identity from its job file and the
partition plan: the plan's hash, the consistency policy and its options, the
worker and shard counts, the optimizer with its options, and the dtype.  A
worker sends its identity when it registers; the shard compares it with its
own and refuses a mismatch with one line that names each field that differs,
so two processes started from different job files never train together
silently.  The fingerprint (a short hash of the identity) names the job: a
shard's checkpoints live under ``DIR/<fingerprint>/shard-K``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from psgd.config import JobConfig

#: The fields of an identity, in the order differences are reported.
FIELDS = ("plan", "policy", "policy_options", "workers", "shards", "optimizer", "dtype")


def identity(job: JobConfig, plan_hash: str) -> dict[str, Any]:
    """What every process of ``job`` must agree on (the shard index is checked apart)."""
    c = job.cluster
    options: dict[str, Any] = {"staleness_lr": c.staleness_lr}
    if c.policy == "ssp":
        options["staleness"] = c.staleness
    if c.policy == "sync":
        options["backup_workers"] = c.backup_workers
    return {"plan": plan_hash, "policy": c.policy, "policy_options": options, "workers": c.workers,
            "shards": c.shards, "optimizer": dict(job.optimizer), "dtype": job.train.dtype}


def fingerprint(ident: Mapping[str, Any]) -> str:
    """A 16-hex-digit name of an identity (the same identity always gives the same name)."""
    text = json.dumps({k: ident.get(k) for k in FIELDS}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def differences(mine: Mapping[str, Any], theirs: Mapping[str, Any], me: str = "shard",
                them: str = "worker") -> list[str]:
    """Each field on which two identities differ, in words: ``policy: shard sync, worker async``."""
    out = []
    for key in FIELDS:
        a, b = mine.get(key), theirs.get(key)
        if a != b:
            out.append(f"{key}: {me} {_show(a)}, {them} {_show(b)}")
    return out


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={v}" for k, v in sorted(value.items())) + "}"
    return "missing" if value is None else str(value)
