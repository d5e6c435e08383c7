"""Consistency policies: pure state machines that decide when pushes apply and pulls answer.

``make_policy("sync", 4, backup_workers=1)``, ``make_policy("async", 4)``,
``make_policy("ssp", 4, staleness=2)``.  Every misconfiguration is a one-line
:class:`PolicyError` (a ``ValueError``).  See :mod:`psgd.policy.base` for the
events, the decisions and the clock convention.
"""

from __future__ import annotations

from typing import Any

from psgd.policy.asynchronous import AsyncPolicy
from psgd.policy.base import (
    ACCUMULATE, ACTIONS, APPLY, DUPLICATE, LATE, REJECT, Policy, PolicyError, PushDecision,
)
from psgd.policy.ssp import SSPPolicy
from psgd.policy.sync import SyncPolicy

__all__ = [
    "Policy", "PushDecision", "PolicyError", "SyncPolicy", "AsyncPolicy", "SSPPolicy",
    "POLICIES", "POLICY_OPTIONS", "make_policy",
    "APPLY", "ACCUMULATE", "DUPLICATE", "LATE", "REJECT", "ACTIONS",
]

POLICIES: dict[str, type[Policy]] = {"sync": SyncPolicy, "async": AsyncPolicy, "ssp": SSPPolicy}

# The options each policy takes, and which of them must be given.
POLICY_OPTIONS: dict[str, tuple[str, ...]] = {"sync": ("backup_workers",), "async": (), "ssp": ("staleness",)}
_REQUIRED: dict[str, tuple[str, ...]] = {"sync": (), "async": (), "ssp": ("staleness",)}


def make_policy(name: str, num_workers: int, **options: Any) -> Policy:
    """Build the policy ``name`` (sync, async or ssp) for ``num_workers`` workers."""
    if not isinstance(name, str) or name not in POLICIES:
        raise PolicyError(f"unknown policy {name!r}: use one of {', '.join(POLICIES)}")
    takes = POLICY_OPTIONS[name]
    takes_text = ", ".join(takes) if takes else "none"
    unknown = sorted(set(options) - set(takes))
    if unknown:
        raise PolicyError(f"policy {name!r}: unknown option(s) {', '.join(unknown)} (options it takes: {takes_text})")
    missing = [k for k in _REQUIRED[name] if k not in options]
    if missing:
        raise PolicyError(f"policy {name!r} needs the option(s) {', '.join(missing)} (options it takes: {takes_text})")
    return POLICIES[name](num_workers, **options)
