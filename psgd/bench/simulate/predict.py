"""Past this machine: psgd jobs of many workers and shards, each process on a host of its own and every host's link
of one rate, simulated with the costs measured here (:mod:`psgd.bench.simulate.calibrate`) and a model's size and
gradient time (:class:`Model`).

- :data:`MODELS`: the ResNet-50-sized and VGG-16-sized models, their gradient a P100's published step;
  :func:`model`: those, psgd's synthetic lab model or a user's job file, with its gradient measured here (or given);
- :func:`steps_per_s`: one job's steps/s; :func:`efficiency` against its workers' gradients alone;
- :func:`shards_for`: the fewest shards (a power of two up to :data:`MOST_SHARDS`) that reach a share of all-reduce.

On hosts of their own each process has cores to itself, so its data connections watch for answers (as psgd launch
has them do where each process has a core) and a host's CPU is what one process uses; the bytes cross both hosts'
links at their rate (full duplex) and :data:`LATENCY` each way.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from psgd.bench.simulate.job import Costs, Layout, simulate

#: one way across a data-centre network beside the bytes' time: a switch and both hosts' stacks (seconds)
LATENCY = 25e-6
#: the most shards :func:`shards_for` tries
MOST_SHARDS = 64


@dataclasses.dataclass(frozen=True)
class Model:
    """A model as the simulation sees it: its bytes of weights and one gradient's seconds on a worker."""

    name: str
    nbytes: float
    compute: float
    source: str


# ResNet-50 has 25,557,032 parameters and VGG-16 138,357,544 (as Keras counts them); float32.  Their gradient: a
# P100's step at batch 64, from TensorFlow's published benchmarks (DGX-1, synthetic data, May 2017: 219 and 154
# images/s), the GPU generation of Horovod's published scaling runs.
MODELS = {
    "resnet50": Model(
        "ResNet-50-sized",
        25_557_032 * 4,
        64 / 219,
        "25.6M float32 parameters; a P100's step of 64 images at 219 images/s (TensorFlow benchmarks)",
    ),
    "vgg16": Model(
        "VGG-16-sized",
        138_357_544 * 4,
        64 / 154,
        "138.4M float32 parameters; a P100's step of 64 images at 154 images/s (TensorFlow benchmarks)",
    ),
}


def _measured(name: str, job: Path, compute: float | None, source: str) -> Model:
    """A job file's model: its bytes from the job's partition plan; its gradient ``compute`` seconds, or measured
    here as ``psgd train -c JOB --epochs 1`` steps (the training loop's seconds a step, one process)."""
    from psgd.config import JobConfig
    from psgd.job import describe_job

    nbytes = describe_job(JobConfig.load(job)).plan.total_bytes
    if compute is None:
        from psgd.bench.scaling.measure import single_rates

        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "psgd.cli.main",
                "train",
                "-c",
                str(job),
                "--epochs",
                "1",
                "--no-progress",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=3600,
        )
        if done.returncode:
            raise SystemExit(f"psgd train -c {job} failed: {done.stderr.strip()[-400:]}")
        compute = 1 / single_rates(json.loads(done.stdout.strip().splitlines()[-1]))["steps_per_s"]
        source += "; its gradient measured here (psgd train, one process)"
    else:
        source += "; its gradient as given"
    return Model(name, float(nbytes), compute, source)


def model(text: str, compute: float | None = None) -> Model:
    """``resnet50``, ``vgg16`` (:data:`MODELS`), ``synthetic`` (psgd's synthetic lab preset's MLP) or a job file's
    model; ``compute`` (seconds) replaces the gradient's time."""
    if text in MODELS:
        found = MODELS[text]
        return found if compute is None else dataclasses.replace(found, compute=compute)
    if text == "synthetic":
        from psgd.bench.lab import preset
        from psgd.config import JobConfig, to_toml

        config = JobConfig()
        config = config.apply_sets(preset("synthetic").job, validate=True)
        with tempfile.TemporaryDirectory(prefix="psgd-sim-") as tmp:
            job = Path(tmp) / "synthetic.toml"
            job.write_text(to_toml(config.to_dict()))
            return _measured("synthetic MLP", job, compute, "psgd bench convergence's synthetic preset's MLP")
    path = Path(text)
    if not path.is_file():
        raise SystemExit(f"--model {text}: not a job file, nor one of resnet50, vgg16, synthetic")
    return _measured(path.stem, path, compute, f"the model of {path}")


def link_rate(network: str) -> float:
    """Bytes/s of a link of ``network``'s rate ("25gbit")."""
    from psgd.bench.netns import parse_rate

    return parse_rate(network) / 8


def on_hosts(costs: Costs, model: Model) -> Costs:
    """The costs of ``model`` on hosts of their own: its gradient; each process on a core of its own."""
    return dataclasses.replace(costs, compute=model.compute, cores_four=0.0)


def steps_per_s(
    costs: Costs, model: Model, workers: int, shards: int, rate: float, policy: str = "sync", slow: dict | None = None
) -> float:
    """Steps/s of all workers together of ``model`` with ``workers`` and ``shards`` (all-reduce: ``workers``
    ranks), each on a host of its own with a link of ``rate`` bytes/s; ``slow``: worker -> how many times longer
    its gradient takes."""
    layout = Layout(workers, shards, policy, model.nbytes, rate=rate, latency=LATENCY, watching=True, slow=slow or {})
    rounds = 2 if policy in ("sync", "allreduce") else 4  # sync's rounds repeat; async's take a few to settle
    return simulate(on_hosts(costs, model), layout, steps=rounds * workers, warmup=workers)["steps_per_s"]


def efficiency(rate_of_steps: float, workers: int, model: Model) -> float:
    """Steps/s against what ``workers`` would do computing gradients alone (no communication at all)."""
    return rate_of_steps * model.compute / workers


def shards_for(
    costs: Costs, model: Model, workers: int, rate: float, target: float, known: dict[int, float] | None = None
) -> int | None:
    """The fewest shards (1, 2, 4 ... :data:`MOST_SHARDS`) whose sync job reaches ``target`` steps/s, or None;
    ``known`` (shards -> steps/s) is used where it has the figure and filled in."""
    known = {} if known is None else known
    shards = 1
    while shards <= MOST_SHARDS:
        if shards not in known:
            known[shards] = steps_per_s(costs, model, workers, shards, rate)
        if known[shards] >= target:
            return shards
        shards *= 2
    return None
