"""deploy/ checked without Docker or a cluster: every file parses, every command in it is a real psgd
invocation (parsed by the argparse parser of the command it runs, its job file loaded with its overrides),
every file it mounts or copies exists, and the pieces agree with each other and with the job file."""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml  # the dev extra: it reads the compose file and the manifests

from psgd.cli import main as psgd_main
from psgd.cli import server as psgd_server
from psgd.cli import worker as psgd_worker
from psgd.cli.common import RANK_VARIABLES, job_from_args
from psgd.config import JobConfig
from psgd.export.shards import job_plan
from psgd.job import fingerprint, identity

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
JOB_FILE = DEPLOY / "job.toml"
CONTAINER_JOB = "/etc/psgd/job.toml"
PARSERS = {
    "psgd-server": psgd_server.build_parser,
    "psgd-worker": psgd_worker.build_parser,
    "psgd": psgd_main.build_parser,
}


# -- helpers ---------------------------------------------------------------------------------------
def parse_cli(argv: list[str], where: str) -> argparse.Namespace:
    """Parse ``argv`` with the real parser of the psgd command it runs; fail with argparse's own words."""
    assert argv and argv[0] in PARSERS, f"{where}: {argv[:1]} is not a psgd command ({', '.join(PARSERS)})"
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            return PARSERS[argv[0]]().parse_args(argv[1:])
    except SystemExit as exc:
        if exc.code == 0 and argv[-1] in ("--help", "-h") and "usage:" in out.getvalue():
            return argparse.Namespace(help=True)
        pytest.fail(f"{where}: `{shlex.join(argv)}` does not parse:\n{err.getvalue().strip()}", pytrace=False)


def job_of(args: argparse.Namespace, where: str, path: Path = JOB_FILE) -> JobConfig:
    """The job a parsed command would run: its job file (the container path mapped to ``path``, by default
    deploy/job.toml) with its command-line overrides applied."""
    shown = str(path.relative_to(REPO))
    if getattr(args, "config", None) in (CONTAINER_JOB, shown):
        args.config = str(path)
    assert args.config == str(path), f"{where}: reads {args.config}, not {shown}"
    return job_from_args(args)


def interpolate(text: str, where: str) -> str:
    """docker compose's ``${VAR:-default}`` with every variable unset (the defaults must make sense)."""

    def one(m: re.Match) -> str:
        if m.group(2) is None:
            pytest.fail(f"{where}: ${{{m.group(1)}}} has no default", pytrace=False)
        return m.group(2)

    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", one, text)


def deep_interpolate(node, where: str):
    if isinstance(node, str):
        return interpolate(node, where)
    if isinstance(node, list):
        return [deep_interpolate(v, where) for v in node]
    if isinstance(node, dict):
        return {k: deep_interpolate(v, where) for k, v in node.items()}
    return node


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def gitignored(path: Path) -> bool:
    ignore = path.parent / ".gitignore"
    return ignore.exists() and path.name in ignore.read_text().split()


def env_file_ok(path: Path) -> bool:
    """The token file exists, or its example does and the real one is kept out of git."""
    example = path.with_name(path.name + ".example")
    return path.exists() or (example.exists() and gitignored(path))


def dockerignore_keeps(patterns: list[str], path: str) -> bool:
    """Whether a file is sent in the build context under .dockerignore ``patterns`` (last match wins)."""
    keep = True
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        hit = any(fnmatch.fnmatch(p, pat) for p in prefixes)
        if pat.startswith("**/"):
            hit = hit or any(fnmatch.fnmatch(part, pat[3:]) for part in parts)
        if hit:
            keep = negate
    return keep


@pytest.fixture(scope="module")
def job() -> JobConfig:
    return JobConfig.load(JOB_FILE)


# -- images ----------------------------------------------------------------------------------------
def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        if raw.lstrip().startswith("#") and not current:
            continue
        current += raw.rstrip("\\").strip() + " " if raw.endswith("\\") else raw.strip()
        if raw.endswith("\\"):
            continue
        if current.strip():
            word, _, rest = current.strip().partition(" ")
            lines.append((word.upper(), rest.strip()))
        current = ""
    return lines


