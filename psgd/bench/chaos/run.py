"""One run: :class:`Run` starts a job, injects its faults (the :class:`FaultInjection` half), checks the
invariants after each and at the end, and records every violation with its context."""

from __future__ import annotations

import dataclasses
import math
import random
import re
import signal
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from psgd.bench.chaos.cluster import Abort, Cluster, shard_view
from psgd.bench.chaos.draws import RunSpec
from psgd.bench.chaos.faults import FaultInjection
from psgd.bench.chaos.invariants import (
    check_counters,
    check_exactly_once,
    check_exit,
    check_files,
    check_finite,
    check_no_loss,
    check_same_weights,
)
from psgd.bench.chaos.processes import last_error, processes_mentioning, tail
from psgd.bench.chaos.settings import (
    JOIN_TIMEOUT,
    KEEP,
    REQUEST_TIMEOUT,
    RUN_BOUND,
    SHARDS,
    STALL_BOUND,
    START_BOUND,
    STOP_BOUND,
    SUBNET,
)
from psgd.bench.netns import Namespaces


class Run(FaultInjection):
    """One job, its faults and its checks; :meth:`execute` returns the run's record."""

    def __init__(self, spec: RunSpec, folder: Path, seed: int, say: Callable[[str], None]):
        self.spec, self.folder, self.seed, self.say = spec, folder, seed, say
        self.violations: list[dict] = []
        self.done_faults: list[str] = []
        self.restarted: set[int] = set()
        self.worker_kills = 0
        self.pushed_after: dict[int, int] = {}  # worker -> pushes made in its name after it finished (pairs.py)
        self.seen: dict[int, tuple[str, int]] = {}  # shard -> (incarnation, version) last seen
        self.started = time.monotonic()
        self.cluster: Cluster | None = None
        self.net: Namespaces | None = None
        self.accuracy: float | None = None
        self.finished = False
        self.counts: dict[str, int] = {}
        self.duplicates: list = []  # (rank, holder's pid, Proc): second processes of a rank, see _check_duplicates
        self.compared: bool | None = None  # sync: whether the weights were those of an undisturbed run

    # -- recording -------------------------------------------------------------------------------
    def violate(self, invariant: str, problems: Iterable[str]) -> None:
        for problem in problems:
            logs = {}
            if self.cluster is not None:
                for name, proc in sorted(self.cluster.procs.items()):
                    logs[f"{name}.{proc.incarnation}"] = tail(proc.log)
            record = {
                "seed": self.seed,
                "run": self.spec.index,
                "invariant": invariant,
                "message": problem,
                "run_spec": self.spec.describe(),
                "faults_so_far": list(self.done_faults),
                "at_seconds": round(time.monotonic() - self.started, 1),
                "folder": str(self.folder),
                "logs": logs,
            }
            self.violations.append(record)
            self.say(
                f"  VIOLATION [{invariant}] seed {self.seed} run {self.spec.index}: {problem} "
                f"(faults so far: {'; '.join(self.done_faults) or 'none'})"
            )

    def left(self) -> float:
        return self.started + RUN_BOUND - time.monotonic()

    def workers_finished(self) -> bool:
        """Wait (bounded by the run's) for every worker to exit; whether each has (their exit codes are checked at
        the end).  The faults injected at the job's end begin with it."""
        for r in range(self.spec.workers):
            self.cluster.wait(f"worker{r}", max(5.0, min(60.0, self.left())))
        return not any(self.cluster.alive(f"worker{r}") for r in range(self.spec.workers))

    # -- the run -------------------------------------------------------------------------------------
    def execute(self) -> dict:
        spec = self.spec
        try:
            if spec.namespaces:
                hosts = {f"s{k}": f"{SUBNET}.{10 + k}" for k in range(SHARDS)}
                hosts.update({f"w{r}": f"{SUBNET}.{20 + r}" for r in range(spec.workers)})
                hosts.update({f"r{k}": f"{SUBNET}.{14 + k}" for k in range(SHARDS) if spec.replicas})
                hosts["obs"] = f"{SUBNET}.30"
                self.net = Namespaces(hosts)
                self.net.build()
            self.cluster = Cluster(spec, self.folder, random.Random(), self.net)
            self.cluster.start()
            for fault in spec.faults:
                self._wait_progress(fault.at, f"progress {fault.at:.0%} before {fault.describe()}")
                self._inject(fault)
                self.counts[fault.kind] = self.counts.get(fault.kind, 0) + 1
                self._check_running(after=fault.describe())
            if spec.end == "sigterm":
                self._wait_progress(spec.end_at, f"progress {spec.end_at:.0%} before the SIGTERM")
                self.counts["sigterm"] = 1
                self._sigterm_all()
            else:
                self._finish()
        except Abort as exc:
            self.violate(exc.invariant, [str(exc)])
        except Exception as exc:  # the harness itself failed: say so with the run's context
            self.violate("harness", [f"{type(exc).__name__}: {exc}"])
        finally:
            self._close()
        return {
            "run": spec.index,
            "spec": spec.describe(),
            "policy": spec.policy,
            "model": spec.model,
            "workers": spec.workers,
            "transport": spec.transport,
            "namespaces": spec.namespaces,
            "end": spec.end,
            "faults": self.done_faults,
            "seconds": round(time.monotonic() - self.started, 1),
            "finished": self.finished,
            "accuracy": self.accuracy,
            "violations": len(self.violations),
            "same_as_undisturbed": self.compared,
            "steps_per_worker": self.cluster.total if self.cluster else None,
        }

    def _wait_progress(self, fraction: float, what: str) -> None:
        """Until the slowest worker has done ``fraction`` of its steps (or every worker has exited);
        a clock that does not move for STALL_BOUND, or the run's bound, is a hang."""
        c = self.cluster
        target = math.ceil(fraction * c.total)
        last, moved = None, time.monotonic()
        while True:
            clocks = c.clocks()
            for r in range(self.spec.workers):
                proc = c.procs[f"worker{r}"]
                if proc.popen.poll() not in (None, 0):
                    raise Abort(
                        f"worker {r} exited with status {proc.popen.returncode} at clock {clocks[r]} of "
                        f"{c.total}: {last_error(proc.log)}",
                        "finishes",
                    )
            if min(clocks.values()) + 1 >= target:
                return
            if not any(c.alive(f"worker{r}") for r in range(self.spec.workers)):
                return
            for name in c.shard_names:
                proc = c.procs[name]
                if proc.popen.poll() is not None:
                    raise Abort(
                        f"{name} exited with status {proc.popen.returncode} while workers were training "
                        f"(clocks {clocks}): {last_error(proc.log)}",
                        "finishes",
                    )
            if clocks != last:
                last, moved = clocks, time.monotonic()
            if time.monotonic() - moved > STALL_BOUND:
                raise Abort(
                    f"no worker clock moved for {STALL_BOUND:.0f}s waiting for {what} (clocks {clocks}, "
                    f"versions {[s and s['version'] for s in c.status()]}): a hang"
                )
            if self.left() <= 0:
                raise Abort(f"the run took longer than {RUN_BOUND:.0f}s waiting for {what} (clocks {clocks})")
            time.sleep(0.1)  # polling the workers' metrics, with a deadline

    # -- checks ----------------------------------------------------------------------------------
    def _status_of(self, k: int, bound: float) -> dict:
        deadline = time.monotonic() + bound
        proc = self.cluster.procs[f"shard{k}"]
        while True:
            view = self.cluster.status()[k]
            if view is not None:
                return view
            if proc.popen.poll() is not None:
                raise Abort(
                    f"shard {k} exited with status {proc.popen.returncode} while it was expected to serve: "
                    f"{last_error(proc.log)}",
                    "finishes",
                )
            if time.monotonic() > deadline:
                raise Abort(f"shard {k} did not answer Status within {bound:.0f}s")
            time.sleep(0.2)  # polling, with a deadline

    def _versions(self) -> list[int | None]:
        return [s and s["version"] for s in self.cluster.status()]

    def _check_shards(self, views: Sequence[dict], clocks: Mapping[int, int]) -> None:
        """Exactly-once and the counters on answers just read; ``clocks``: each worker's possible pushes."""
        policy = self.spec.policy
        self.violate("exactly-once", check_exactly_once(policy, {v["shard"]: v["version"] for v in views}, clocks))
        for v in views:
            self.violate("counters", check_counters(policy, v["shard"], v["version"], v["counters"]))
            seen = self.seen.get(v["shard"])
            back = int(v["counters"].get("rollbacks", 0))  # a sync job's cuts: another shard's restart takes it back
            if seen and seen[0] == v["incarnation"] and v["version"] < seen[1] and back == seen[2]:
                self.violate(
                    "monotonic",
                    [
                        f"shard {v['shard']}'s version went back from {seen[1]} to "
                        f"{v['version']} without a restart or a rollback"
                    ],
                )
            self.seen[v["shard"]] = (v["incarnation"], v["version"], back)

    def _check_running(self, after: str) -> None:
        """After a fault: every shard answers, the counters hold, the weights are finite."""
        c = self.cluster
        for name, proc in c.procs.items():
            code = proc.popen.poll()
            if code not in (None, 0):
                raise Abort(f"{name} exited with status {code} after {after}: {last_error(proc.log)}", "finishes")
        if not any(c.alive(f"worker{r}") for r in range(self.spec.workers)):
            return  # training is over: the final checks follow
        if self.cluster.left_by_itself():
            return  # a shard left by itself: every worker had said it was done (the final checks see that they were)
        try:
            views = [self._status_of(k, REQUEST_TIMEOUT + 5) for k in range(SHARDS)]
        except Abort:
            if self.cluster.left_by_itself():  # the last worker said it was done since (seed 7474 runs 20, 26)
                return
            raise
        clocks = {r: last + 2 for r, last in c.clocks().items()}  # read after Status: + the push in flight
        self._check_shards(views, clocks)
        try:
            self.violate("finite", check_finite(c.weights(), f"weights after {after}"))
        except Exception as exc:  # a pull that fails after a fault is a finding too ...
            ended = self.spec.exit_when_done and (
                not any(c.alive(f"worker{r}") for r in range(self.spec.workers))
                or any(c.procs[n].popen.poll() == 0 for n in c.shard_names)
            )
            if not ended:  # ... unless training ended meanwhile and the shards left by themselves (the workers
                # may still be on their way out)
                self.violate("observe", [f"the weights could not be pulled after {after}: {exc}"])

    def _finish(self) -> None:
        """Train to the end: every worker exits 0; the shards stop (by themselves with --exit-when-done, else
        on SIGTERM) and exit 0; then the last checks."""
        c, spec = self.cluster, self.spec
        self._wait_progress(1.0, "the end of training")
        for r in range(spec.workers):
            self.violate(
                "exit-code",
                check_exit(
                    f"worker {r}", c.wait(f"worker{r}", max(5.0, min(60.0, self.left()))), 0, "at the end of training"
                ),
            )
        self._check_duplicates(REQUEST_TIMEOUT + START_BOUND)  # before the shards go: they refuse it, or admit it
        done = {r: [x for x in c.records(r) if x["event"] == "done"] for r in range(spec.workers)}
        self.finished = all(d and d[-1]["clock"] == c.total for d in done.values())
        if not self.finished:
            self.violate(
                "finishes",
                [
                    f"worker {r} ended at clock {d[-1]['clock'] if d else '?'} of {c.total}"
                    for r, d in done.items()
                    if not d or d[-1]["clock"] != c.total
                ],
            )
        if spec.exit_when_done:
            for name in c.shard_names:  # a restarted shard waits for the join deadline of workers that are done
                self.violate(
                    "exit-code",
                    check_exit(
                        f"{name} (--exit-when-done)",
                        c.wait(name, JOIN_TIMEOUT + STOP_BOUND),
                        0,
                        "within the join timeout + 10 s of the last worker's end",
                    ),
                )
            views, weights = self._from_checkpoints()
        else:
            views = [self._status_of(k, REQUEST_TIMEOUT) for k in range(SHARDS)]
            weights = None if c.sparse else c.weights()  # a table's rows: from the checkpoints written at SIGTERM
            for name in c.shard_names:
                c.signal(name, signal.SIGTERM)
            for name in c.shard_names:
                self.violate("exit-code", check_exit(name, c.wait(name, STOP_BOUND), 0, "within 10 s of SIGTERM"))
            if c.sparse:
                weights = self._from_checkpoints()[1]
        versions = {v["shard"]: v["version"] for v in views}
        self._check_shards(views, {r: c.total + self.pushed_after.get(r, 0) for r in range(spec.workers)})
        if self.finished:  # under sync a restarted shard takes the job back to its cut, and with replicas its
            # replica took over: either way it loses nothing (no acknowledged push, under async)
            self.violate(
                "lost-update",
                check_no_loss(
                    spec.policy,
                    versions,
                    c.total,
                    spec.workers,
                    () if spec.policy == "sync" or spec.replicas else self.restarted,
                    self.worker_kills,
                    self._said_lost(),
                ),
            )
            if spec.policy == "sync" and weights is not None:
                self._against_undisturbed(weights, views)
        if weights is not None:
            self.violate("finite", check_finite(weights, "the final weights"))
            self.accuracy = round(c.accuracy(weights), 4)
            least = c.least_accuracy()
            if self.finished and self.accuracy < least:
                self.violate("trained", [f"final test accuracy {self.accuracy:.3f} < {least:.3f}"])
        self.violate(
            "files",
            check_files(self.folder, c.ckpt, SHARDS, KEEP, c.port_files, final_versions=self._stopped_at() or versions),
        )

    def _against_undisturbed(self, weights: Mapping[str, np.ndarray], views: Sequence[dict]) -> None:
        """A finished sync job no worker was dropped from ends with the weights of the same job run without faults,
        to the bit (float64): a restarted shard cost rounds computed again, never a different result."""
        dropped = sum(int(v["counters"].get("expired", 0)) for v in views)
        if dropped:
            self.say(
                f"  run {self.spec.index}: {dropped} worker lease(s) ran out (its rounds closed without it), "
                "so the weights are not compared with an undisturbed run's"
            )
            return
        undisturbed = self._undisturbed()
        if undisturbed is None:
            return
        problems = check_same_weights(weights, undisturbed)
        self.violate("undisturbed", problems)
        self.compared = not problems

    def _undisturbed(self) -> dict[str, np.ndarray] | None:
        """The final weights of this run's job trained again without faults, on loopback (the bytes are the same
        on every link), in a folder of its own."""
        spec = dataclasses.replace(self.spec, faults=[], namespaces=False, end="finish", exit_when_done=False)
        folder = self.folder / "undisturbed"
        folder.mkdir(exist_ok=True)
        cluster = Cluster(spec, folder, random.Random(), None)
        try:
            cluster.start()
            for r in range(spec.workers):
                code = cluster.wait(f"worker{r}", max(5.0, self.left()))
                if code != 0:
                    self.violate(
                        "harness",
                        [
                            f"the undisturbed run's worker {r} ended with status {code}: "
                            f"{last_error(cluster.procs[f'worker{r}'].log)}"
                        ],
                    )
                    return None
            if not cluster.sparse:
                return cluster.weights()
            for k in range(SHARDS):  # a table's rows: from the checkpoints written at SIGTERM, as in the run
                cluster.signal(f"shard{k}", signal.SIGTERM)
                cluster.wait(f"shard{k}", STOP_BOUND)
            from psgd.export.shards import join_checkpoints

            return join_checkpoints(cluster.config, cluster.ckpt, mixed=True).weights
        finally:
            cluster.close()

    def _sigterm_all(self) -> None:
        """SIGTERM to every process at once: each exits 0 within 10 s; the last checkpoints hold."""
        c = self.cluster
        before = {k: s["version"] for k, s in enumerate(c.status()) if s is not None}
        for name in list(c.procs):
            if c.alive(name):
                c.signal(name, signal.SIGTERM)
        for _, _, proc in self.duplicates:
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_BOUND
        for name in c.procs:
            self.violate(
                "exit-code",
                check_exit(
                    name,
                    c.wait(name, max(0.1, deadline - time.monotonic())),
                    0,
                    "within 10 s of SIGTERM to every process",
                ),
            )
        self._check_duplicates(max(0.1, deadline - time.monotonic()), stopped=True)
        stopped = self._stopped_at()
        self.violate(
            "files",
            check_files(self.folder, c.ckpt, SHARDS, KEEP, c.port_files, final_versions=stopped, at_least=before),
        )
        views, weights = self._from_checkpoints()
        clocks = {r: last + 2 for r, last in c.clocks().items()}  # + a push stopped mid-step, without its line
        self._check_shards(views, clocks)
        if weights is not None:
            self.violate("finite", check_finite(weights, "the last checkpoints"))
            self.accuracy = round(c.accuracy(weights), 4)

    def _said_lost(self) -> dict[int, int]:
        """Per shard, the updates a process of its pair said were lost as it stepped down (psgd.server.durable.replica:
        the pair split by a cut link, the primary having gone on alone), over every process it ran."""
        out: dict[int, int] = {}
        for proc in self.cluster.history:
            text = proc.log.read_text(errors="replace") if proc.log.exists() else ""
            for k, n in re.findall(r"shard (\d+): (\d+) update\(s\) applied here are not at its peer", text):
                out[int(k)] = out.get(int(k), 0) + int(n)
        return out

    def _stopped_at(self) -> dict[int, int]:
        """The version each shard's last incarnation said it stopped at (its log's last line)."""
        out = {}
        for k in range(SHARDS):  # a pair: the later of the two (a replica is never ahead of its primary)
            found = [
                int(v)
                for name in self.cluster.shard_names
                if name[-1] == str(k)
                for v in re.findall(r"stopped at version (\d+)", tail(self.cluster.procs[name].log, 5))[-1:]
            ]
            if found:
                out[k] = max(found)
        return out

    def _from_checkpoints(self) -> tuple[list[dict], dict[str, np.ndarray] | None]:
        """The shards' views (version, counters) and the joined weights, from their newest checkpoints."""
        from psgd.export.shards import join_checkpoints
        from psgd.server.state import checkpoint

        c = self.cluster
        views = []
        for k in range(SHARDS):
            newest = c.newest_checkpoint(k)
            folder = next((f for f in c.ckpt.glob(f"*/shard-{k}") if newest in checkpoint.versions(f)), None)
            if folder is None:
                self.violate("files", [f"shard {k} left no checkpoint"])
                continue
            m = checkpoint.load(folder, newest, arrays=False).manifest
            views.append(shard_view(k, int(m["version"]), "final", m.get("counters", {})))
        try:
            return views, join_checkpoints(c.config, c.ckpt, mixed=True).weights
        except Exception as exc:  # said as a finding: the last checkpoints should always join
            self.violate("files", [f"the last checkpoints cannot be joined: {exc}"])
            return views, None

    def _close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
            left = processes_mentioning(str(self.folder))  # every child was reaped: anything here escaped
            if left:
                self.violate(
                    "processes", [f"process(es) {left} mentioning the run's folder are still there after it ended"]
                )
        if self.net is not None:
            left = self.net.close()
            if left:
                self.violate("harness", [f"network namespaces {left} could not be removed"])
