"""The simulator (psgd bench simulate) against what can be worked out by hand: one worker's step as the sum of its
parts, the closed forms of bandwidth-bound all-reduce and parameter server (BytePS, OSDI 2020), ssp's bound, sync's
backup workers, and cores shared by the work on them."""

from __future__ import annotations

import pytest

from psgd.bench.simulate.engine import Cpu, Sim
from psgd.bench.simulate.job import Costs, Layout, simulate

FREE = Costs(
    compute=0.0,
    shard_request=0.0,
    shard_per_byte=0.0,
    joint_request=0.0,
    joint_per_byte=0.0,
    worker_request=0.0,
    worker_per_byte=0.0,
    wake=0.0,
    cores=1.0,
    hop=0.0,
    ring_rate=1e9,
)


def costs(**changes) -> Costs:
    import dataclasses

    return dataclasses.replace(FREE, **changes)


def test_one_sync_worker_steps_at_the_sum_of_its_parts():
    c = costs(
        compute=100e-6,
        joint_request=30e-6,
        joint_per_byte=1e-9,
        worker_joint=20e-6,
        worker_per_byte=0.5e-9,
        wake=15e-6,
        cores=2.0,
        worker_step=7e-6,
    )
    step = 100e-6 + 7e-6 + 20e-6 + 0.5e-9 * 10_000 + 30e-6 + 1e-9 * 10_000 + 15e-6
    assert simulate(c, Layout(1, 1, "sync", 10_000))["steps_per_s"] == pytest.approx(1 / step, rel=1e-6)


def test_ranks_waiting_in_an_allreduce_take_their_share_of_the_cores():
    """MPI's ranks spin while they wait for each other: four ranks on two cores compute at half speed even when the
    others are done with theirs."""
    c = costs(compute=100e-6, hop=0.0, ring_rate=1e12, cores=2.0)
    two = 2 / simulate(c, Layout(2, 1, "allreduce", 1000), steps=200, warmup=20)["steps_per_s"]
    four = 4 / simulate(c, Layout(4, 1, "allreduce", 1000), steps=400, warmup=40)["steps_per_s"]
    assert two == pytest.approx(100e-6, rel=1e-3) and four == pytest.approx(200e-6, rel=1e-3)


def test_async_pays_two_round_trips_where_sync_pays_one():
    c = costs(
        compute=100e-6,
        shard_request=30e-6,
        joint_request=30e-6,
        worker_request=20e-6,
        worker_joint=20e-6,
        wake=15e-6,
        cores=2.0,
    )
    sync = 1 / simulate(c, Layout(1, 1, "sync", 1000))["steps_per_s"]
    asynchronous = 1 / simulate(c, Layout(1, 1, "async", 1000))["steps_per_s"]
    assert sync == pytest.approx(100e-6 + 20e-6 + 30e-6 + 15e-6)
    assert asynchronous == pytest.approx(100e-6 + 2 * (20e-6 + 30e-6 + 15e-6))


@pytest.mark.parametrize("n", [2, 4, 16])
def test_bandwidth_bound_ring_allreduce_takes_2_n_minus_1_over_n_model_over_rate(n):
    rate, model = 1.25e9, 100e6  # 10 Gbit/s, a 100 MB gradient
    step = (
        n
        / simulate(costs(), Layout(n, 1, "allreduce", model, rate=rate, latency=0.0), steps=5 * n, warmup=n)[
            "steps_per_s"
        ]
    )
    assert step == pytest.approx(2 * (n - 1) / n * model / rate, rel=1e-6)


def test_one_bandwidth_bound_sync_worker_pushes_then_pulls():
    rate, model = 1.25e9, 100e6
    step = 1 / simulate(costs(), Layout(1, 1, "sync", model, rate=rate, latency=0.0), steps=10, warmup=2)["steps_per_s"]
    assert step == pytest.approx(2 * model / rate, rel=1e-6)


@pytest.mark.parametrize("n, k", [(4, 1), (4, 4), (16, 4), (8, 16)])
def test_bandwidth_bound_sync_ps_is_within_bytepss_bound_and_twice_it(n, k):
    """BytePS's non-colocated parameter server moves max(M/B, nM/(kB)) each way at once (full duplex); a sync round
    pushes before it pulls, but a worker whose weights came early pushes again while others still pull, and a shard
    whose round closed answers while other shards still take pushes: a step lies between the bound and twice it."""
    rate, model = 1.25e9, 100e6
    step = (
        n
        / simulate(costs(), Layout(n, k, "sync", model, rate=rate, latency=0.0), steps=20 * n, warmup=4 * n)[
            "steps_per_s"
        ]
    )
    bound = max(model / rate, n * model / (k * rate))
    assert bound * (1 - 1e-9) <= step <= 2 * bound * (1 + 1e-9)


