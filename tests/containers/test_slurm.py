"""deploy/slurm/psgd.sbatch, as it is in the repository, submitted to a Slurm cluster of containers.

Slurm 22.05 of Debian bookworm runs in the psgd image built on a base with ``slurm-wlm`` and
``munge``: node1 runs slurmctld and slurmd, node2 to node4 slurmd, on a network of their own.  A
folder of the test is mounted at the same path in every node, as a cluster's shared filesystem is:
it holds slurm.conf, the munge key, the daemons' logs and the copy of the repository that the job
is submitted from and writes its output and checkpoints into.  The job trains a shorter copy of
deploy/job.toml (through JOB_FILE, a knob of the script) and must end with the test accuracy of
the model it saved.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from pathlib import Path

import dockerlab
import pytest

SLURM_PACKAGES = ("slurm-wlm", "munge")
NODES = ("node1", "node2", "node3", "node4")
CONTROLLER = NODES[0]
#: long enough to pass 0.9 test accuracy on the digits with room to spare, short to keep the test quick
EPOCHS = 10
#: Slurm's job states after which a job does not run again
ENDED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}

# Containers have no systemd, cgroup delegation or accounting database: processes are tracked by
# their parent chain, tasks are not bound, and the node's CPUs are what this file says (the four
# nodes share this machine's cores).
SLURM_CONF = """\
ClusterName=psgdtest
SlurmctldHost={controller}
SlurmUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile={logs}/slurmctld.log
SlurmdLogFile={logs}/slurmd-%n.log
NodeName={nodes} CPUs={cpus} State=UNKNOWN
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

# munged insists on a key that its own user owns and no one else can read, so each node installs
# the shared key for itself before starting it.
ENTRYPOINT = """\
#!/bin/bash
# one node of the test's Slurm cluster: munged with the cluster's key, slurmctld on the controller,
# then slurmd in the foreground
set -euo pipefail
shared=$(dirname "$0")
install -o munge -g munge -m 0400 "$shared/munge.key" /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
runuser -u munge -- munged
if [[ $1 == controller ]]; then
    slurmctld
fi
exec slurmd -D
"""


def compose_file(name: str, base: str, repo_copy: Path, shared: Path) -> dict:
    """Four nodes of the psgd image (built once, by node1) as root, with the shared folder mounted."""

    def node(hostname: str) -> dict:
        return {
            "image": f"{name}:cpu",
            "hostname": hostname,
            "user": "0",
            "working_dir": str(shared),
            "volumes": [f"{shared}:{shared}", f"{shared / 'slurm.conf'}:/etc/slurm/slurm.conf:ro"],
            "command": ["bash", str(shared / "entrypoint.sh"), "controller" if hostname == CONTROLLER else "compute"],
            "healthcheck": {"disable": True},
        }

    services = {host: node(host) for host in NODES}
    services[CONTROLLER]["build"] = {
        "context": str(repo_copy),
        "dockerfile": "deploy/Dockerfile",
        "args": {"BASE": base},
    }
    return {"services": services}


