"""deploy/elastic/ checked without Docker or a cluster: the job with a range of workers, the compose overlay whose
"worker" service is scaled with ``--scale worker=N`` and the Kubernetes component whose Deployment is scaled with
``kubectl scale``, each worker a real psgd-worker --rank auto of that job, and the docs' commands the files' own."""

from __future__ import annotations

import yaml
from test_deploy_static import (
    CONTAINER_JOB,
    DEPLOY,
    JOB_FILE,
    built_with_component,
    compose,
    container_argv,
    job_of,
    parse_cli,
    pod_checks,
)

from psgd.cli.common import job_from_args
from psgd.config import JobConfig
from psgd.export.shards import job_plan
from psgd.job import fingerprint, identity

ELASTIC_JOB = DEPLOY / "elastic" / "job.toml"
DOCS = DEPLOY.parent / "docs" / "howto" / "elastic.md"


def test_the_elastic_job_is_the_deploy_job_with_a_range():
    base, job = JobConfig.load(JOB_FILE), JobConfig.load(ELASTIC_JOB)
    c = job.cluster
    assert (c.fewest, c.workers, c.elastic) == (2, 4, True)
    assert (job.model, job.data, job.optimizer, job.train) == (base.model, base.data, base.optimizer, base.train)
    assert (c.policy, c.shards, c.servers) == (base.cluster.policy, base.cluster.shards, base.cluster.servers)


def test_compose_overlay_runs_a_scalable_worker_that_takes_its_rank():
    base = compose("compose.yaml")["services"]
    over = compose("elastic/compose.yaml")["services"]
    for name, svc in base.items():  # every process that reads the job reads the elastic job, or is not started
        if any(m.endswith(f":{CONTAINER_JOB}:ro") for m in svc.get("volumes", [])):
            assert f"./elastic/job.toml:{CONTAINER_JOB}:ro" in over[name].get("volumes", []) or over[name].get(
                "profiles"
            ), name
    assert over["worker-0"]["profiles"] == over["worker-1"]["profiles"] == ["fixed"]
    worker = over["worker"]
    args = parse_cli(worker["command"], "elastic/compose.yaml worker")
    ran = job_of(args, "elastic/compose.yaml worker", ELASTIC_JOB)
    assert args.rank == "auto" and "ports" not in worker, "a scaled service publishes no port of its own"
    assert args.servers == base["worker-0"]["command"][base["worker-0"]["command"].index("--servers") + 1]
    assert set(worker["depends_on"]) == {"shard-0", "shard-1"} and worker["restart"] == "on-failure"
    prints = {fingerprint(identity(ran, job_plan(ran).hash))}
    for name in ("shard-0", "shard-1"):
        shard = parse_cli(base[name]["command"], name)
        shard.config = str(ELASTIC_JOB)
        shard_job = job_from_args(shard)
        prints.add(fingerprint(identity(shard_job, job_plan(shard_job).hash)))
    assert len(prints) == 1, "the shards and the workers run one job"


def test_kubernetes_component_runs_the_workers_as_a_scalable_deployment(tmp_path):
    component = yaml.safe_load((DEPLOY / "elastic" / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    assert "# components: [elastic]" in (DEPLOY / "kustomization.yaml").read_text()
    (deployment,) = [
        d for r in component["resources"] for d in yaml.safe_load_all((DEPLOY / "elastic" / r).read_text())
    ]
    assert deployment["kind"] == "Deployment" and deployment["metadata"]["name"] == "psgd-workers"
    job = JobConfig.load(ELASTIC_JOB)
    assert deployment["spec"]["replicas"] == job.cluster.fewest
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    pod_checks(pod["spec"], "Deployment", {"configmap": "psgd-job", "secret": "psgd-token"})
    (container,) = pod["spec"]["containers"]
    args = parse_cli(container_argv(container, "Deployment worker"), "Deployment worker")
    job_of(args, "Deployment worker", ELASTIC_JOB)
    assert args.rank == "auto" and args.servers == "shard-0.psgd-shards:50051,shard-1.psgd-shards:50051"
    (generator,) = component["configMapGenerator"]
    assert generator["behavior"] == "replace" and generator["files"] == ["job.toml"]
    (patch,) = component["patches"]
    deleted = yaml.safe_load(patch["patch"])
    assert (deleted["$patch"], deleted["kind"], deleted["metadata"]["name"]) == ("delete", "Job", "psgd-workers")
    built = built_with_component("elastic", tmp_path)
    if built is None:  # no kubectl here: the files' own checks above stand
        return
    kinds = {(d["kind"], d["metadata"]["name"]) for d in built}
    assert ("Deployment", "psgd-workers") in kinds and ("Job", "psgd-workers") not in kinds
    (config,) = [d for d in built if d["kind"] == "ConfigMap"]
    assert 'workers = "2:4"' in config["data"]["job.toml"]


def test_the_docs_scale_the_files_that_are_here():
    """docs/howto/elastic.md's commands name the files, services and Deployment deploy/elastic/ has."""
    text = DOCS.read_text()
    for command in (
        "docker compose -f compose.yaml -f elastic/compose.yaml up --build --scale worker=2",
        "docker compose -f compose.yaml -f elastic/compose.yaml up -d --no-recreate --scale worker=4 worker",
        "kubectl -n psgd scale deployment/psgd-workers --replicas=4",
        "psgd-worker -c job.toml --rank auto",
        "psgd scale",
    ):
        assert command in text, command
    assert command_in_file("elastic/compose.yaml", "--scale worker=4 worker")
    assert command_in_file("elastic/workers.yaml", "kubectl -n psgd scale deployment/psgd-workers --replicas=4")


def command_in_file(name: str, command: str) -> bool:
    return command in (DEPLOY / name).read_text()