@pytest.mark.parametrize("name, extra", [("Dockerfile", None), ("Dockerfile.cuda", "cupy-cuda12x")])
def test_images_are_pinned_small_non_root_and_health_checked(name, extra):
    path = DEPLOY / name
    steps = dockerfile_instructions(path)
    args = {}
    for word, rest in steps:
        if word == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key] = value
    froms = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest.split()[0]) for w, rest in steps if w == "FROM"]
    assert len(froms) >= 2, f"{name}: a build stage and a runtime stage"
    for image in froms:
        repo, _, tag = image.partition("@")[0].partition(":")
        assert "@sha256:" in image or re.search(r"\d+\.\d+\.\d+", tag), (
            f"{name}: base {image} is not pinned to a patch release or digest"
        )
    final = max(i for i, (w, _) in enumerate(steps) if w == "FROM")
    users = [rest for w, rest in steps[final:] if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), f"{name}: the image must run as a non-root user"
    assert users[-1].split(":")[0].isdigit(), f"{name}: USER by number, so Kubernetes' runAsNonRoot can check it"

    health = [rest for w, rest in steps if w == "HEALTHCHECK"]
    assert len(health) == 1, f"{name}: one HEALTHCHECK"
    argv = json.loads(health[0].partition(" CMD ")[2])
    parsed = parse_cli(argv, f"{name} HEALTHCHECK")
    assert parsed.command == "doctor" and parsed.health is not None  # the gRPC health service of the shard
    assert "PSGD_HEALTH_ADDRESS=" in " ".join(rest for w, rest in steps if w == "ENV")
    cmd = [rest for w, rest in steps if w == "CMD"]
    parse_cli(json.loads(cmd[-1]), f"{name} CMD")
    exposed = " ".join(rest for w, rest in steps if w == "EXPOSE").split()
    assert {"50051", "50052", "9100"} <= set(exposed)

    # the build context: only what is needed, and everything copied is there and sent
    ignore = path.with_name(name + ".dockerignore")
    assert ignore.exists(), f"{name}: no {ignore.name} beside it"
    patterns = [p.strip() for p in ignore.read_text().splitlines() if p.strip() and not p.startswith("#")]
    for w, rest in steps:
        if w == "COPY" and "--from=" not in rest:
            *sources, _dest = [p for p in rest.split() if not p.startswith("--")]
            for src in sources:
                assert (REPO / src).exists(), f"{name}: COPY {src}: no such file in the repository"
                files = (
                    [src]
                    if (REPO / src).is_file()
                    else [
                        str(p.relative_to(REPO))
                        for p in (REPO / src).rglob("*")
                        if p.is_file() and "__pycache__" not in p.parts
                    ]
                )
                for f in files:
                    assert dockerignore_keeps(patterns, f), f"{name}: {f} is copied but {ignore.name} leaves it out"
    for needed in ("psgd/cli/main.py", "psgd/proto/ps_pb2.py", "psgd/data/digits.csv.gz", "pyproject.toml"):
        assert dockerignore_keeps(patterns, needed), needed
    for unneeded in ("tests/conftest.py", ".git/config", "benchmarks/comm.py", "deploy/psgd.env"):
        assert not dockerignore_keeps(patterns, unneeded), unneeded

    # reproducible: every dependency (and the CUDA extra) installed under exact pins
    text = path.read_text()
    assert "--constraint requirements.lock" in text
    pins = {
        line.split("==")[0].strip().lower(): line.split("==")[1].strip()
        for line in (REPO / "requirements.lock").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [re.split(r"[<>=!~; \[]", d)[0].lower() for d in project["dependencies"]]
    wanted += [extra] if extra else []
    for dep in wanted:
        assert dep in pins, f"requirements.lock does not pin {dep}"


# -- docker compose --------------------------------------------------------------------------------
def compose(name: str) -> dict:
    doc = yaml.safe_load((DEPLOY / name).read_text())
    return deep_interpolate(doc, name)


def merged_services() -> dict[str, dict]:
    """compose.yaml with compose.gpu.yaml over it (top-level keys of a service replaced)."""
    base, gpu = compose("compose.yaml")["services"], compose("compose.gpu.yaml")["services"]
    return {name: {**svc, **gpu.get(name, {})} for name, svc in base.items()}


def test_compose_runs_every_shard_and_worker_of_the_job_file(job):
    doc = compose("compose.yaml")
    services = doc["services"]
    networks = set(doc["networks"])
    volumes = set(doc.get("volumes") or {})
    # no fixed network name: two projects (docker compose -p) must be able to run side by side
    assert networks == {"psgd"} and "name" not in doc["networks"]["psgd"]

    shards, workers, results = {}, {}, {}
    for name, svc in services.items():
        where = f"compose.yaml service {name}"
        assert set(svc["networks"]) <= networks and svc["networks"], f"{where}: not on the named network"
        for mount in svc.get("volumes", []):
            source, target, *mode = mount.split(":")
            if source.startswith((".", "/")):
                assert (DEPLOY / source).exists(), f"{where}: mounts {source}, which does not exist"
                assert mode == ["ro"], f"{where}: {source} should be mounted read-only"
            else:
                assert source in volumes, f"{where}: volume {source} is not declared"
        if "env_file" in svc:
            assert env_file_ok(DEPLOY / svc["env_file"]), f"{where}: env file {svc['env_file']} (or its .example)"
        if "build" in svc:
            assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).exists()
        argv = svc.get("command")
        if argv and argv[:2] == ["sh", "-c"]:
            results[name] = [parse_cli(shlex.split(part), f"{where}: {part.strip()}") for part in argv[2].split("&&")]
            continue
        if not argv or argv[0] not in PARSERS:
            continue
        args = parse_cli(argv, where)
        ran = job_of(args, where)
        assert "./job.toml:/etc/psgd/job.toml:ro" in svc["volumes"], f"{where}: the job file is not mounted"
        assert svc["env_file"] == "psgd.env", f"{where}: the token comes from the env file"
        test = svc.get("healthcheck", {}).get("test")
        if test and not svc["healthcheck"].get("disable"):
            assert test[0] == "CMD"
            parse_cli(test[1:], f"{where} healthcheck")
        # four processes on one machine: left to the default, each one's BLAS pool would take every core
        assert ran.train.threads == 1, f"{where}: give each process its share of the cores (--threads)"
        if argv[0] == "psgd-server":
            shards[args.shard] = (name, svc, args, ran)
        elif argv[0] == "psgd-worker":
            workers[args.rank] = (name, svc, args, ran)

    c = job.cluster
    assert sorted(shards) == list(range(c.shards)) and sorted(workers) == list(range(c.workers))
    for k, (name, svc, args, ran) in shards.items():
        host, port = args.bind.rsplit(":", 1)
        assert host == "0.0.0.0", f"{name}: must listen beyond the container's loopback"
        assert c.servers[k] == f"{name}:{port}", (
            f"job.toml lists shard {k} as {c.servers[k]}, compose runs it as {name}:{port}"
        )
        published = {p.split(":", 1)[1] for p in svc["ports"]}
        assert {f"{port}:{port}", f"{int(port) + 1}:{int(port) + 1}"} <= published, (
            f"{name}: publish the gRPC and data ports on the same numbers (the data port travels in Register)"
        )
        assert svc["restart"] in ("always", "unless-stopped", "on-failure"), f"{name}: a killed shard must come back"
        checkpoint = args.checkpoint_dir
        state = [m.split(":") for m in svc["volumes"] if m.split(":")[0] in volumes]
        assert any(checkpoint.startswith(target) for _, target, *_ in state), (
            f"{name}: --checkpoint-dir {checkpoint} is not on a named volume, so a restart would lose it"
        )
        assert svc["healthcheck"]["test"][-1] == f"127.0.0.1:{port}", f"{name}: health check of another port"
        assert ran.cluster.shards == c.shards and ran.cluster.workers == c.workers
    for r, (name, svc, args, ran) in workers.items():
        assert ran.cluster.servers == c.servers, f"{name}: by default the workers use the job file's shards"
        assert svc["restart"] in ("always", "on-failure"), f"{name}: a failed worker must rejoin"
        assert {d: v["condition"] for d, v in svc["depends_on"].items()} == {
            shards[k][0]: "service_healthy" for k in shards
        }

    # the result service joins the checkpoints the shards write, once every shard has finished
    assert list(results) == ["result"]
    export, evaluate = results["result"]
    assert export.checkpoints == shards[0][2].checkpoint_dir and export.file == evaluate.file
    assert {d: v["condition"] for d, v in services["result"]["depends_on"].items()} == {
        shards[k][0]: "service_completed_successfully" for k in shards
    }
    for k, (name, svc, args, ran) in shards.items():
        assert args.exit_when_done and svc["restart"] == "on-failure", (
            f"{name}: must end with the job (exit 0, not restarted) for the result service to run"
        )

    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {t for sc in prometheus["scrape_configs"] for s in sc["static_configs"] for t in s["targets"]}
    expected = set()
    for name, svc, args, _ in [*shards.values(), *workers.values()]:
        port = args.metrics_port.rsplit(":", 1)[1]
        expected.add(f"{name}:{port}")
    assert targets == expected