def job_fields(text: str) -> dict[str, str]:
    """``scontrol show job -o``'s KEY=VALUE fields."""
    return dict(field.split("=", 1) for field in text.split() if "=" in field)


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sbatch_script_trains_on_four_slurm_nodes_and_prints_the_accuracy(repo_copy: Path, tmp_path: Path):
    base = dockerlab.base_image(extra=SLURM_PACKAGES)
    name = dockerlab.unique("psgd-slurm")
    shared = tmp_path / "cluster"
    logs = shared / "logs"
    logs.mkdir(parents=True)
    repo = shutil.copytree(repo_copy, shared / "repo")
    (shared / "slurm.conf").write_text(
        SLURM_CONF.format(controller=CONTROLLER, logs=logs, nodes=",".join(NODES), cpus=os.cpu_count() or 1)
    )
    key = shared / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    (shared / "entrypoint.sh").write_text(ENTRYPOINT)
    job_file = shared / "job.toml"
    short, changed = re.subn(r"(?m)^epochs = \d+", f"epochs = {EPOCHS}", (repo / "deploy/job.toml").read_text())
    assert changed == 1, "deploy/job.toml has no `epochs = N` line to shorten"
    job_file.write_text(short)
    token = re.search(r"(?m)^PSGD_TOKEN=(\S+)", (repo / "deploy/psgd.env").read_text()).group(1)
    (tmp_path / "compose.yaml").write_text(json.dumps(compose_file(name, base, repo_copy, shared), indent=2))
    cluster = dockerlab.Project(tmp_path, name)

    def on_controller(*argv: str, timeout: float = 60, check: bool = True) -> str:
        return cluster("exec", "-T", CONTROLLER, *argv, timeout=timeout, check=check).stdout.decode()

    def explain(job_id: str | None = None) -> str:
        """The job's state and output and the daemons' logs, as far as there are any."""
        parts = [on_controller("sinfo", "-N", check=False)]
        if job_id:
            parts.append(on_controller("scontrol", "show", "job", job_id, check=False))
            out = repo / f"psgd-{job_id}.out"
            parts.append(f"{out.name}:\n" + (out.read_text()[-6000:] if out.exists() else "(none)"))
        for log in sorted(logs.glob("*.log")):
            parts.append(f"{log.name}:\n" + "\n".join(log.read_text().splitlines()[-15:]))
        return "\n".join(parts)

    try:
        cluster("build", timeout=900)
        cluster("up", "-d", "--no-build", timeout=180)

        def idle() -> bool:
            listed = on_controller("sinfo", "-h", "-N", "-o", "%N %t", check=False).split("\n")
            return sorted(line.split()[0] for line in listed if line.endswith(" idle")) == list(NODES)

        dockerlab.until(f"sinfo listing {', '.join(NODES)} idle", idle, timeout=90, explain=explain)

        # as the README says: export the token, then sbatch from the repository root
        submitted = cluster(
            "exec",
            "-T",
            "-w",
            str(repo),
            "-e",
            "PSGD_TOKEN",
            CONTROLLER,
            "sbatch",
            "--parsable",
            f"--nodes={len(NODES)}",
            f"--export=ALL,JOB_FILE={job_file}",
            "deploy/slurm/psgd.sbatch",
            env={"PSGD_TOKEN": token},
            timeout=60,
        )
        job_id = submitted.stdout.decode().strip().split(";")[0]
        assert job_id.isdigit(), f"sbatch --parsable said {submitted.stdout!r}"

        def ended() -> dict[str, str] | None:
            fields = job_fields(on_controller("scontrol", "show", "job", "-o", job_id, check=False))
            return fields if fields.get("JobState") in ENDED else None

        job = dockerlab.until(f"job {job_id} ending", ended, timeout=420, explain=lambda: explain(job_id))

        output = (repo / f"psgd-{job_id}.out").read_text()
        assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), (
            f"job {job_id}: {job['JobState']}, exit code {job['ExitCode']}\n{explain(job_id)}"
        )

        # the shards on the first two nodes, one worker on each of the others
        shards = re.search(
            rf"(?m)^psgd: shards at (\S+), 2 worker\(s\), job file {re.escape(str(job_file))}, "
            "device cpu$",
            output,
        )
        assert shards, f"no `psgd: shards at ...` line in the output:\n{output[-3000:]}"
        shard_hosts = [address.rsplit(":", 1)[0] for address in shards.group(1).split(",")]
        worker_hosts = dict(re.findall(r"shard 0: worker (\d+) registered \((\S+) pid", output))
        assert sorted(worker_hosts) == ["0", "1"], f"worker registrations in the output: {worker_hosts}"
        assert sorted([*shard_hosts, *worker_hosts.values()]) == list(NODES), (
            f"shards on {shard_hosts}, workers on {worker_hosts}: not one process per node"
        )

        # the shards were stopped, not killed: each wrote its last checkpoint, the export joined those
        stopped = re.findall(r"server:\d\[\d+\] INFO stopped at version (\d+)", output)
        assert len(stopped) == 2 and len(set(stopped)) == 1, f"shards stopped at versions {stopped}\n{output[-3000:]}"
        assert "forcing job termination" not in output, output[-3000:]
        model = repo / "psgd-checkpoints" / job_id / "model.npz"
        assert f"wrote {model}:" in output and f"versions shard 0: {stopped[0]}, shard 1: {stopped[0]};" in output, (
            output[-3000:]
        )
        assert model.is_file()

        accuracy = re.search(r"(?m)^test accuracy: (\d\.\d+) \(loss [\d.]+\) of (\S+): ", output)
        assert accuracy and accuracy.group(2) == str(model), f"no test accuracy of {model}:\n{output[-3000:]}"
        assert output.rstrip().splitlines()[-1].startswith("test accuracy: "), (
            f"the output does not end with the accuracy:\n{output[-1500:]}"
        )
        assert float(accuracy.group(1)) >= 0.9, accuracy.group(0)
        print(
            f"psgd-{job_id}.out, abridged:",
            *[
                line
                for line in output.splitlines()
                if line.startswith(("psgd: shards", "srun: sending", "wrote ", "test accuracy"))
                or "stopped at version" in line
                or "received SIGINT" in line
            ],
            sep="\n",
        )
    finally:
        cluster.down()
        dockerlab.run(["docker", "image", "rm", "-f", f"{name}:cpu"], timeout=120, check=False)
    assert not cluster.leftovers(), f"left behind: {cluster.leftovers()}"
    assert dockerlab.run(["docker", "image", "inspect", f"{name}:cpu"], timeout=30, check=False).returncode != 0