def test_ssp_holds_a_fast_worker_within_its_bound_of_a_slow_one():
    c = costs(compute=100e-6, shard_request=1e-6, worker_request=1e-6, cores=4.0)
    slow = {1: 10.0}  # worker 1's gradient takes ten times as long
    free = simulate(c, Layout(2, 1, "async", 1000, slow=slow), steps=400)["steps_per_s"]
    bound = simulate(c, Layout(2, 1, "ssp", 1000, staleness=2, slow=slow), steps=400)["steps_per_s"]
    slow_rate = 1 / (10 * 100e-6 + 4e-6)
    assert free > 5 * slow_rate  # async: the fast worker runs on
    assert bound == pytest.approx(2 * slow_rate, rel=0.05)  # ssp: it waits for the slow one, 2 clocks ahead


def test_sync_backup_workers_close_rounds_without_the_straggler():
    c = costs(compute=100e-6, joint_request=1e-6, worker_joint=1e-6, cores=8.0)
    slow = {3: 20.0}
    waiting = simulate(c, Layout(4, 1, "sync", 1000, slow=slow), steps=200)["steps_per_s"]
    backed = simulate(c, Layout(4, 1, "sync", 1000, backup_workers=1, slow=slow), steps=200)["steps_per_s"]
    assert waiting == pytest.approx(4 / (20 * 100e-6 + 2e-6), rel=0.05)
    assert backed > 5 * waiting


def test_cores_are_shared_by_the_work_on_them():
    sim = Sim()
    cpu = Cpu(sim, cores=2.0)
    done = {}
    for name, seconds in (("a", 1.0), ("b", 1.0), ("c", 1.0), ("d", 0.5)):
        cpu.work(seconds, lambda name=name: done.setdefault(name, sim.now))
    sim.run(10.0)
    # four at half a core each until d is done (at 1.0), then three at 2/3 of a core for what is left of a, b, c
    assert done["d"] == pytest.approx(1.0)
    assert done["a"] == done["b"] == done["c"] == pytest.approx(1.0 + 0.5 / (2 / 3))
    assert cpu.busy == pytest.approx(3.5)


def _command(*argv: str) -> int:
    import argparse

    from psgd.bench.simulate import command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return command.run_from_args(parser.parse_args(list(argv)))


def test_the_command_reads_costs_back_and_writes_them(tmp_path):
    import dataclasses
    import json

    saved = tmp_path / "costs.json"
    c = costs(compute=1e-4, wake=2e-5, cores=1.5)
    saved.write_text(json.dumps({"costs": dataclasses.asdict(c), "calibration": {"seconds": 1.0}}))
    out = tmp_path / "out.json"
    assert _command("--costs", str(saved), "--json", str(out)) == 0
    written = json.loads(out.read_text())
    assert Costs(**written["costs"]) == c and written["calibration"] == {"seconds": 1.0}


def test_a_prediction_answers_for_the_users_job(tmp_path, capsys):
    import dataclasses
    import json

    saved, out = tmp_path / "costs.json", tmp_path / "out.json"
    c = costs(
        compute=1e-4,
        joint_request=1e-4,
        joint_per_byte=1e-9,
        worker_joint=1e-4,
        shard_request=1e-4,
        worker_request=1e-4,
        cores=2.0,
        hop=1e-5,
    )
    saved.write_text(json.dumps({"costs": dataclasses.asdict(c)}))
    assert (
        _command(
            "--costs",
            str(saved),
            "--workers",
            "16",
            "--shards",
            "4",
            "--network",
            "10gbit",
            "--model",
            "resnet50",
            "--json",
            str(out),
        )
        == 0
    )
    said = capsys.readouterr().out
    figures = json.loads(out.read_text())["prediction"]
    assert (
        figures["workers"] == 16
        and figures["shards"] == 4
        and set(figures["steps_per_s"]) == {"sync", "async", "ssp", "allreduce"}
    )
    assert "16 workers, 4 shard(s), ResNet-50-sized" in said and "90% of all-reduce" in said
    with pytest.raises(SystemExit, match="name the model"):
        _command("--costs", str(saved), "--workers", "16")


def test_the_validation_grid_covers_every_policy_and_shard_count():
    from psgd.bench.simulate.command import validation_grid

    grid = validation_grid(True)
    assert {p for _, _, p in grid} == {"sync", "async", "ssp", "allreduce"}
    assert {(n, k) for n, k, p in grid if p == "ssp"} == {(n, k) for n in (1, 2, 4) for k in (1, 2)}
    assert not [g for g in validation_grid(False) if g[2] == "allreduce"]


