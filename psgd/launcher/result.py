"""What a launch ends with: the final weights read from the shards and evaluated on the test set here, and the
:class:`LaunchResult` that says what happened (versions, updates lost, a rollback or a failover)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from psgd import data as datasets
from psgd.config import JobConfig
from psgd.data.base import scores_of
from psgd.job import build_job, params_to_device
from psgd.training.divergence import Divergence, DivergenceGuard
from psgd.training.evaluation import evaluate, saved_rows
from psgd.weights import load_weights, save_weights
from psgd.wire.tls import TLSFiles

log = logging.getLogger("psgd.launcher.run")


@dataclasses.dataclass
class LaunchResult:
    test_accuracy: float | None  # for classes and labels; None where the targets are values
    test_loss: float
    seconds: float
    servers: list[str]
    run_dir: str
    versions: list[int]
    saved: str | None = None
    divergence: dict | None = None  # the first divergence a process of this node saw (psgd.training.divergence), if any
    lost: dict[int, int] = dataclasses.field(default_factory=dict)  # shard -> updates behind the most advanced
    #: shard -> {"rollbacks": times it went back to a cut, "rounds_undone": rounds it computed again}, where it did
    went_back: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)
    failed_over: dict[int, int] = dataclasses.field(default_factory=dict)  # shard -> times its replica took over
    #: shard -> pushes its primary acknowledged without a copy (its replica gone, or unable to apply an update)
    unreplicated: dict[int, int] = dataclasses.field(default_factory=dict)
    #: shard -> where its pushes' time went: seconds receiving and checking them, applying them, and how many
    shard_seconds: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    test_r2: float | None = None  # for values (regression) targets
    #: each worker's (rank's) steps, in rank order, counted from the job's start (a resumed job's before its stop
    #: included); empty on a node that does not read the shards (node_rank > 0)
    worker_steps: list[int] = dataclasses.field(default_factory=list)


#: psgd launch's exit status when its shards ended at different versions (updates lost on a shard that
#: restarted from an older checkpoint), unless --accept-lost-updates
EXIT_LOST_UPDATES = 4


def lost_updates(versions: Sequence[int]) -> dict[int, int]:
    """Shard -> how many updates (rounds under sync) it is behind the most advanced shard.  Every shard applies
    every update (each holds a part of each), so a job that lost nothing ends with them all equal."""
    top = max(versions, default=0)
    return {k: top - v for k, v in enumerate(versions) if v < top}


def exchange_bound(records: Sequence[dict]) -> str | None:
    """A line where this run's workers spent more of a step getting weights and handing their gradients on than
    computing them (the ``step`` records of their metrics): what a step cost and the ways out; None where the
    compute bounds it, or no step was recorded."""
    compute = moving = 0.0
    steps = 0
    for record in records:
        if record.get("event") == "step":
            seconds = record.get("seconds") or {}
            compute += seconds.get("compute", 0.0)
            moving += seconds.get("weights", 0.0) + seconds.get("exchange", 0.0)
            steps += 1
    if not steps or moving <= compute:
        return None
    return (
        f"the exchange, not the compute, bounds this job's step: a worker's step took "
        f"{1e3 * (compute + moving) / steps:.2f} ms, {1e3 * compute / steps:.2f} of them computing its gradient "
        f"and {1e3 * moving / steps:.2f} getting weights and handing the gradient on; for a model this small, "
        "train in one process (psgd train) or with --mode allreduce, or give each step more work (--batch-size)"
    )


def evaluate_weights(
    config: JobConfig, weights: dict, mode: str, reader: Any = None
) -> tuple[float, dict[str, float | None], dict | None]:
    """The test loss and score of the final weights (a model's embedding tables read by ``reader``, an
    observer of the shards) as ``{"test_accuracy": ..., "test_r2": ...}`` (the one the targets are scored by set,
    the other None), and the divergence guard's verdict on them alone."""
    from psgd.worker.exchange import read_rows

    job = build_job(config)
    ds, t = job.dataset, config.train
    if reader is not None:
        rows = (lambda lookups: read_rows(reader, lookups, job.device)) if job.plan.tables else None
    else:  # the rows saved with the weights (an all-reduce rank's)
        load_weights(None, job.model.specs(), job.plan.tables, arrays=weights)
        rows = saved_rows(job, weights)
    params = params_to_device({s.name: weights[s.name] for s in job.model.specs()}, job.device)
    loss, score = evaluate(
        job.model, params, ds.x_test, ds.y_test, job.device, ids=ds.ids_test, rows=rows, target=ds.target
    )
    steps = datasets.steps_per_epoch(ds.n_train, config.cluster.fewest, t.batch_size) * t.epochs
    guard = DivergenceGuard.of_job("launcher", ds, config, mode)
    verdict = guard.final(steps, t.epochs, loss, score)
    return loss, scores_of(ds.metric, score), verdict.record() if verdict else None


