"""The chaos suite (psgd/bench/chaos/): its invariant checks on hand-made data, a short seeded run of every
fault kind against real processes, and the product bugs it found, each reproduced deterministically.

The long version is ``python benchmarks/chaos.py --minutes 10`` (not run here).  Replay a failure of the
short run with its seed: ``PSGD_CHAOS_SEED=S pytest tests/chaos`` or ``python benchmarks/chaos.py --runs 7
--seed S``.

The last tests reproduce, deterministically, product bugs the suite found; each failed before its fix.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import TOKEN, by_hand_env, make_job, run_threads, shards, wait_for

from psgd.bench.chaos.draws import AT_THE_END, WITH_CUTS, WITH_REPLICAS, Planner
from psgd.bench.chaos.invariants import (
    check_background,
    check_counters,
    check_exactly_once,
    check_exit,
    check_files,
    check_finite,
    check_follows,
    check_no_loss,
    check_restore,
    check_same_weights,
)
from psgd.bench.chaos.processes import command, free_port_pair
from psgd.bench.chaos.settings import FAULTS_PER_RUN, KINDS, MIN_ACCURACY
from psgd.bench.chaos.suite import main as chaos_main
from psgd.bench.chaos.suite import parse_kinds, run_chaos
from psgd.bench.netns import IP, PREFIX
from psgd.config import Deadlines, to_toml
from psgd.job import build_job, describe_job
from psgd.partition import PartitionPlan
from psgd.server.state import checkpoint
from psgd.worker.client import PSClient, PSError
from psgd.worker.exchange import run_worker

#: The short run's seed and length: its seven runs cover every fault kind, both policies and every data path
#: (see test_the_ci_seed_covers_every_kind_policy_and_transport).
CI_SEED = 1521
SHORT_RUNS = 7


# -- the checks themselves: each can fail -----------------------------------------------------------------
def test_a_double_applied_update_is_detected():
    assert check_exactly_once("async", {0: 6, 1: 5}, {0: 3, 1: 3}) == []
    found = check_exactly_once("async", {0: 7, 1: 6}, {0: 3, 1: 3})  # shard 0 applied one push twice
    assert len(found) == 1 and "shard 0: version 7 exceeds 6" in found[0] and "applied twice" in found[0]
    assert check_exactly_once("sync", {0: 3}, {0: 3, 1: 2}) == []
    assert "exceeds 3" in check_exactly_once("sync", {0: 4}, {0: 3, 1: 3})[0]  # a round applied twice


def test_counters_that_do_not_add_up_are_detected():
    fine = {"pushes": 10, "applied": 8, "duplicates": 2, "late": 0, "rejected": 0, "accumulated": 0}
    assert check_counters("async", 0, 8, fine) == []
    assert "counters say 8 update(s) applied, its version is 9" in check_counters("async", 0, 9, fine)[0]
    assert "11 push(es) counted but 10 outcome(s)" in check_counters("async", 0, 8, {**fine, "pushes": 11})[0]
    sync = {"pushes": 6, "applied": 3, "accumulated": 5, "late": 1, "duplicates": 0, "rejected": 0}
    assert check_counters("sync", 1, 3, sync) == []


def test_a_lost_checkpoint_is_detected():
    assert check_restore(0, None, None, 5) == []  # no checkpoint before the kill: nothing to restore
    assert check_restore(0, 40, 40, 41) == []
    assert "restored version 30, older than its newest checkpoint ckpt-40" in check_restore(0, 40, 30, 30)[0]
    assert "restarted from its initial weights although checkpoint ckpt-40" in check_restore(1, 40, None, 0)[0]


def test_lost_updates_on_a_shard_that_never_restarted_are_detected():
    assert check_no_loss("sync", {0: 100, 1: 100}, 100, 2, (), 0) == []
    assert "rounds were lost" in check_no_loss("sync", {0: 99, 1: 100}, 100, 2, (), 0)[0]
    assert check_no_loss("sync", {0: 90, 1: 100}, 100, 2, {0}, 0) == []  # shard 0 restarted: it may lose some
    assert check_no_loss("async", {0: 199}, 100, 2, (), 1) == []  # one kill may skip one push
    assert "2 update(s) lost" in check_no_loss("async", {0: 198}, 100, 2, (), 0)[0]
    # a pair split by a cut link: its stepped-down primary said one update was lost; one more is a finding
    assert check_no_loss("async", {0: 199}, 100, 2, (), 0, {0: 1}) == []
    assert "2 update(s) lost" in check_no_loss("async", {0: 198}, 100, 2, (), 0, {0: 1})[0]


def test_weights_other_than_the_undisturbed_runs_are_detected():
    same = {"w": np.array([1.0, 2.0]), "b": np.array([0.5])}
    assert check_same_weights({k: v.copy() for k, v in same.items()}, same) == []
    nudged = {"w": np.array([1.0, np.nextafter(2.0, 3.0)]), "b": np.array([0.5])}
    (problem,) = check_same_weights(nudged, same)
    assert "variable w differs" in problem and "1 of 2 values" in problem
    assert "missing" in check_same_weights({"w": same["w"]}, same)[0]


def test_a_nan_is_detected():
    assert check_finite({"w": np.ones((2, 3)), "b": np.zeros(3)}, "final") == []
    w = np.ones((2, 3))
    w[1, 2] = np.nan
    b = np.array([0.0, np.inf])
    found = check_finite({"w": w, "b": b}, "final")
    assert found == ["final: b holds 1 non-finite value(s) (NaN/Inf)", "final: w holds 1 non-finite value(s) (NaN/Inf)"]


def test_wrong_exit_codes_are_detected():
    assert check_exit("shard 0", 0, 0, "after SIGTERM") == []
    assert check_exit("worker 1", -9, -9, "after SIGKILL") == []
    assert check_exit("shard 0", -9, 0, "after SIGTERM") == [
        "shard 0 exited with status -9, expected 0 (after SIGTERM)"
    ]
    assert check_exit("shard 0", None, 0, "within 10 s of SIGTERM") == ["shard 0 had not exited within 10 s of SIGTERM"]


def test_a_pair_without_its_follower_is_detected():
    leader = {"role": "primary", "replica_lag": 0, "follower": "127.0.0.1:2002 from 127.0.0.1:40112"}
    follows = {"role": "replica", "replica_lag": 0, "follower": ""}
    assert check_follows(0, leader, follows, "127.0.0.1:2002") == []
    (stranger,) = check_follows(0, {**leader, "follower": "127.0.0.1:9 from 127.0.0.1:9"}, follows, "127.0.0.1:2002")
    assert "followed by 127.0.0.1:9 from 127.0.0.1:9, not by its replica at 127.0.0.1:2002" in stranger
    (alone,) = check_follows(1, {**leader, "replica_lag": -1, "follower": ""}, follows, "127.0.0.1:2002")
    assert "shard 1's primary says it is followed by no one" in alone
    (claimed,) = check_follows(0, leader, {**follows, "replica_lag": -1}, "127.0.0.1:2002")  # a follower it has not
    assert "its replica at 127.0.0.1:2002 does not follow (role replica, lag -1)" in claimed
    assert "no primary answered" in check_follows(0, None, follows, "127.0.0.1:2002")[0]


def test_a_background_loop_that_failed_is_detected():
    assert check_background("shard0", "INFO ... checkpoint ckpt-40 written\n", 0) == []
    (died,) = check_background("shard0", 'Exception in thread shard0-checkpoints:\nOSError: [Errno 24]\n', 0)
    assert "shard0 logged an exception that ended a thread: Exception in thread shard0-checkpoints:" in died
    assert "replica1 counted 2 error(s) in its background loops" in check_background("replica1", "", 2)[0]


def _checkpoints(folder, versions, keep=10):
    shard = checkpoint.shard_dir(folder / "ckpt", 0, "0123456789abcdef")
    for v in versions:
        checkpoint.save(
            shard,
            v,
            {"weights": np.full(4, float(v), np.float32)},
            {"fingerprint": "0123456789abcdef", "shard": 0},
            keep=keep,
        )
    return shard, [folder / "shard0.addr"]  # a stopped shard has removed its port file


def test_a_clean_folder_passes_and_every_leak_is_detected(tmp_path):
    shard, ports = _checkpoints(tmp_path, [3, 7])
    assert check_files(tmp_path, tmp_path / "ckpt", 1, 2, ports, final_versions={0: 7}) == []

    (shard / ".ckpt-9.npz.tmp").write_bytes(b"half a checkpoint")  # a temporary file left behind
    (tmp_path / "shard0.addr.tmp").write_text("127.0.0.1:1")  # a stray port file
    found = check_files(tmp_path, tmp_path / "ckpt", 1, 2, ports, final_versions={0: 7})
    assert any("temporary file left behind" in p and ".ckpt-9.npz.tmp" in p for p in found), found
    assert any("temporary file left behind: shard0.addr.tmp" in p for p in found), found


@pytest.mark.parametrize("damage", ["flipped", "truncated", "manifest"])
def test_each_damage_of_the_corrupt_checkpoint_fault_makes_the_checkpoint_fail_its_check(tmp_path, damage):
    from psgd.bench.chaos.faults import damage_checkpoint

    shard, _ = _checkpoints(tmp_path, [3, 7])
    assert damage_checkpoint(tmp_path / "ckpt", 0, 7, damage) == f"damaged ckpt-7 ({damage})"
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load(shard, 7)
    assert checkpoint.load_latest(shard, None).path.name == "ckpt-3.json"  # the one before it passes


def test_too_many_or_damaged_checkpoints_and_a_missing_last_one_are_detected(tmp_path):
    shard, ports = _checkpoints(tmp_path, [1, 2, 3])
    (shard / "ckpt-5.npz").write_bytes(b"weights without a manifest")
    with open(shard / "ckpt-2.npz", "r+b") as f:  # flip a byte: no longer matches its checksum
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0xFF]))
    found = check_files(tmp_path, tmp_path / "ckpt", 1, 2, ports, final_versions={0: 4})
    text = "\n".join(found)
    assert "3 checkpoints kept, at most 2 allowed" in text
    assert "ckpt-5.npz has no manifest" in text
    assert "ckpt-2 is damaged" in text and "checksum" in text
    assert "shard 0 stopped at version 4 but its newest checkpoint is ckpt-3" in text
    (tmp_path / "shard0.addr").write_text("127.0.0.1:23456\n")
    assert "port file shard0.addr left behind by a shard that stopped" in check_files(
        tmp_path, tmp_path / "ckpt", 1, 3, ports
    )


def test_the_plan_is_replayed_from_its_seed_and_covers_every_kind():
    first = [Planner(5, KINDS, None).next(i).describe() for i in range(1)]
    again = [Planner(5, KINDS, None).next(i).describe() for i in range(1)]
    assert first == again
    planner = Planner(5, KINDS, None)  # (a kind that does not fit a run waits for one it fits: a few runs more)
    specs = [planner.next(i) for i in range(2 * -(-len(KINDS) // FAULTS_PER_RUN))]
    covered = {f.kind for s in specs for f in s.faults} | {"sigterm" for s in specs if s.end == "sigterm"}
    assert covered == set(KINDS)
    assert all(s.namespaces == any(f.kind == "netcut" for f in s.faults) for s in specs)
    without = Planner(5, ["netcut"], "not root")
    assert without.next(0).faults == [] and without.skipped == {"netcut": "not root"}


def test_pair_kinds_are_drawn_only_for_runs_with_replicas_and_end_kinds_only_at_the_end():
    planner = Planner(5, KINDS, None)
    specs = [planner.next(i) for i in range(40)]
    drawn = [(s, f) for s in specs for f in s.faults]
    assert {f.kind for _, f in drawn} >= set(WITH_REPLICAS) | set(WITH_CUTS) | set(AT_THE_END) | {"flood"}
    assert all(s.replicas for s, f in drawn if f.kind in WITH_REPLICAS)
    assert all(s.policy == "sync" for s, f in drawn if f.kind in WITH_CUTS)  # cuts to go back to
    for s in specs:
        ends = [f for f in s.faults if f.kind in AT_THE_END]
        if ends:  # after every other fault, once the workers have finished; the shards do not leave by themselves
            assert s.faults[-len(ends) :] == ends and all(f.at == 1.0 for f in ends), s.describe()
            assert s.end == "finish" and not s.exit_when_done, s.describe()
    floods = [f for _, f in drawn if f.kind == "flood"]  # more connections than a gRPC port takes
    assert all(1200 <= f.count <= 2000 and 2.0 <= f.seconds <= 4.0 for f in floods)
    storms = [(s, f) for s, f in drawn if f.kind == "rollback-storm"]  # as one of the run's ranks
    assert all(20 <= f.count <= 50 and 0 <= f.target < s.workers for s, f in storms)
    only = Planner(5, ["insider-follower"], None)  # a run without replicas draws none of them
    assert all(
        (s.replicas, [f.kind for f in s.faults]) in ((False, []), (True, ["insider-follower"] * 3))
        for s in (only.next(i) for i in range(6))
    )


def test_the_ci_seed_covers_every_kind_policy_and_transport():
    planner = Planner(CI_SEED, KINDS, None)
    specs = [planner.next(i) for i in range(SHORT_RUNS)]
    covered = {f.kind for s in specs for f in s.faults} | {"sigterm" for s in specs if s.end == "sigterm"}
    assert covered == set(KINDS)
    assert {s.policy for s in specs} == {"sync", "async"} and {s.transport for s in specs} == {"shm", "tcp", "grpc"}
    more = [planner.next(i) for i in range(SHORT_RUNS, 6)]
    assert {(s.policy, s.transport) for s in specs + more} == {
        (p, t) for p in ("sync", "async") for t in ("shm", "tcp", "grpc")
    }


def test_every_third_run_is_the_sparse_job():
    planner = Planner(CI_SEED, KINDS, None)
    models = [planner.next(i).model for i in range(9)]
    assert [i for i, m in enumerate(models) if m == "embed"] == [2, 5, 8]
    assert set(models) - {"embed"} <= {"softmax", "mlp"}


def test_unknown_kinds_are_refused():
    assert parse_kinds("all") == list(KINDS) and parse_kinds("hostile, kill-shard") == ["hostile", "kill-shard"]
    with pytest.raises(ValueError, match="--kinds: unknown kill-everything; choose from kill-shard"):
        parse_kinds("kill-everything")
    with pytest.raises(SystemExit):
        chaos_main(["--kinds", "nope"])


def test_the_suites_command_refuses_an_unknown_kind_with_status_2():
    done = subprocess.run(
        [sys.executable, "-m", "psgd.bench.chaos", "--kinds", "nope"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "chaos: error: --kinds: unknown nope; choose from kill-shard" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_the_outsider_is_refused_every_call_and_changes_nothing(monkeypatch):
    """The ``outsider`` fault's client (a process with the token that never registered), against a shard whose
    worker 0 is live: each of its calls is refused, and the weights, the version and the worker's clock are as
    they were; the worker goes on."""
    from psgd.bench.chaos.hostile import outsider
    from psgd.job import describe_job
    from psgd.server import build_shard
    from psgd.server.net.service import ShardServer

    job = make_job(
        "model.name=softmax", "cluster.policy=async", "cluster.workers=1", "cluster.shards=1", "cluster.transport=tcp"
    )
    server = ShardServer(build_shard(describe_job(job), 0), "127.0.0.1:0", transport="tcp", token=TOKEN).start()
    monkeypatch.setenv("PSGD_TOKEN", TOKEN)
    plan, core = server.core.plan, server.core
    try:
        job = job.override("cluster.servers", [server.address])
        with PSClient(
            [server.address], plan, 0, deadlines=Deadlines(request_timeout=10), token=TOKEN, config=job
        ) as client:
            client.register()
            grads = {s.name: np.full(s.shape, 1e-3, np.float32) for s in plan.specs}
            client.push(0, grads)
            before = (core.version, core.flat.copy(), core.policy.clock_of(0))
            slices = [[dataclasses.asdict(s) for s in plan.slices_for_shard(0)]]
            stats = outsider([(server.address, server.data.port)], slices, 0, plan.hash)
            assert stats["accepted"] == [] and stats["refused"] == stats["tried"] == 6, stats
            assert (core.version, core.policy.clock_of(0)) == (before[0], before[2])
            np.testing.assert_array_equal(core.flat, before[1])
            assert [r.outcome for r in client.push(1, grads)] == ["applied"]  # worker 0 goes on
    finally:
        server.stop(grace=1.0)


def test_an_insider_claiming_the_replicas_place_is_refused_and_the_replica_keeps_following(monkeypatch):
    """The ``insider-follower`` fault's client (a process with the token), against a primary whose replica follows:
    asking to follow as the replica (from elsewhere) and as a replica of its own address is refused both times, and
    the primary is followed by its replica still; the client would tell an acceptance (the state sent)."""
    from psgd.bench.chaos.hostile import follow_as
    from psgd.job import describe_job
    from psgd.server import build_shard
    from psgd.server.durable.replica import Replication
    from psgd.server.net.service import ShardServer

    job = make_job(
        "model.name=softmax", "cluster.policy=async", "cluster.workers=1", "cluster.shards=1", "cluster.replicas=1"
    )
    d = describe_job(job)
    primary, replica = (
        ShardServer(build_shard(d, 0), "127.0.0.1:0", replicated=True, token=TOKEN).start() for _ in range(2)
    )
    monkeypatch.setenv("PSGD_TOKEN", TOKEN)
    try:
        Replication(primary.core, primary.address, replica.address, second=False, token=TOKEN).start()
        Replication(replica.core, replica.address, primary.address, second=True, token=TOKEN).start()
        wait_for(lambda: primary.core.replication.lag() == 0, 10, "the replica to follow")
        stats = follow_as("127.0.0.1", primary.data.port, [replica.address, "127.0.0.1:1"], d.plan.hash)
        assert stats == {"tried": 2, "refused": 2, "accepted": []}, stats
        pair = primary.core.replication
        assert pair.attached and pair.follower.startswith(f"{replica.address} from "), pair.follower
        assert replica.core.replication.following
    finally:
        for s in (primary, replica):
            s.core.replication.stop(finished=True)
        for s in (primary, replica):
            s.stop(grace=1.0)


def test_a_rollback_storm_from_a_finished_rank_is_refused_every_time_and_told_when_it_is_not(tmp_path, monkeypatch):
    """The ``rollback-storm`` fault's client (a token holder that registers as a worker that has finished), against
    two sync shards with cuts: every rollback it asks for a restart it cannot prove is refused with
    FAILED_PRECONDITION and counted, no version goes back, and it says Done; against shards that believe any cause it
    tells each one accepted (so the fault's checks can fail)."""
    from psgd.bench.chaos.insiders import storm
    from psgd.server import build_shard
    from psgd.server.durable import peers, recovery
    from psgd.server.net.service import ShardServer

    job = make_job(
        "model.name=softmax",
        "cluster.policy=sync",
        "cluster.workers=1",
        "cluster.shards=2",
        "cluster.checkpoint_rounds=2",
        "cluster.transport=tcp",
        "cluster.request_timeout=6",
    )
    servers = []
    for k in range(2):
        servers.append(
            ShardServer(
                build_shard(describe_job(job), k),
                "127.0.0.1:0",
                transport="tcp",
                token=TOKEN,
                checkpoint_dir=str(tmp_path / "ckpt"),
                job_shards=lambda: job.cluster.servers,
            ).start()
        )
    job = job.override("cluster.servers", [s.address for s in servers])
    (tmp_path / "job.toml").write_text(to_toml(job.to_dict()))
    monkeypatch.setenv("PSGD_TOKEN", TOKEN)
    try:
        plan = servers[0].core.plan
        with PSClient(
            job.cluster.servers, plan, 0, deadlines=Deadlines(request_timeout=6), token=TOKEN, config=job
        ) as client:
            client.register()
            grads = {s.name: np.full(s.shape, 1e-3, np.float32) for s in plan.specs}
            for clock in range(5):  # cuts at 0, 2 and 4
                client.push(clock, grads)
            client.done()
        asked = dict(config=str(tmp_path / "job.toml"), worker=0, rounds=6, bind="127.0.0.1:0", seed=3, timeout=6.0)
        stats = storm(**asked)
        assert stats["accepted"] == [] and stats["cuts"] == [4, 4] and stats["done"] == "", stats
        assert stats["tried"] == stats["refused"] == [6, 6] and stats["codes"] == {"FAILED_PRECONDITION": 12}, stats
        assert [s.core.version for s in servers] == [5, 5]
        assert [s.core.counters["rollbacks_refused"] for s in servers] == [6, 6]
        assert all(s.core.roster.workers[0].state == "done" for s in servers)  # it said Done: no lease runs out
        monkeypatch.setattr(peers, "restart_of", lambda *_, **__: "")  # shards that believe any cause
        monkeypatch.setattr(recovery, "own_restart", lambda *_: "")
        believed = storm(**{**asked, "rounds": 2})
        assert [a.startswith(f"shard {k} went back to the cut at 4") for k, a in enumerate(believed["accepted"])] == [
            True,
            True,
        ], believed  # (then each refuses this worker until it goes back too)
        assert "goes back to the cut at version 4" in believed["done"], believed
    finally:
        for s in servers:
            s.stop(grace=1.0)


# -- the short run ------------------------------------------------------------------------------------------
def _namespaces_of_this_process() -> str:
    done = subprocess.run([IP, "netns", "list"], capture_output=True, text=True, timeout=20)
    return "\n".join(line for line in done.stdout.splitlines() if f"{PREFIX}{os.getpid()}" in line)


@pytest.mark.slow
def test_a_short_chaos_run_of_every_fault_kind_finds_no_violation(tmp_path):
    seed = int(os.environ.get("PSGD_CHAOS_SEED", CI_SEED))
    print(
        f"chaos seed {seed}: replay with PSGD_CHAOS_SEED={seed} "
        f"or benchmarks/chaos.py --runs {SHORT_RUNS} --seed {seed}"
    )
    result = run_chaos(0, seed, "all", out=tmp_path, progress=False, runs=SHORT_RUNS)
    shown = json.dumps([{k: v for k, v in x.items() if k != "logs"} for x in result["violations"]], indent=1)
    assert result["violations"] == [], (
        f"seed {seed}: {result['violation_count']} violation(s):\n{shown}\n"
        + "\n\n".join(f"{name}:\n{text}" for x in result["violations"][:2] for name, text in x["logs"].items())
    )
    for kind in KINDS:
        assert result["faults"][kind] >= 1 or kind in result["skipped"], (kind, result["faults"], result["skipped"])
    assert result["runs"] == SHORT_RUNS and len(result["accuracies"]) >= 1
    assert all(a >= MIN_ACCURACY for a in result["accuracies"]), result["accuracies"]
    if seed == CI_SEED:  # its run 1 (sync: a shard restarted, killed; a rollback storm) matched an undisturbed run
        assert result["run_records"][1]["same_as_undisturbed"] is True, result["run_records"][1]
    if os.path.exists(IP):
        assert _namespaces_of_this_process() == ""  # every namespace made is gone


# -- product bugs the chaos suite found, reproduced deterministically -----------------------------------------
def test_a_sync_job_survives_a_worker_killed_between_its_pushes_to_two_shards():
    """Found with ``benchmarks/chaos.py --runs 5 --seed 11 --kinds kill-worker`` (run 2).

    A sync worker pushes each step to every shard; SIGKILLed between the two pushes, its clock c reached
    shard 1 only.  Restarted, it registers: shard 0 says c, shard 1 says c + 1, and the client continues from
    the largest (PSClient.register), so it never pushes c to shard 0, whose round c then waits for it (it is
    live: its heartbeats renew its lease) until every worker's pull fails with DEADLINE_EXCEEDED.

    The same happens without a kill whenever a sync worker takes its clock from shards that are a round
    apart (a push reaches the shards one after the other): a worker that (re)joins late, or whose lease ran
    out (a pause, a network cut) and whose stale push is answered "late" with each shard's open round, which
    the loop also merges with max (run_worker's ``new_clock``).  The short chaos run hits that most times.
    """
    job = make_job(
        "model.name=softmax",
        "cluster.policy=sync",
        "cluster.workers=2",
        "cluster.shards=2",
        "train.epochs=1",
        "cluster.lease_seconds=2",
        "cluster.request_timeout=5",
        "cluster.transport=grpc",
    )
    with shards(job) as (job, servers):
        plan = servers[0].core.plan
        grads = {s.name: np.zeros(s.shape, np.float32) for s in plan.specs}
        clients = [
            PSClient(job.cluster.servers, plan, r, config=job, deadlines=Deadlines(request_timeout=5)) for r in range(2)
        ]
        try:
            for c in clients:
                c.register()
            run_threads([lambda: clients[0].push(0, grads), lambda: clients[1].push(0, grads)], 30)  # round 0
            core = servers[1].core  # worker 1's push of clock 1 reached shard 1, then the worker was killed
            core.push(1, 1, core.version, {i: np.zeros(sl.size, np.float32) for i, sl in core.slices.items()})
        finally:
            for c in clients:
                c.close()
        stalled = None
        try:  # both workers (re)start, as psgd-worker does, and train to the end
            results = run_threads(
                [lambda r=r: run_worker(job, r, job.cluster.servers, progress=False) for r in range(2)], 90
            )
        except PSError as exc:
            stalled = str(exc)
    if stalled:
        pytest.fail(
            f"violation [finishes]: the sync job stalled after a worker was killed between its pushes to "
            f"two shards: {stalled}",
            pytrace=False,
        )
    assert [r.final_clock for r in results] == [22, 22]


def _shard_process(job_path, port, *extra):
    return subprocess.Popen(
        [
            *command("psgd-server", "psgd.cli.server"),
            "-c",
            str(job_path),
            "--shard",
            "0",
            "--bind",
            f"127.0.0.1:{port}",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=by_hand_env(),
    )


@pytest.mark.slow
def test_an_exit_when_done_shard_paused_longer_than_the_lease_keeps_serving(tmp_path):
    """Found with ``benchmarks/chaos.py --runs 4 --seed 5 --kinds stop-shard,stop-worker`` (run 2).

    A ``psgd-server --exit-when-done`` paused (SIGSTOP here; a VM freeze or a swap storm alike) for longer than
    the lease finds every lease expired when it resumes, drops every worker, takes that for "every worker has
    finished" and exits 0 while its workers are alive and training: they fail after request_timeout.
    """
    job = make_job(
        "model.name=softmax", "cluster.policy=sync", "cluster.workers=1", "cluster.shards=1", "cluster.lease_seconds=1"
    )
    port = free_port_pair(random.Random(), set())
    job = job.override("cluster.servers", [f"127.0.0.1:{port}"])
    (tmp_path / "job.toml").write_text(to_toml(job.to_dict()))
    shard = _shard_process(tmp_path / "job.toml", port, "--exit-when-done")
    try:
        plan = PartitionPlan(build_job(job).model.specs(), 1, job.cluster.links.slice_bytes)
        with PSClient(
            job.cluster.servers, plan, 0, config=job, deadlines=Deadlines(request_timeout=10), token=TOKEN
        ) as client:
            client.wait_ready(30)
            client.register()
            client.start_heartbeats()  # a live worker, renewing its lease
            shard.send_signal(signal.SIGSTOP)
            time.sleep(2.5)  # the pause, longer than the 1 s lease, is the fault
            shard.send_signal(signal.SIGCONT)
            wait_for(
                lambda: shard.poll() is not None or _holds_live_lease(client),
                30,
                "the resumed shard to renew its worker's lease (or to exit)",
            )
            code = shard.poll()
        if code is not None:
            said = [line for line in shard.stderr.read().splitlines() if "lease" in line or "stopping" in line]
            pytest.fail(
                f"violation [finishes]: psgd-server --exit-when-done exited with status {code} after a "
                "2.5 s pause while its worker was live:\n" + "\n".join(said),
                pytrace=False,
            )
    finally:
        shard.kill()
        shard.wait(10)


def _holds_live_lease(client: PSClient) -> bool:
    """The shard has seen its worker since it resumed: live, with a lease that ends in the future (renewed by
    a heartbeat, or given anew when the worker registered again after the shard dropped it).  From then on
    the worker is not finished, so a shard that has not exited by now keeps serving."""
    try:
        (reply,) = client.status()
    except PSError:
        return False  # the shard exited meanwhile: the caller sees it
    return all(w.state == "live" and w.lease_left_seconds > 0 for w in reply.workers)


def test_a_worker_sigtermed_as_it_exits_still_exits_0(tmp_path):
    """Found by the short chaos run (SIGTERM to every process while a worker had just finished).

    Every process must exit 0 on SIGTERM at any point.  A worker that has finished (its "done" line is
    written) spends a few tens of ms tearing down the interpreter and gRPC; CPython puts back the default
    signal handlers early in that teardown, so a SIGTERM then kills it: status -15 (143 to a shell, Docker or
    Kubernetes) instead of 0.  Tried at a few moments of that teardown.
    """
    job = make_job("model.name=softmax", "cluster.workers=1", "cluster.shards=1", "train.epochs=1")
    port = free_port_pair(random.Random(), set())
    job = job.override("cluster.servers", [f"127.0.0.1:{port}"])
    (tmp_path / "job.toml").write_text(to_toml(job.to_dict()))
    shard = _shard_process(tmp_path / "job.toml", port)
    codes = {}
    try:
        for delay in (0.005, 0.015, 0.03):
            worker = subprocess.Popen(
                [
                    *command("psgd-worker", "psgd.cli.worker"),
                    "-c",
                    str(tmp_path / "job.toml"),
                    "--rank",
                    "0",
                    "--no-progress",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                env=by_hand_env(),
            )
            guard = threading.Timer(60, worker.kill)  # bounds the read below, should the worker hang
            guard.start()
            try:
                for line in worker.stderr:
                    if " done: " in line:
                        time.sleep(
                            delay
                        )  # the fault: a SIGTERM this far into its teardown ("at any point" includes this one)
                        worker.send_signal(signal.SIGTERM)
                        break
                worker.stderr.read()
                codes[delay] = worker.wait(30)
            finally:
                guard.cancel()
                worker.kill()
                worker.wait(10)
    finally:
        shard.kill()
        shard.wait(10)
    bad = {f"{d * 1000:.0f} ms": c for d, c in codes.items() if c != 0}
    assert not bad, (
        f"violation [exit-code]: psgd-worker exited with status {bad} on a SIGTERM that arrived that "
        "long after it logged that it was done; expected 0"
    )


def test_the_full_disk_fault_refuses_writes_and_leaves_the_folder_as_it_was(tmp_path):
    """The ``full-disk`` fault's disk: the folder's files are still there, a new file cannot be written (ENOSPC, as
    a shard's checkpoint meets it), and once it ends the folder is the one it was, the files written to it gone."""
    from helpers import skip_or_fail

    from psgd.bench.chaos.disk import full

    (tmp_path / "ckpt-3.npz").write_bytes(b"x" * 10000)
    with full(tmp_path) as why:
        if why:
            skip_or_fail(why)
        assert (tmp_path / "ckpt-3.npz").read_bytes() == b"x" * 10000
        with pytest.raises(OSError) as info:
            (tmp_path / "ckpt-4.npz").write_bytes(b"y" * 10000)
        assert info.value.errno == 28  # ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-3.npz"]


def test_a_finished_run_without_a_measured_accuracy_leaves_it_out_of_the_figures():
    """A run stopped by a violation in its last checks finished with no accuracy measured: the summary of a
    10-minute run (seed 7474) ended in a TypeError, and its JSON was never written."""
    from psgd.bench.chaos.suite import accuracies, summary

    records = [
        {"finished": True, "accuracy": 0.95},
        {"finished": True, "accuracy": None},
        {"finished": False, "accuracy": None},
    ]
    assert accuracies(records) == [0.95]
    result = {
        "seed": 1,
        "runs": 3,
        "seconds": 1.0,
        "faults": {},
        "faults_total": 0,
        "violation_count": 0,
        "durations": [1.0],
        "accuracies": accuracies(records),
        "skipped": {},
        "violations": [],
    }
    assert "final accuracies: 0.950" in summary(result)


@pytest.mark.slow
def test_a_short_elastic_chaos_run_finds_no_violation(tmp_path):
    """Jobs with a range of workers (psgd.bench.chaos.elastic): joins, leaves, kills and pauses past the lease under
    every policy.  Its first runs found a worker paused past its lease pushing the batch that had gone to another
    worker meanwhile (a batch trained twice; the batches of a lapsed lease now stay its rank's until no other is
    left)."""
    seed = int(os.environ.get("PSGD_CHAOS_SEED", 7))
    out = tmp_path / "elastic.json"
    code = chaos_main(["--elastic", "--runs", "4", "--seed", str(seed), "--no-progress", "--json", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["violations"] == [], (
        f"replay with PSGD_CHAOS_SEED={seed} or benchmarks/chaos.py --elastic --runs 4 --seed {seed}: "
        + json.dumps(result["violations"], indent=1)[:4000]
    )
    assert len(result["runs"]) == 4 and {r["spec"].split(":")[1].split()[0] for r in result["runs"]} == {
        "sync",
        "async",
        "ssp",
        "local",
    }
