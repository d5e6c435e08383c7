"""deploy/replicas/ checked without Docker or a cluster: a replica of every shard in the compose overlay, the
Kubernetes component and the Slurm script's REPLICAS=1, each a real psgd-server --replica of the async job file
with replicas = 1, placed away from its shard, and every process told where the replicas are."""

from __future__ import annotations

import yaml
from test_deploy_static import (
    CONTAINER_JOB,
    DEPLOY,
    JOB_FILE,
    SLURM_SAMPLES,
    built_with_component,
    compose,
    container_argv,
    flag,
    job_of,
    parse_cli,
    slurm_commands,
)

from psgd.config import JobConfig
from psgd.export.shards import job_plan
from psgd.job import fingerprint, identity

REPLICA_JOB = DEPLOY / "replicas" / "job.toml"


def test_the_replicas_job_is_the_deploy_job_kept_twice_under_async():
    base, job = JobConfig.load(JOB_FILE), JobConfig.load(REPLICA_JOB)
    c = job.cluster
    assert (c.policy, c.recovery.replicas, c.cut_rounds) == ("async", 1, 0)
    assert len(c.recovery.replica_servers) == c.shards and not set(c.recovery.replica_servers) & set(c.servers)
    assert (job.model, job.data, job.optimizer, job.train) == (base.model, base.data, base.optimizer, base.train)
    assert c.servers == base.cluster.servers and (c.shards, c.workers) == (base.cluster.shards, base.cluster.workers)


def test_compose_overlay_runs_a_replica_of_every_shard():
    base = compose("compose.yaml")["services"]
    over = compose("replicas/compose.yaml")["services"]
    job = JobConfig.load(REPLICA_JOB)
    for name, svc in base.items():  # every process that reads the job reads the replicas' job
        if any(m.endswith(f":{CONTAINER_JOB}:ro") for m in svc.get("volumes", [])):
            assert f"./replicas/job.toml:{CONTAINER_JOB}:ro" in over[name]["volumes"], name
    for k, address in enumerate(job.cluster.recovery.replica_servers):
        svc = over[f"replica-{k}"]
        where = f"replicas/compose.yaml replica-{k}"
        args = parse_cli(svc["command"], where)
        ran = job_of(args, where, REPLICA_JOB)
        port = int(address.rsplit(":", 1)[1])
        assert (args.shard, args.replica, args.bind) == (k, True, f"0.0.0.0:{port}"), where
        assert address.startswith(f"replica-{k}:") and ran.cluster.recovery.replicas == 1
        published = {p.rsplit(":", 1)[1] for p in svc["ports"]}
        assert published == {str(port), str(port + 1)}, f"{where}: its gRPC and data ports"
        assert svc["healthcheck"]["test"][-1] == f"127.0.0.1:{port}"
        assert args.exit_when_done and args.checkpoint_dir, f"{where}: ends with the job, checkpoints while leading"
        assert set(over["result"]["depends_on"]) >= {f"replica-{k}"}, "the result waits for the replicas too"
        for mount in svc["volumes"]:
            source = mount.split(":")[0]
            assert not source.startswith(".") or (DEPLOY / source).exists(), f"{where}: {source}"


def test_kubernetes_component_adds_replicas_off_the_shards_nodes(tmp_path):
    component = yaml.safe_load((DEPLOY / "replicas" / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    assert "# components: [replicas]" in (DEPLOY / "kustomization.yaml").read_text()
    objects = {
        f"{d['kind']}/{d['metadata']['name']}": d
        for r in component["resources"]
        for d in yaml.safe_load_all((DEPLOY / "replicas" / r).read_text())
    }
    sts, svc = objects["StatefulSet/replica"], objects["Service/psgd-replicas"]
    job = JobConfig.load(REPLICA_JOB)
    assert sts["spec"]["replicas"] == job.cluster.shards and sts["spec"]["serviceName"] == "psgd-replicas"
    assert svc["spec"]["clusterIP"] == "None"
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = parse_cli(container_argv(container, "StatefulSet replica"), "StatefulSet replica")
    ran = job_of(args, "StatefulSet replica", REPLICA_JOB)
    assert args.replica and list(ran.cluster.recovery.replica_servers) == [
        f"replica-{k}.psgd-replicas:50051" for k in range(job.cluster.shards)
    ]
    assert list(ran.cluster.servers) == [f"shard-{k}.psgd-shards:50051" for k in range(job.cluster.shards)]
    (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == {"app.kubernetes.io/component": "shard"}
    (generator,) = component["configMapGenerator"]
    assert generator["behavior"] == "replace" and generator["files"] == ["job.toml"]
    patched = {p["target"]["name"]: [op["value"] for op in yaml.safe_load(p["patch"])] for p in component["patches"]}
    for target in ("shard", "psgd-workers"):
        assert flag(patched[target], "--replica-servers") == ",".join(ran.cluster.recovery.replica_servers), target
    built = built_with_component("replicas", tmp_path)
    if built is None:  # no kubectl here: the files' own checks above stand
        return
    kinds = {(d["kind"], d["metadata"]["name"]) for d in built}
    assert ("StatefulSet", "replica") in kinds and ("StatefulSet", "shard") in kinds
    (config,) = [d for d in built if d["kind"] == "ConfigMap"]
    assert "replicas = 1" in config["data"]["job.toml"]


def test_slurm_replicas_run_beside_the_next_shard_with_one_job_fingerprint():
    text = (DEPLOY / "slurm" / "psgd.sbatch").read_text()
    assert 'REPLICA_SERVERS+="${REPLICA_SERVERS:+,}${NODES[$(( (k + 1) % SHARDS ))]}:$REPLICA_PORT"' in text
    samples = {
        **SLURM_SAMPLES,
        "JOB_FILE": ["deploy/replicas/job.toml"],
        "REPLICA_FLAGS[@]": ["--replicas", "1", "--replica-servers", "node2:50061,node1:50061"],
    }
    commands = slurm_commands(text, samples)
    servers = [argv for argv in commands if argv[0] == "psgd-server"]
    assert [("--replica" in argv) for argv in servers] == [False, True], "a shard's line and a replica's line"
    prints = set()
    for argv in commands:
        args = parse_cli(argv, "psgd.sbatch")
        if argv[0] in ("psgd-server", "psgd-worker"):
            ran = job_of(args, "psgd.sbatch", REPLICA_JOB)
            assert list(ran.cluster.recovery.replica_servers) == ["node2:50061", "node1:50061"], argv
            prints.add(fingerprint(identity(ran, job_plan(ran).hash)))
    assert len(prints) == 1
