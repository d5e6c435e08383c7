"""requirements.lock keeps up with pyproject.toml: every requirement of psgd and of the extras it
locks is pinned there, at a version the requirement allows (a dependency added or raised without
refreshing the lock fails here, not on a user's machine)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements.lock"
LOCKED_EXTRAS = ("dev", "mpi", "cuda12")  # the lock's command at its top names these


def pins() -> dict[str, list[tuple[str, Marker | None]]]:
    """Each locked package's versions, with the marker under which each applies."""
    out: dict[str, list[tuple[str, Marker | None]]] = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        spec, _, marker = line.partition(";")
        name, _, version = spec.partition("==")
        assert version, f"requirements.lock: {line!r} is not an exact pin"
        out.setdefault(canonicalize_name(name.strip()), []).append(
            (version.strip(), Marker(marker) if marker.strip() else None)
        )
    return out


def test_the_lock_says_how_it_is_refreshed_and_which_extras_it_holds():
    head = LOCK.read_text().splitlines()[:2]
    assert head[1].lstrip("# ").startswith("uv pip compile pyproject.toml"), head
    named = re.findall(r"--extra (\S+)", head[1])
    assert sorted(named) == sorted(LOCKED_EXTRAS), named


def test_every_requirement_is_pinned_at_a_version_it_allows():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    for extra in LOCKED_EXTRAS:
        wanted += [Requirement(r) for r in project["optional-dependencies"][extra]]
    locked = pins()
    for python in ("3.11", "3.12", "3.13"):
        where = {
            "python_version": python,
            "python_full_version": python + ".0",
            "sys_platform": "linux",
            "platform_machine": "x86_64",
            "platform_system": "Linux",
            "implementation_name": "cpython",
        }
        for req in wanted:
            name = canonicalize_name(req.name)
            assert name in locked, f"requirements.lock does not pin {req.name}: refresh it (its first lines)"
            versions = [v for v, marker in locked[name] if marker is None or marker.evaluate(where)]
            assert len(versions) == 1, f"{req.name} on Python {python}: {versions}"
            assert req.specifier.contains(versions[0], prereleases=True), (
                f"requirements.lock pins {req.name}=={versions[0]}, which {req} does not allow: refresh it"
            )
