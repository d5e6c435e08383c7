"""Fixtures of the docker tests: the locally made base image, a copy of the repository to build
from (with its own deploy/psgd.env, as the README tells users to make), and the psgd image built
from it with ``docker compose build``, removed when the session ends."""

from __future__ import annotations

import secrets

import dockerlab
import pytest


@pytest.fixture(scope="session")
def docker_base() -> str:
    return dockerlab.base_image()


@pytest.fixture(scope="session")
def repo_copy(tmp_path_factory):
    """A copy of the working tree's build inputs; ``deploy/psgd.env`` holds a fresh token."""
    root = dockerlab.copy_repository(tmp_path_factory.mktemp("repo"))
    (root / "deploy" / "psgd.env").write_text(f"PSGD_TOKEN={secrets.token_urlsafe(32)}\n")
    return root


@pytest.fixture(scope="session")
def psgd_image(docker_base, repo_copy):
    """``docker compose build`` of deploy/compose.yaml in the copy, tagged for this session."""
    tag = f"{dockerlab.unique('psgd-test')}:cpu"
    builder = dockerlab.Project(repo_copy / "deploy", dockerlab.unique("psgd-build"), {"PSGD_IMAGE": tag})
    try:
        builder("build", "--build-arg", f"BASE={docker_base}", "shard-0", timeout=900)  # one image serves all
        yield tag
    finally:
        dockerlab.run(["docker", "image", "rm", "-f", tag], timeout=120, check=False)
