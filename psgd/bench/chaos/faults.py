"""How each fault kind is injected into a running job: :class:`FaultInjection`, the fault half of
:class:`psgd.bench.chaos.run.Run` (a mixin: it uses the run's cluster, spec, checks and records)."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import time
from pathlib import Path

from psgd.bench.chaos import disk, flooding
from psgd.bench.chaos.cluster import Abort
from psgd.bench.chaos.draws import Fault
from psgd.bench.chaos.hostile import HOLD, HOSTILE, OUTSIDER, SQUATTER, TRICKLE
from psgd.bench.chaos.insiders import insider_follower, rollback_storm
from psgd.bench.chaos.invariants import check_exit, check_restore
from psgd.bench.chaos.pairs import restart_primary_at_end
from psgd.bench.chaos.processes import Proc, last_error
from psgd.bench.chaos.settings import LEASE, PY, REQUEST_TIMEOUT, START_BOUND, STOP_BOUND
from psgd.server.net.datapath import transfer_seconds


class FaultInjection:
    """The faults of a :class:`~psgd.bench.chaos.run.Run`, one method per kind; :meth:`_inject` picks one."""

    def _inject(self, fault: Fault) -> None:
        c = self.cluster
        began = time.monotonic()
        note = ""
        if fault.kind in ("kill-shard", "corrupt-checkpoint"):
            note = self._kill_shard(fault.target, fault.damage)
        elif fault.kind == "restart-shard":
            note = self._restart_shard(fault.target)
        elif fault.kind == "kill-worker":
            r = self._live_worker(fault.target)
            note = (
                self._kill_worker(r, fault.offset, fault.seconds)
                if r is not None
                else "skipped: every worker had finished"
            )
        elif fault.kind in ("stop-shard", "stop-worker"):
            if fault.kind == "stop-shard":
                name = f"shard{fault.target}"
            else:
                r = self._live_worker(fault.target)
                name = f"worker{r}" if r is not None else ""
            if name and c.alive(name):
                c.signal(name, signal.SIGSTOP)
                time.sleep(fault.seconds)  # the length of the pause is the fault
                c.signal(name, signal.SIGCONT)
            else:
                note = "skipped: every worker had finished"
        elif fault.kind == "stop-mid-pull":
            r = self._live_worker(fault.target)
            note = self._stop_mid_pull(r, fault.seconds) if r is not None else "skipped: every worker had finished"
        elif fault.kind == "trickled-push":
            r = self._live_worker(fault.target)
            note = self._trickled_push(r, fault.count) if r is not None else "skipped: every worker had finished"
        elif fault.kind == "duplicate-rank":
            r = self._live_worker(fault.target)
            note = self._duplicate_rank(r) if r is not None else "skipped: every worker had finished"
        elif fault.kind == "outsider":
            r = self._live_worker(fault.target)
            note = self._outsider(r) if r is not None else "skipped: every worker had finished"
        elif fault.kind == "squatter":
            note = (
                self._squatter(fault.target, fault.seconds)
                if self.spec.replicas
                else "skipped: the run keeps no replicas"
            )
        elif fault.kind == "full-disk":
            note = disk.inject(self, fault.target, fault.seconds)
        elif fault.kind == "hostile":
            note = self._hostile(fault)
        elif fault.kind == "flood":
            note = flooding.inject(self, fault)
        elif fault.kind == "insider-follower":
            note = insider_follower(self, fault.target)
        elif fault.kind == "restart-primary-at-end":
            note = restart_primary_at_end(self, fault.target)
        elif fault.kind == "rollback-storm":
            note = rollback_storm(self, fault.target, fault.count)
        elif fault.kind == "netcut":
            host = ("s" if fault.role == "shard" else "w") + str(fault.target)
            self.net.link(host, up=False)
            try:
                time.sleep(fault.seconds)  # the length of the cut is the fault
            finally:
                self.net.link(host, up=True)
        text = f"{fault.describe()} at {time.monotonic() - self.started:.1f}s"
        self.done_faults.append(text + (f" ({note})" if note else ""))
        self.say(f"  run {self.spec.index}: {text}, {time.monotonic() - began:.1f}s{'; ' + note if note else ''}")

    def _live_worker(self, hint: int) -> int | None:
        n = self.spec.workers
        for i in range(n):
            r = (hint + i) % n
            if self.cluster.alive(f"worker{r}"):
                return r
        return None

    def _kill_shard(self, k: int, damage: str = "") -> str:
        """SIGKILL, then start again: it restores its newest checkpoint.  ``damage`` (corrupt-checkpoint): that
        checkpoint is damaged first ("flipped": bytes of its arrays overwritten, "truncated": its arrays cut in
        half, "manifest": its manifest not JSON); it must say so, skip it and restore the one before."""
        c = self.cluster
        name = f"shard{k}"
        c.signal(name, signal.SIGKILL)
        self.violate(
            "exit-code",
            check_exit(f"shard {k} (SIGKILLed)", c.wait(name, STOP_BOUND), -signal.SIGKILL, "after SIGKILL"),
        )
        newest = c.newest_checkpoint(k)  # what was on disk when it died
        damaged = ""
        if damage:
            held = c.checkpoints(k)
            if len(held) < 2:  # nothing to fall back on: the shard would rightly refuse to start
                damaged = f"not damaged: shard {k} held {len(held)} checkpoint(s)"
            else:
                damaged = damage_checkpoint(c.ckpt, k, held[-1], damage)
                newest = held[-2]
        proc = c.start_shard(k)
        self.restarted.add(k)
        c.wait_listening(k)
        if self.spec.replicas:  # (its peer leads, and may have written newer checkpoints meanwhile)
            return "; ".join(filter(None, [damaged, self._pair_whole(k)]))
        if damaged.startswith("damaged") and "skipping checkpoint" not in proc.log.read_text(errors="replace"):
            self.violate("checkpoint", [f"shard {k} did not say that it skipped its {damaged[8:]}"])
        view = self._status_of(k, START_BOUND)
        self.violate("checkpoint", check_restore(k, newest, view["restored_version"], view["version"]))
        restored = view["restored_version"]
        if damaged.startswith("damaged") and restored is not None and restored > newest:
            self.violate("checkpoint", [f"shard {k} restored version {restored}, its {damaged[8:]}"])
        return "; ".join(
            filter(None, [damaged, f"newest checkpoint ckpt-{newest}, restored {restored}, version {view['version']}"])
        )

    def _restart_shard(self, k: int) -> str:
        """SIGTERM: it exits 0 within 10 s with a last checkpoint of its last version; started again, it
        restores that checkpoint, so a graceful restart loses nothing."""
        c = self.cluster
        name = f"shard{k}"
        c.signal(name, signal.SIGTERM)
        code = c.wait(name, STOP_BOUND)
        self.violate("exit-code", check_exit(f"shard {k}", code, 0, "within 10 s of SIGTERM"))
        if code is None:
            c.signal(name, signal.SIGKILL)
            c.wait(name, STOP_BOUND)
            self.restarted.add(k)
        if self.spec.replicas:  # its replica took over, or it was the replica: it comes back as the replica
            c.start_shard(k)
            c.wait_listening(k)
            return self._pair_whole(k)
        stopped = self._stopped_at().get(k)
        newest = c.newest_checkpoint(k)
        if stopped is not None and newest != stopped:
            self.violate(
                "checkpoint",
                [f"shard {k} stopped at version {stopped} on SIGTERM but its newest checkpoint is ckpt-{newest}"],
            )
        c.start_shard(k)
        c.wait_listening(k)
        view = self._status_of(k, START_BOUND)
        self.violate(
            "checkpoint",
            check_restore(k, stopped if stopped is not None else newest, view["restored_version"], view["version"]),
        )
        return f"stopped at version {stopped}, restored {view['restored_version']}"

    def _pair_whole(self, k: int) -> str:
        """After shard ``k``'s first process came back: its pair has a primary whose replica follows again (the
        process that came back catches up from the survivor's state)."""
        leader = self.cluster.wait_whole(k)
        return (
            f"the pair is whole again: primary at version {leader['version']}, "
            f"{leader['counters'].get('failovers', 0)} failover(s)"
        )

    def _kill_worker(self, r: int, offset: float, down: float) -> str:
        c = self.cluster
        name = f"worker{r}"
        self._aim(c.procs[name], offset)
        c.signal(name, signal.SIGKILL)
        self.violate(
            "exit-code",
            check_exit(f"worker {r} (SIGKILLed)", c.wait(name, STOP_BOUND), -signal.SIGKILL, "after SIGKILL"),
        )
        self.worker_kills += 1
        before = c.clocks()[r]
        if self.spec.exit_when_done:  # there a lapsed lease, once the others are done, ends the job by design (the
            down = min(down, LEASE / 2)  # shards leave, and the worker finds none: seed 1521 run 0): back before it
        time.sleep(down)  # how long it stays dead is part of the fault
        proc = c.start_worker(r)
        deadline = time.monotonic() + START_BOUND
        while (first := _first_step(proc.metrics)) is None:  # an evaluation may be logged before it
            if proc.popen.poll() is not None:
                raise Abort(
                    f"worker {r}, restarted after SIGKILL at clock {before}, exited with status "
                    f"{proc.popen.returncode} before its first step: {last_error(proc.log)}",
                    "finishes",
                )
            if time.monotonic() > deadline:
                raise Abort(
                    f"worker {r}, restarted after SIGKILL at clock {before}, logged no step within {START_BOUND:.0f}s"
                )
            time.sleep(0.05)  # polling for its first step record, with a deadline
        resumed = first["clock"]
        problems = []
        if before >= 0 and resumed < before + 1:
            problems.append(
                f"worker {r} logged clock {before} before it was killed but continued at clock "
                f"{resumed}: it repeats steps the shards hold"
            )
        if self.spec.policy != "sync" and before >= 0 and resumed > before + 2:
            problems.append(
                f"worker {r} logged clock {before} before it was killed but continued at clock "
                f"{resumed}: async steps were skipped"
            )
        self.violate("continue", problems)
        return f"last clock {before}, continued at {resumed}"

    @staticmethod
    def _aim(proc: Proc, offset: float) -> None:
        """Wait (at most 2 s) for the worker's next metrics line, then ``offset`` seconds: its next step is under
        way then (pull, gradient, push; the pace's pause comes after the push)."""

        def size() -> int:
            try:
                return proc.metrics.stat().st_size
            except OSError:
                return -1

        first, deadline = size(), time.monotonic() + 2.0
        while size() == first and time.monotonic() < deadline and proc.popen.poll() is None:
            time.sleep(0.0005)  # watching for the line, briefly, with a deadline
        time.sleep(offset)  # the aim is the fault's own timing

    def _stop_mid_pull(self, r: int, seconds: float) -> str:
        """Worker ``r`` stopped in the middle of a pull: SIGSTOPped, while a pull of its rank is asked of every
        shard and left unfinished (over shared memory where the run has it: answered, never released) for
        ``seconds``.  Under async the other workers must go on meanwhile."""
        c = self.cluster
        targets, sizes = self._data_ports()
        c.signal(f"worker{r}", signal.SIGSTOP)
        try:
            stats, before, after = self._from_outside(
                HOLD,
                {"targets": targets, "sizes": sizes, "worker": r, "plan_hash": c.plan.hash, "seconds": seconds},
                seconds + 60,
                "pull-holding",
            )
        finally:
            c.signal(f"worker{r}", signal.SIGCONT)
        if stats is None:
            return "pull-holding client failed"
        others = [w for w in range(self.spec.workers) if w != r and c.alive(f"worker{w}")]
        if self.spec.policy == "async" and others and self._stood_still(before, after):
            self.violate(
                "starvation",
                [
                    f"no shard applied an update during {seconds:.1f}s while worker {r} was "
                    f"stopped in the middle of a pull (versions {before} -> {after}; {stats})"
                ],
            )
        return (
            f"{stats['unfinished']} pull(s) left unfinished ({stats['shm']} answered through shared memory and "
            f"never released, {stats['refused']} refused), versions {before} -> {after}"
        )

    def _from_outside(self, script: str, args: dict, timeout: float, who: str) -> tuple[dict | None, list, list]:
        """Run one of :mod:`psgd.bench.chaos.hostile`'s clients (``script``, given ``args``) from the observer's
        host, the shards' versions read just before and just after it: its stats (the last line it prints), or
        None once a harness violation says that the ``who`` client failed."""
        before = self._versions()
        done = subprocess.run(
            self.cluster.prefix("obs") + [PY, "-c", script, json.dumps(args)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        after = self._versions()
        try:
            return json.loads(done.stdout.strip().splitlines()[-1]), before, after
        except (ValueError, IndexError):
            self.violate("harness", [f"the {who} client failed: {done.stderr.strip()[-500:]}"])
            return None, before, after

    @staticmethod
    def _stood_still(before: list, after: list) -> bool:
        """No shard applied an update between two reads of their versions (every shard answered both)."""
        return None not in before + after and sum(after) <= sum(before)

    def _data_ports(self) -> tuple[list[tuple[str, int]], list[int]]:
        """Each shard's (host, data port) and the bytes of its weights."""
        c = self.cluster
        targets = []
        for address, data_port in zip(c.binds, c.config.cluster.links.data_ports):
            targets.append((address.rpartition(":")[0], data_port))
        return targets, [sum(s.nbytes for s in c.plan.slices_for_shard(k)) for k in range(len(c.binds))]

    def _trickled_push(self, r: int, unregistered: int) -> str:
        """Pushes sent a byte at a time to every shard: ``unregistered`` connections per shard as no worker,
        one as worker ``r`` (its rank is live; without its registration's key, so refused at its hello).  The shard
        must close each within the transfer deadline of its size (a registered one may hold a receive buffer until
        then; an unregistered one takes none), and
        training must go on meanwhile."""
        c = self.cluster
        targets, sizes = self._data_ports()
        allowed = max(transfer_seconds(n, REQUEST_TIMEOUT) for n in sizes)
        stats, before, after = self._from_outside(
            TRICKLE,
            {
                "targets": targets,
                "sizes": sizes,
                "worker": r,
                "unregistered": unregistered,
                "plan_hash": c.plan.hash,
                "seconds": allowed + 3.0,
            },
            allowed + 60,
            "trickling",
        )
        if stats is None:
            return "trickling client failed"
        if stats["open_at_end"] or stats["longest"] > allowed + 2.0:
            self.violate(
                "deadline",
                [
                    f"a push trickled a byte every 0.25 s stayed open {stats['longest']:.1f}s, "
                    f"past its transfer deadline of {allowed:.1f}s ({stats})"
                ],
            )
        training = any(c.alive(f"worker{w}") for w in range(self.spec.workers))
        if training and self._stood_still(before, after):
            self.violate(
                "starvation",
                [
                    f"no shard applied an update while pushes trickled in for "
                    f"{stats['longest']:.1f}s (versions {before} -> {after}; {stats})"
                ],
            )
        return (
            f"{stats['opened']} opened ({stats['refused']} refused), {stats['closed_by_peer']} closed by the "
            f"shards, the longest after {stats['longest']:.1f}s (deadline {allowed:.1f}s), versions "
            f"{before} -> {after}"
        )

    def _outsider(self, r: int) -> str:
        """A process with the job's token that never registered calls every shard in worker ``r``'s name (a push at
        a clock no worker reaches, a pull, Done, Rollback), asks to follow each, and calls Status without the token:
        every call must be refused, and the job must go on as if nothing was tried."""
        c = self.cluster
        targets, _ = self._data_ports()
        slices = [[dataclasses.asdict(s) for s in c.plan.slices_for_shard(k)] for k in range(len(c.binds))]
        asked = {
            "targets": [(a, port) for a, (_, port) in zip(c.binds, targets)],
            "slices": slices,
            "worker": r,
            "plan_hash": c.plan.hash,
        }
        stats, before, after = self._from_outside(OUTSIDER, asked, 120, "outsider")
        if stats is None:
            return "outsider client failed"
        self.violate("outsider", [f"an outsider's call was accepted: {what}" for what in stats["accepted"]])
        return f"{stats['refused']} of {stats['tried']} calls refused, versions {before} -> {after}"

    def _squatter(self, k: int, seconds: float) -> str:
        """Shard ``k``'s replica SIGKILLed, and a process without the token bound at its address for ``seconds``,
        claiming to lead: the primary must not believe it (it goes on leading), nor send it the token, nor accept
        what it heard when the squatter replays it; then the replica comes back and the pair is whole again."""
        c = self.cluster
        roles = [s["role"] if s else "" for s in c._pair_status(k, 2.0)]
        if "replica" not in roles or "primary" not in roles:
            return f"skipped: shard {k}'s pair is not whole ({roles})"
        second = roles.index("replica") == 1
        name, address = (f"replica{k}", c.replica_binds[k]) if second else (f"shard{k}", c.binds[k])
        c.signal(name, signal.SIGKILL)
        self.violate(
            "exit-code", check_exit(f"{name} (SIGKILLed)", c.wait(name, STOP_BOUND), -signal.SIGKILL, "after SIGKILL")
        )
        done = subprocess.run(
            c.prefix(c._host(name))
            + [
                PY,
                "-c",
                SQUATTER,
                json.dumps(
                    {
                        "address": address,
                        "shard": k,
                        "seconds": seconds,
                        "replay_to": (c.binds if second else c.replica_binds)[k],
                    }
                ),
            ],
            capture_output=True,
            text=True,
            timeout=seconds + 60,
        )
        try:
            stats = json.loads(done.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            self.violate("harness", [f"the squatter failed: {done.stderr.strip()[-500:]}"])
            stats = None
        leaders = [s["role"] if s else "" for s in c._pair_status(k, 2.0)]
        self.violate("token", stats["problems"] if stats else [])  # the token sent to it, or what it heard answered
        leader = leaders[1 - int(second)]
        if leader == "" and self.spec.exit_when_done:  # no answer: the job may be ending, its primary on its way out
            c.wait(f"shard{k}" if second else f"replica{k}", STOP_BOUND)
        if leader != "primary" and not self.cluster.left_by_itself():  # (not: the job ended meanwhile)
            self.violate(
                "squatter",
                [
                    f"shard {k}'s primary stopped leading while a process without the token at "
                    f"its replica's address claimed to lead (roles now {leaders})"
                ],
            )
        heard = f"{stats['calls']} call(s) heard" if stats and stats["bound"] else "could not bind"
        c.start_shard(k, replica=second)
        self.restarted.add(k)
        c.wait_listening(k, replica=second)
        if self.cluster.left_by_itself():  # no pair to be whole again, nor a primary to follow: it is stopped as a user
            c.signal(name, signal.SIGTERM)  # would stop it, and must leave as SIGTERM says
            self.violate(
                "exit-code",
                check_exit(
                    f"{name} (restarted after the job's end)", c.wait(name, STOP_BOUND), 0, "within 10 s of SIGTERM"
                ),
            )
            return f"{name} at {address}: squatter {heard}; the job ended meanwhile"
        return f"{name} at {address}: squatter {heard}; {self._pair_whole(k)}"

    def _duplicate_rank(self, r: int) -> str:
        """A second ``psgd-worker --rank r`` while worker ``r`` trains (a typo in a hosts list).  It runs on;
        :meth:`_check_duplicates` says, once it has ended, whether it was refused as it must be."""
        c = self.cluster
        holder = c.procs[f"worker{r}"].popen.pid
        proc = c.start_worker(r, duplicate=True)
        self.duplicates.append((r, holder, proc))
        return f"started pid {proc.popen.pid} beside pid {holder}"

    def _check_duplicates(self, bound: float, stopped: bool = False) -> None:
        """Each duplicate worker started by the fault has exited within ``bound`` (from now), refused with
        ALREADY_EXISTS naming the holder's pid; or, where the holder had finished first, it found nothing left
        to train, or no shard left to reach (--exit-when-done: seed 7474 run 2); or (``stopped``: the run ended
        with SIGTERM to every process) it stopped.  It never trained a step beside the holder."""
        deadline = time.monotonic() + bound
        for r, holder, proc in self.duplicates:
            try:
                code = proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.violate(
                    "duplicate",
                    [
                        f"the duplicate of worker {r} (pid {proc.popen.pid}) had not exited "
                        f"{bound:.0f}s after {'SIGTERM' if stopped else 'the run ended'}"
                    ],
                )
                continue
            text = proc.log.read_text(errors="replace")
            steps = [
                line
                for line in (proc.metrics.read_text().splitlines() if proc.metrics.exists() else [])
                if '"event": "step"' in line
            ]
            if steps:
                self.violate(
                    "duplicate",
                    [
                        f"the duplicate of worker {r} trained {len(steps)} step(s) beside the "
                        f"holder (pid {holder}); exit status {code}"
                    ],
                )
            elif (
                code != 0
                and not stopped
                and not ("ALREADY_EXISTS" in text and f"pid {holder}" in text)
                and not (self.cluster.left_by_itself() and "cannot reach shard" in text)
            ):  # it came after the end
                self.violate(
                    "duplicate",
                    [
                        f"the duplicate of worker {r} exited with status {code} without saying "
                        f"that pid {holder} holds the rank: {last_error(proc.log)}"
                    ],
                )
            refused = "ALREADY_EXISTS" in text and f"pid {holder}" in text
            self.say(
                f"  run {self.spec.index}: the duplicate of worker {r} exited with status {code}"
                + (f", refused: pid {holder} holds the rank" if refused else ", without a step")
            )

    def _hostile(self, fault: Fault) -> str:
        c = self.cluster
        targets = []
        for address, data_port in zip(c.binds, c.config.cluster.links.data_ports):
            host, _, port = address.rpartition(":")
            targets += [(host, int(port)), (host, data_port)]
        stats, before, after = self._from_outside(
            HOSTILE,
            {
                "targets": targets,
                "count": fault.count,
                "seconds": fault.seconds,
                "seed": self.seed * 1000 + self.spec.index,
            },
            fault.seconds + 60,
            "hostile",
        )
        if stats is None:
            return "hostile client failed"
        training = any(c.alive(f"worker{r}") for r in range(self.spec.workers))
        if training and self._stood_still(before, after):
            self.violate(
                "starvation",
                [
                    f"no shard applied an update during {fault.seconds:.1f}s of hostile "
                    f"connections (versions {before} -> {after}; {stats})"
                ],
            )
        return f"{stats['opened']} opened, {stats['closed_by_peer']} closed by the shards, versions {before} -> {after}"


def _first_step(metrics: Path) -> dict | None:
    """The first step record of a worker's metrics log (an evaluation may come before it), or None yet."""
    if not metrics.exists():
        return None
    for line in metrics.read_text().splitlines():
        if line.endswith("}"):
            record = json.loads(line)
            if record.get("event") == "step":
                return record
    return None


def damage_checkpoint(root: Path, k: int, version: int, damage: str) -> str:
    """Damage shard ``k``'s checkpoint ``version`` under ``root`` as ``damage`` says; says what was done."""
    for folder in root.glob(f"*/shard-{k}"):
        arrays, manifest = folder / f"ckpt-{version}.npz", folder / f"ckpt-{version}.json"
        if not manifest.exists():
            continue
        if damage == "manifest":
            manifest.write_text("{not json")
        elif damage == "truncated":
            data = arrays.read_bytes()
            arrays.write_bytes(data[: len(data) // 2])
        else:  # flipped
            with open(arrays, "r+b") as f:
                f.seek(arrays.stat().st_size // 2)
                chunk = bytearray(f.read(64))
                f.seek(-len(chunk), 1)
                f.write(bytes(b ^ 0xFF for b in chunk))
        return f"damaged ckpt-{version} ({damage})"
    return f"not damaged: no ckpt-{version} of shard {k}"