def final_evaluation(
    config: JobConfig, addresses: list[str], run: Path, start: float, save: str | None, tls: TLSFiles, token: str
) -> LaunchResult:
    from psgd.export.shards import job_plan, pull_from_servers
    from psgd.worker.client import PSClient

    # One observer: it checks each shard is the one listed, then reads the weights and their versions.
    # a table's rows: to save; shards at different versions are reported below (updates lost), not refused
    pulled = pull_from_servers(config, addresses, token=token, tls=tls, rows=bool(save), mixed=True)
    weights, versions = pulled.weights, pulled.versions
    lost = lost_updates(versions)
    if lost:
        top = max(versions)
        log.warning(
            "the shards ended at different versions: %s; the updates a shard is behind were lost on it (it "
            "restarted from an older checkpoint, or a worker died between its pushes to two shards), and "
            "its part of the model missed them",
            "; ".join(f"shard {k} at {versions[k]}, {n} behind ({100 * n / top:.1f}%)" for k, n in lost.items()),
        )
    plan = job_plan(config)
    with PSClient(
        addresses,
        plan,
        token=token,
        tls=tls,  # an observer: reads rows, makes none
        recovery=config.cluster.recovery,
    ) as reader:
        loss, scores, verdict = evaluate_weights(config, weights, "ps", reader)
        statuses = reader.status()
    counters = [json.loads(s.counters_json) for s in statuses]
    # a worker's clock is the steps it pushed; one stopped between two shards' pushes is a step ahead on one
    steps = {}
    for s in statuses:
        for w in s.workers:
            steps[w.worker_id] = max(steps.get(w.worker_id, 0), w.clock)
    went_back = {
        k: {n: c.get(n, 0) for n in ("rollbacks", "rounds_undone")}
        for k, c in enumerate(counters)
        if c.get("rollbacks")
    }
    failed_over = {k: n for k, n in enumerate(c.get("failovers", 0) for c in counters) if n}
    if failed_over:
        log.info(
            "a shard's primary died and its replica took over (no acknowledged push lost): %s",
            "; ".join(f"shard {k} {n} time(s)" for k, n in failed_over.items()),
        )
    unreplicated = {k: n for k, n in enumerate(c.get("unreplicated", 0) for c in counters) if n}
    if unreplicated:
        log.warning(
            "a shard's pair held one copy for a while (its replica was gone, or could not apply an update): "
            "%s; had its primary died then, those pushes would have been lost",
            "; ".join(f"shard {k} acknowledged {n} push(es) without a copy" for k, n in unreplicated.items()),
        )
    if went_back:
        log.info(
            "the job went back to a cut after a shard restarted, and computed the rounds since again (no update "
            "lost): %s",
            "; ".join(
                f"shard {k} {b['rollbacks']} time(s), {b['rounds_undone']} round(s)" for k, b in went_back.items()
            ),
        )
    for note in pulled.notes:
        log.warning("--save %s: %s", save, note)
    if save:
        save_weights(save, weights)
    spent = {
        k: {
            "receive": round(c.get("receive_seconds", 0.0), 6),
            "apply": round(c.get("apply_seconds", 0.0), 6),
            "pushes": c.get("pushes", 0),
        }
        for k, c in enumerate(counters)
    }
    return LaunchResult(
        scores["test_accuracy"],
        loss,
        time.perf_counter() - start,
        addresses,
        str(run),
        versions,
        save,
        verdict,
        lost,
        went_back,
        failed_over,
        unreplicated,
        spent,
        scores["test_r2"],
        [steps.get(r, 0) for r in range(config.cluster.workers)],
    )


def handed_steps(records: list[dict], ranks: int) -> list[int]:
    """Each rank's steps in a job with a range of workers, from the ``done`` lines of the processes that held it (a
    rank's clock counts the job's rounds from before it joined, not its steps)."""
    steps = [0] * ranks
    for r in records:
        role = str(r.get("role", ""))
        if r.get("event") == "done" and role.startswith("worker:") and role[7:].isdigit() and int(role[7:]) < ranks:
            steps[int(role[7:])] += int(r.get("steps", 0))
    return steps


def lockstep_steps(records: list[dict], ranks: int) -> list[int]:
    """Each all-reduce rank's steps: rank 0's (its ``done`` line in ``records``, its metrics), for the ranks
    reduce every step together."""
    done = [r for r in records if r.get("event") == "done"]
    return [int(done[-1].get("clock", 0))] * ranks if done else []


def read_records(metrics: list[Path], since: float) -> list[dict]:
    """The metrics lines this launch's processes wrote (from ``since`` on: a run folder may hold an earlier
    launch's), each a dict; a line cut short by a killed process is left out."""
    out = []
    for path in metrics:
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except FileNotFoundError:
            continue
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("time", 0) >= since:
                out.append(record)
    return out


def first_divergence(records: list[dict], own: dict | None, shown: str | None) -> dict | None:
    """The first ``diverged`` line of ``records``, told again in a WARNING line unless it came from the process
    ``shown`` on the terminal; else the launcher's ``own`` verdict on the final weights."""
    seen = [r for r in records if r.get("event") == "diverged"]
    if seen:
        first = min(seen, key=lambda r: r["time"])
        verdict = {k: first.get(k) for k in ("by", "step", "epoch", "why", "advice")}
        if verdict["by"] != shown:
            log.warning("%s", Divergence(**verdict).line())
        return verdict
    if own:
        log.warning("%s", Divergence(**own).line())
    return own
