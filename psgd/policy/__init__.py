"""Consistency policies: pure state machines that decide when pushes apply and pulls answer.

``make_policy("sync", 4, backup_workers=1)``, ``make_policy("async", 4)``,
``make_policy("ssp", 4, staleness=2)``, ``make_policy("local", 4, local_steps=8)``;
``policy_from_cluster(job.cluster)``
builds the one a job file names.  :data:`POLICIES` is the one registry: each
class there says what it is (``name``, ``summary``, ``options``,
``accumulates``), and the job file, the command line and the benchmarks read
it from there.  Every misconfiguration is a one-line :class:`PolicyError` (a
``ValueError``).  See :mod:`psgd.policy.base` for the events, the decisions and
the clock convention.
"""

from __future__ import annotations

from typing import Any

from psgd.policy.asynchronous import AsyncPolicy
from psgd.policy.base import (
    ACCUMULATE,
    ACTIONS,
    APPLY,
    DUPLICATE,
    LATE,
    OUTCOME_COUNTERS,
    OUTCOMES,
    REJECT,
    Policy,
    PolicyError,
    PolicyOption,
    PushDecision,
)
from psgd.policy.local import LocalPolicy
from psgd.policy.ssp import SSPPolicy
from psgd.policy.sync import SyncPolicy

__all__ = [
    "Policy",
    "PolicyOption",
    "PushDecision",
    "PolicyError",
    "SyncPolicy",
    "AsyncPolicy",
    "SSPPolicy",
    "LocalPolicy",
    "POLICIES",
    "make_policy",
    "policy_from_cluster",
    "APPLY",
    "ACCUMULATE",
    "DUPLICATE",
    "LATE",
    "REJECT",
    "ACTIONS",
    "OUTCOMES",
    "OUTCOME_COUNTERS",
]

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (SyncPolicy, AsyncPolicy, SSPPolicy, LocalPolicy)}


def make_policy(name: str, num_workers: int, **options: Any) -> Policy:
    """Build the policy ``name`` (a key of :data:`POLICIES`) for ``num_workers`` workers."""
    if not isinstance(name, str) or name not in POLICIES:
        raise PolicyError(f"unknown policy {name!r}: use one of {', '.join(POLICIES)}")
    cls = POLICIES[name]
    takes_text = ", ".join(o.name for o in cls.options) or "none"
    unknown = sorted(set(options) - {o.name for o in cls.options})
    if unknown:
        raise PolicyError(f"policy {name!r}: unknown option(s) {', '.join(unknown)} (options it takes: {takes_text})")
    missing = [o.name for o in cls.options if o.required and o.name not in options]
    if missing:
        raise PolicyError(f"policy {name!r} needs the option(s) {', '.join(missing)} (options it takes: {takes_text})")
    return cls(num_workers, **options)


def policy_from_cluster(cluster: Any) -> Policy:
    """The policy a job's ``[cluster]`` section names (``cluster.policy``), for ``cluster.workers``
    workers, each option read from its ``cluster_key`` in ``cluster.consistency``."""
    cls = POLICIES.get(cluster.policy) if isinstance(cluster.policy, str) else None
    options = {o.name: getattr(cluster.consistency, o.cluster_key) for o in cls.options} if cls else {}
    return make_policy(cluster.policy, cluster.workers, **options)
