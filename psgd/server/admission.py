"""Who may join a shard: the partition plan and the job a registering worker brings, against the shard's."""

from __future__ import annotations

import json
from typing import Any, Mapping

from psgd.job import differences as job_differences
from psgd.partition import PartitionPlan, plan_differences


def refusal(shard: int, plan: PartitionPlan, identity: Mapping[str, Any] | None, worker: int, plan_hash: str,
            plan_json: str, job_json: str | None) -> tuple[str, str, list[str] | None] | None:
    """Why ``worker`` may not join shard ``shard``: (gRPC status code name, message, the differences of a
    job mismatch or None for a malformed request), or None when it may.  Without an ``identity`` (a shard
    built by hand) only the plan is compared."""
    if plan_hash != plan.hash:
        try:
            why = plan_differences(json.loads(plan_json), plan.description())
        except Exception:  # a malformed description (any shape, any depth) only loses the explanation
            why = ""
        return ("FAILED_PRECONDITION", f"worker {worker}'s partition plan {plan_hash!r} differs from shard "
                f"{shard}'s {plan.hash!r}" + (f": {why}" if why else "") + "; start every process from the same "
                "job file", [])
    if job_json is None or identity is None:
        return None
    if not job_json:
        return ("INVALID_ARGUMENT", "the worker sent no job identity: start it with the same psgd version as the "
                "shards", None)
    try:
        job = json.loads(job_json)
    except (ValueError, RecursionError):
        job = None
    if not isinstance(job, dict):
        return "INVALID_ARGUMENT", "the worker's job identity is not a JSON object", None
    differ = job_differences(identity, job, me=f"shard {shard}", them=f"worker {worker}")
    if differ:
        return ("FAILED_PRECONDITION", f"worker {worker}'s job differs from shard {shard}'s: {'; '.join(differ)}; "
                "start every process from the same job file", differ)
    return None