def test_one_process_runs_one_piece_of_work_at_a_time_however_many_it_has():
    sim = Sim()
    cpu = Cpu(sim, cores=2.0)
    done = {}
    for name in ("a", "b"):  # one process's two threads: one core between them (the GIL)
        cpu.work(1.0, lambda name=name: done.setdefault(name, sim.now), owner="worker")
    cpu.work(1.0, lambda: done.setdefault("c", sim.now), owner="shard")  # another process: a core of its own
    sim.run(10.0)
    assert done["c"] == pytest.approx(1.0) and done["a"] == done["b"] == pytest.approx(2.0)


def test_crowded_cores_give_what_was_measured_for_four():
    cpu = Cpu(Sim(), cores=1.9, four=1.5)
    assert [cpu.capacity(n) for n in (1, 2, 3, 4, 9)] == pytest.approx([1.0, 1.9, 1.7, 1.5, 1.5])
    assert Cpu(Sim(), cores=2.0).capacity(9) == 2.0  # hosts of real cores: as many as they have


def test_watching_ends_save_the_measured_cpu_of_a_round_trip():
    c = costs(compute=100e-6, joint_request=40e-6, worker_joint=30e-6, wake=0.0, cores=2.0, watch_saves=20e-6)
    sleeping = 1 / simulate(c, Layout(1, 1, "sync", 1000))["steps_per_s"]
    watching = (
        1
        / simulate(dataclasses_replace(c, wake_watching=5e-6), Layout(1, 1, "sync", 1000, watching=True))["steps_per_s"]
    )
    assert sleeping == pytest.approx(170e-6) and watching == pytest.approx(170e-6 - 20e-6 + 5e-6)


def dataclasses_replace(c, **changes):
    import dataclasses

    return dataclasses.replace(c, **changes)


def test_async_watching_ends_save_what_was_measured_for_a_round_trip_of_its_own():
    c = costs(
        compute=100e-6,
        shard_request=40e-6,
        worker_request=30e-6,
        wake=50e-6,
        wake_watching=5e-6,
        cores=2.0,
        watch_saves=50e-6,
        watch_saves_request=20e-6,
    )
    watching = 1 / simulate(c, Layout(1, 1, "async", 1000, watching=True))["steps_per_s"]
    assert watching == pytest.approx(100e-6 + 2 * (30e-6 + 40e-6 + 5e-6 - 20e-6))


def test_a_jobs_own_cpu_a_step_gives_its_step_back():
    """With each process's parts scaled to the CPU it spent a step in a launch (calibrate.as_in), a lone sync worker
    steps in its CPU, its shard's and the wait: the scaling keeps the parts' proportions and sets their sum."""
    from psgd.bench.simulate.calibrate import as_in

    c = costs(
        compute=100e-6,
        worker_joint=20e-6,
        joint_request=30e-6,
        joint_per_byte=1e-9,
        wake=10e-6,
        cores=2.0,
        cores_four=1.5,
    )
    layout = Layout(1, 1, "sync", 10_000)
    launch = {"steps_per_s": 0.0, "busy_poll_us": 0, "worker-0": 300e-6, "server-0": 80e-6, "main-1": 0.0}
    own = as_in(c, launch, layout)
    assert own.compute / own.worker_joint == pytest.approx(5.0) and own.cores_four == 0.0
    assert 1 / simulate(own, layout)["steps_per_s"] == pytest.approx(300e-6 + 80e-6 + 10e-6)


def test_a_jobs_own_cpu_counts_each_workers_steps_and_async_requests():
    """A launch's CPU is per step of the whole job: each of 2 workers took half of them; an async shard answers a
    push and a pull for each."""
    from psgd.bench.simulate.calibrate import as_in

    c = costs(compute=100e-6, worker_request=10e-6, shard_request=30e-6, cores=2.0)
    launch = {"worker-0": 150e-6, "worker-1": 150e-6, "server-0": 100e-6}
    own = as_in(c, launch, Layout(2, 1, "async", 1000))
    assert own.compute + 2 * own.worker_request == pytest.approx(300e-6)
    assert own.shard_request == pytest.approx(50e-6)


def test_emulated_hosts_share_one_machines_cores():
    """Each process on a host of its own with a link, all on one machine: four workers' gradients on 2 cores take
    twice as long as on hosts of their own."""
    c = costs(compute=100e-6, cores=2.0)
    own = simulate(c, Layout(4, 1, "async", 1000, rate=1e12, latency=0.0))["steps_per_s"]
    shared = simulate(c, Layout(4, 1, "async", 1000, rate=1e12, latency=0.0, one_machine=True))["steps_per_s"]
    assert own == pytest.approx(4 / 100e-6, rel=1e-3) and shared == pytest.approx(2 / 100e-6, rel=1e-3)