def test_compose_gpu_variant_reserves_a_gpu_per_worker(job):
    services = merged_services()
    gpu = compose("compose.gpu.yaml")["services"]
    assert set(gpu) == {f"worker-{r}" for r in range(job.cluster.workers)}
    for name in gpu:
        svc = services[name]
        args = parse_cli(svc["command"], f"compose.gpu.yaml {name}")
        ran = job_of(args, name)
        assert ran.train.device.startswith("cuda") and ran.cluster.servers == job.cluster.servers
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile.cuda" and (REPO / svc["build"]["dockerfile"]).exists()
        assert svc["image"] == "psgd:cuda"
        base = compose("compose.yaml")["services"][name]
        assert svc["command"][:5] == base["command"][:5], "same worker, same rank"


# -- Kubernetes ------------------------------------------------------------------------------------
def manifests() -> tuple[dict, dict[str, dict]]:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    objects = {}
    for resource in kustomization["resources"]:
        path = DEPLOY / resource
        assert path.exists(), f"kustomization.yaml: {resource} does not exist"
        for doc in yaml.safe_load_all(path.read_text()):
            objects[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return kustomization, objects


def built_with_component(name: str, tmp_path: Path) -> list[dict] | None:
    """``kubectl kustomize`` of deploy/ with its component ``name`` switched on, in a copy (kustomize reads the token
    file too): the objects it makes; None where kubectl is not installed."""
    if shutil.which("kubectl") is None:
        return None
    copy = Path(shutil.copytree(DEPLOY, tmp_path / "deploy"))
    (copy / "psgd.env").write_text("PSGD_TOKEN=sample-token-of-the-job\n")
    base = copy / "kustomization.yaml"
    base.write_text(base.read_text().replace(f"# components: [{name}]", f"components: [{name}]"))
    done = subprocess.run(["kubectl", "kustomize", str(copy)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return list(yaml.safe_load_all(done.stdout))


def container_argv(container: dict, where: str, injected: set[str] = frozenset()) -> list[str]:
    """``command + args`` with Kubernetes' ``$(VAR)`` expanded from the container's env (sample values)."""
    defined = {e["name"] for e in container.get("env", [])} | set(injected)
    samples = {"SHARD": "0", "JOB_COMPLETION_INDEX": "0"}
    argv = [*container.get("command", []), *container.get("args", [])]

    def one(m: re.Match) -> str:
        assert m.group(1) in defined, f"{where}: $({m.group(1)}) is not defined in the container's env"
        return samples[m.group(1)]

    return [re.sub(r"\$\((\w+)\)", one, str(a)) for a in argv]


def pod_checks(spec: dict, where: str, generators: dict[str, str]) -> None:
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert spec["securityContext"]["runAsNonRoot"] is True, f"{where}: run as non-root"
    for container in spec.get("initContainers", []) + spec["containers"]:
        assert container["image"] == "psgd:cpu", f"{where}: the compose demo's image"
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in volumes or mount["name"] in generators.get("claims", ""), (
                f"{where}: mounts {mount['name']}, which is no volume"
            )
        for source in container.get("envFrom", []):
            assert source["secretRef"]["name"] == generators["secret"], f"{where}: the token Secret"
        for probe in ("readinessProbe", "livenessProbe"):
            if "exec" in container.get(probe, {}):
                parse_cli(container[probe]["exec"]["command"], f"{where} {probe}")
    job_volume = [v for v in volumes.values() if "configMap" in v]
    assert job_volume and job_volume[0]["configMap"]["name"] == generators["configmap"]


def test_kubernetes_statefulset_shards_and_indexed_job_workers(job):
    kustomization, objects = manifests()
    (configmap,) = kustomization["configMapGenerator"]
    (secret,) = kustomization["secretGenerator"]
    assert [DEPLOY / f for f in configmap["files"]] == [JOB_FILE], "the ConfigMap holds the same job file"
    for env in secret["envs"]:
        assert env_file_ok(DEPLOY / env), f"kustomization.yaml: {env} (or its .example)"
    generators = {"configmap": configmap["name"], "secret": secret["name"]}
    c = job.cluster

    services = [o for o in objects.values() if o["kind"] == "Service"]
    (sts,) = [o for o in objects.values() if o["kind"] == "StatefulSet"]
    (svc,) = [s for s in services if s["metadata"]["name"] == sts["spec"]["serviceName"]]
    assert svc["spec"]["clusterIP"] == "None", "a headless Service: one DNS name per shard"
    pod = sts["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert sts["spec"]["replicas"] == c.shards
    generators["claims"] = " ".join(t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", []))
    pod_checks(pod["spec"], "StatefulSet", generators)
    (shard,) = pod["spec"]["containers"]
    argv = container_argv(shard, "StatefulSet shard")
    args = parse_cli(argv, "StatefulSet shard")
    job_of(args, "StatefulSet shard")
    port = int(args.bind.rsplit(":", 1)[1])
    assert args.bind.startswith("0.0.0.0:")
    assert {p["port"] for p in svc["spec"]["ports"]} >= {port, port + 1}
    assert {p["containerPort"] for p in shard["ports"]} >= {port, port + 1}
    for probe in ("readinessProbe", "livenessProbe"):
        assert shard[probe]["grpc"] == {"port": port, "service": "psgd.v1.ParameterServer"}, probe
    state = [m["mountPath"] for m in shard["volumeMounts"] if m["name"] in generators["claims"].split()]
    assert any(args.checkpoint_dir.startswith(path) for path in state), "checkpoints on the shard's own volume"
    index = [e for e in shard["env"] if e["name"] == "PSGD_SHARD"][0]["valueFrom"]["fieldRef"]["fieldPath"]
    assert index == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert args.shard is None, "the shard index comes from PSGD_SHARD, which psgd-server reads"

    (work,) = [o for o in objects.values() if o["kind"] == "Job"]
    spec = work["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == c.workers
    assert spec["template"]["spec"]["restartPolicy"] == "OnFailure"
    pod_checks(spec["template"]["spec"], "Job", generators)
    expected = ",".join(f"{sts['metadata']['name']}-{k}.{svc['metadata']['name']}:{port}" for k in range(c.shards))
    for container in spec["template"]["spec"].get("initContainers", []) + spec["template"]["spec"]["containers"]:
        where = f"Job {container['name']}"
        args = parse_cli(container_argv(container, where, injected={"JOB_COMPLETION_INDEX"}), where)
        ran = job_of(args, where)
        assert args.servers == expected, f"{where}: --servers {args.servers}, the shards are {expected}"
        assert ran.cluster.shards == c.shards and ran.cluster.workers == c.workers
    (worker,) = spec["template"]["spec"]["containers"]
    assert "--rank" not in worker["args"] and "JOB_COMPLETION_INDEX" in RANK_VARIABLES, (
        "the Indexed Job's JOB_COMPLETION_INDEX is the worker's rank, read by psgd-worker itself"
    )
    assert kustomization["namespace"] == objects[f"Namespace/{kustomization['namespace']}"]["metadata"]["name"]


# -- Slurm -----------------------------------------------------------------------------------------
SLURM_SAMPLES = {
    "JOB_FILE": ["deploy/job.toml"],
    "k": ["0"],
    "r": ["0"],
    "SHARDS": ["2"],
    "WORKERS": ["3"],
    "PORT": ["50051"],
    "DATA_PORT": ["50052"],
    "DEVICE": ["cpu"],
    "CHECKPOINTS": ["/scratch/psgd"],
    "SERVERS": ["node1:50051,node2:50051"],
    "ADDRESSES[@]": ["node1:50051", "node2:50051"],
    "REPLICA_PORT": ["50061"],
    "REPLICA_DATA_PORT": ["50062"],
    "REPLICA_FLAGS[@]": [],
}


def slurm_commands(text: str, samples: dict[str, list[str]] = SLURM_SAMPLES) -> list[list[str]]:
    """Every psgd command line of the script, variables filled in with sample values."""
    joined = re.sub(r"\\\n\s*", " ", text)
    commands = []
    for line in joined.splitlines():
        if line.lstrip().startswith("#"):
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
        starts = [i for i, t in enumerate(tokens) if t in PARSERS]
        if not starts:
            continue
        argv = []
        for t in tokens[starts[0] :]:
            if t in (";", "&", "&&", "||", "|", ")"):
                break
            whole = re.fullmatch(r"\$\{(\w+\[@\])\}", t)
            if whole:  # an array: one argument per element
                argv += samples[whole.group(1)]
                continue

            def one(m: re.Match) -> str:
                name = m.group(1) or m.group(2)
                assert name in samples, f"psgd.sbatch: no sample value for ${name}"
                return samples[name][0]

            argv.append(re.sub(r"\$\{(\w+)\}|\$(\w+)", one, t))
        commands.append(argv)
    return commands


def test_slurm_script_is_valid_bash_and_runs_real_commands(job):
    path = DEPLOY / "slurm" / "psgd.sbatch"
    text = path.read_text()
    assert text.startswith("#!/bin/bash") and "#SBATCH --nodes=" in text
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    commands = slurm_commands(text)
    kinds = [argv[0] if argv[0] != "psgd" else f"psgd {argv[1]}" for argv in commands]
    assert sorted(set(kinds)) == [
        "psgd doctor",
        "psgd eval",
        "psgd export",
        "psgd status",
        "psgd-server",
        "psgd-worker",
    ], kinds
    fingerprints = {}
    for kind, argv in zip(kinds, commands):
        args = parse_cli(argv, "psgd.sbatch")
        if getattr(args, "config", None):
            ran = job_of(args, "psgd.sbatch")
            if "--servers" in argv:
                assert list(ran.cluster.servers) == ["node1:50051", "node2:50051"], f"{kind}: {ran.cluster.servers}"
            if kind != "psgd eval":  # the one command that reads only the model and the data
                assert ran.cluster.workers == 3, f"{kind}: {ran.cluster.workers} workers, not $WORKERS"
                fingerprints[kind] = fingerprint(identity(ran, job_plan(ran).hash))
    # psgd export finds the shards' checkpoints under the job fingerprint that they were written with
    assert len(set(fingerprints.values())) == 1, fingerprints