def test_bytepss_bound_is_where_the_parameter_servers_bandwidth_beats_the_rings():
    """max(M/B, nM/(kB)) < 2(n-1)M/(nB) from k servers on: 16 workers need 9, 1,024 need 513."""
    from psgd.bench.simulate.questions import bytepss_bound

    for n in (3, 16, 64, 1024):
        k = bytepss_bound(n)
        assert max(1, n / k) < 2 * (n - 1) / n <= max(1, n / (k - 1))
    assert bytepss_bound(16) == 9 and bytepss_bound(1024) == 513


def test_the_fewest_shards_for_a_target_uses_what_is_known_and_says_when_none_reach_it():
    from psgd.bench.simulate.predict import Model, shards_for, steps_per_s

    c = costs(compute=10e-3, joint_request=1e-4, joint_per_byte=1e-9, worker_joint=1e-4, cores=2.0, hop=1e-5)
    model = Model("m", 100e6, 10e-3, "test")
    rate = 25e9 / 8
    known: dict[int, float] = {}
    one, four = steps_per_s(c, model, 16, 1, rate), steps_per_s(c, model, 16, 4, rate)
    assert four > 2 * one  # a shard's bytes and CPU split four ways
    assert shards_for(c, model, 16, rate, 0.99 * four, known) == 4 and set(known) == {1, 2, 4}
    assert known[4] == pytest.approx(four)
    assert shards_for(c, model, 16, rate, 1e9) is None


def test_a_model_names_its_preset_or_its_job_files_size():
    from psgd.bench.simulate.predict import model

    assert model("resnet50").nbytes == pytest.approx(102.2e6, rel=1e-3)
    assert model("vgg16", compute=0.1).compute == 0.1 and model("vgg16").compute == pytest.approx(64 / 154)


def test_a_job_files_model_is_its_partition_plans_bytes(tmp_path):
    from psgd.bench.simulate.predict import model

    job = tmp_path / "job.toml"
    job.write_text("[model]\nname = \"mlp\"\nhidden = [64]\n")
    found = model(str(job), compute=0.01)
    assert found.nbytes == 4 * (64 * 64 + 64 + 64 * 10 + 10) and found.compute == 0.01
    with pytest.raises(SystemExit, match="not a job file"):
        model(str(tmp_path / "missing.toml"))


def test_the_questions_tables_show_efficiency_and_shards(tmp_path):
    from psgd.bench.simulate import questions
    from psgd.bench.simulate.predict import Model

    m = Model("tiny", 1e6, 1e-3, "test")
    result = {
        "models": [m.__dict__],
        "shards": [1, 4],
        "networks": ["25gbit"],
        "workers": [16],
        "rows": [
            {
                "model": "tiny",
                "network": "25gbit",
                "workers": 16,
                "allreduce": 8000.0,
                "sync": {"1": 4000.0, "4": 12000.0},
                "shards_for_90": 4,
                "shards_to_beat": None,
                "bytepss_bound": 9,
            }
        ],
        "stragglers": [{"model": "tiny", "workers": 64, "sync": 100.0, "async": 250.0}],
        "published": [{"model": "tiny", "allreduce_512_25gbit": 0.5, "best_sync_over_allreduce_256_100gbit": 1.5}],
    }
    text = questions.markdown(result)
    assert "| 25gbit | 16 | 25% | 75% | 50% | 4 | > 64 | 9 |" in text and "| tiny | 64 | 100.0 | 250.0 | 2.50 |" in text
    assert "| tiny | 50% | 1.50x |" in text


def test_an_emulated_links_bucket_lets_a_burst_through_then_holds_to_its_rate():
    """tbf's token bucket: bytes it has tokens for pass at once, the rest at the rate; spent tokens come back at
    the rate. Without a bucket (a real link) every byte takes its time."""
    from psgd.bench.simulate.engine import Nic, send

    sim, arrived = Sim(), []
    a, b = Nic(1e6, 0.0, burst=1000.0), Nic(1e6, 0.0, burst=1000.0)
    send(sim, a, b, 600, lambda: arrived.append(sim.now))  # within the bucket: at once
    send(sim, a, b, 600, lambda: arrived.append(sim.now))  # 400 tokens left: 200 bytes at 1 MB/s
    sim.run(1.0)
    sim.after(0.01, lambda: send(sim, a, b, 1000, lambda: arrived.append(sim.now)))  # refilled by then
    sim.run(1.0)
    assert arrived == pytest.approx([0.0, 200e-6, 0.0102])
    real, arrived = (Nic(1e6, 0.0), Nic(1e6, 0.0)), []
    send(sim, *real, 600, lambda: arrived.append(sim.now))
    sim.run(2.0)
    assert arrived == pytest.approx([0.0102 + 600e-6])
