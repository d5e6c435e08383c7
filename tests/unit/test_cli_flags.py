"""Flags and environment: every override first, then one validation; no abbreviations; hints for typos;
ranks, addresses and counts from PSGD_* variables and the schedulers' own."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import psgd
from psgd.cli import main as psgd_main
from psgd.cli import server as psgd_server
from psgd.cli import worker as psgd_worker
from psgd.cli.common import job_from_args
from psgd.config import ConfigError
from psgd.config.parsing import comma_list

pytestmark = pytest.mark.usefixtures("keep_signal_handlers")  # psgd-worker's and psgd-server's main()


def worker_args(*argv: str) -> argparse.Namespace:
    return psgd_worker.build_parser().parse_args(list(argv))


def test_overrides_are_validated_together_whatever_their_order(tmp_path):
    job_file = tmp_path / "job.toml"
    job_file.write_text('[cluster]\nshards = 2\nservers = ["a:1", "b:2"]\nworkers = 2\n')
    args = worker_args("-c", str(job_file), "--shards", "3", "--servers", "a:1,b:2,c:3")
    job = job_from_args(args, environ={})
    assert job.cluster.shards == 3 and job.cluster.servers == ("a:1", "b:2", "c:3")

    job = job_from_args(worker_args("--workers", "4", "--backup-workers", "3"), environ={})
    assert (job.cluster.workers, job.cluster.consistency.backup_workers) == (4, 3)


def test_an_inconsistent_job_is_still_refused_once_everything_is_in(tmp_path):
    with pytest.raises(ConfigError, match="lists 2 server address.*shards = 3"):
        job_from_args(worker_args("--shards", "3", "--servers", "a:1,b:2"), environ={})
    with pytest.raises(ConfigError, match="backup_workers .3. must be less than workers .2."):
        job_from_args(worker_args("--backup-workers", "3"), environ={})


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["train", "--epoch", "1"], "did you mean --epochs?"),
        (["launch", "--worker", "3"], "did you mean --workers?"),
        (["lauch"], "did you mean launch?"),
        (["train", "--optimiser", "sgd"], "did you mean --optimizer?"),
    ],
)
def test_abbreviations_are_refused_and_typos_get_the_nearest_flag(argv, hint, capsys):
    with pytest.raises(SystemExit) as info:
        psgd_main.build_parser().parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert hint in err


def test_servers_and_workers_refuse_abbreviations_too(capsys):
    for build, argv in (
        (psgd_worker.build_parser, ["--rank", "0", "--serv", "a:1"]),
        (psgd_server.build_parser, ["--shar", "0"]),
    ):
        with pytest.raises(SystemExit):
            build().parse_args(argv)
        assert "unrecognized arguments" in capsys.readouterr().err


def test_the_rank_comes_from_the_flag_then_psgd_then_the_schedulers():
    args = worker_args()
    assert psgd_worker.rank_from(args, {}) == (None, "")
    env = {"JOB_COMPLETION_INDEX": "3"}
    assert psgd_worker.rank_from(args, env) == (3, "JOB_COMPLETION_INDEX")
    env["SLURM_PROCID"] = "2"
    assert psgd_worker.rank_from(args, env) == (2, "SLURM_PROCID")
    env["RANK"] = "1"
    assert psgd_worker.rank_from(args, env) == (1, "RANK")
    env["PSGD_RANK"] = "0"
    assert psgd_worker.rank_from(args, env) == (0, "PSGD_RANK")
    assert psgd_worker.rank_from(worker_args("--rank", "5"), env) == (5, "--rank")
    with pytest.raises(ConfigError, match="RANK='x' is not an integer"):
        psgd_worker.rank_from(args, {"RANK": "x"})


def test_addresses_and_counts_come_from_psgd_variables_below_the_flags(tmp_path):
    job_file = tmp_path / "job.toml"
    job_file.write_text('[cluster]\nshards = 1\nworkers = 2\nservers = ["file:1"]\n')
    env = {"PSGD_SERVERS": "env:1,env:2", "PSGD_SHARDS": "2", "PSGD_WORKERS": "3"}
    job = job_from_args(worker_args("-c", str(job_file)), environ=env)
    assert (job.cluster.servers, job.cluster.shards, job.cluster.workers) == (("env:1", "env:2"), 2, 3)
    job = job_from_args(worker_args("-c", str(job_file), "--workers", "5"), environ=env)
    assert job.cluster.workers == 5


def test_world_size_counts_the_workers_unless_psgd_workers_says_otherwise():
    world = [("WORLD_SIZE", "cluster.workers")]
    assert job_from_args(worker_args(), environ={"WORLD_SIZE": "4"}, extra_env=world).cluster.workers == 4
    assert (
        job_from_args(worker_args(), environ={"WORLD_SIZE": "4", "PSGD_WORKERS": "3"}, extra_env=world).cluster.workers
        == 3
    )
    assert job_from_args(worker_args(), environ={"WORLD_SIZE": "4"}).cluster.workers == 2  # not read by others


def test_a_worker_without_a_rank_names_where_one_can_come_from(monkeypatch, capsys):
    for name in ("PSGD_RANK", "RANK", "SLURM_PROCID", "JOB_COMPLETION_INDEX"):
        monkeypatch.delenv(name, raising=False)
    code = psgd_worker.main(["--servers", "127.0.0.1:1,127.0.0.1:2"])
    assert code == 2
    assert (
        "no rank: pass --rank, or set one of PSGD_RANK, RANK, SLURM_PROCID, JOB_COMPLETION_INDEX"
        in capsys.readouterr().err
    )


def test_a_rank_out_of_range_says_where_it_came_from(monkeypatch, capsys):
    monkeypatch.setenv("SLURM_PROCID", "7")
    for name in ("PSGD_RANK", "RANK"):
        monkeypatch.delenv(name, raising=False)
    code = psgd_worker.main(["--servers", "127.0.0.1:1,127.0.0.1:2"])
    assert code == 2
    assert "rank 7 (from SLURM_PROCID) is out of range: the job has 2 worker(s)" in capsys.readouterr().err


def test_a_shard_index_out_of_range_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("PSGD_SHARD", "5")
    assert psgd_server.main(["--shards", "2"]) == 2
    assert "shard 5 is out of range: the job has 2 shard(s)" in capsys.readouterr().err


def test_launch_layout_comes_from_flags_then_environment():
    parser = psgd_main.build_parser()
    args = parser.parse_args(["launch", "--nnodes", "2", "--hosts", "h0,h1"])
    layout = psgd_main.layout_from_args(args, {"SLURM_NODEID": "1"})
    assert (layout.nnodes, layout.node_rank, layout.hosts) == (2, 1, ("h0", "h1"))
    layout = psgd_main.layout_from_args(args, {"SLURM_NODEID": "1", "PSGD_NODE_RANK": "0"})
    assert layout.node_rank == 0
    args = parser.parse_args(["launch", "--nnodes", "2", "--node-rank", "1"])
    layout = psgd_main.layout_from_args(args, {"PSGD_HOSTS": "a,b"})
    assert (layout.node_rank, layout.hosts) == (1, ("a", "b"))


def test_a_multi_node_layout_puts_shards_and_workers_round_robin():
    from psgd.launcher import LaunchError, Layout

    layout = Layout(nnodes=2, node_rank=1, hosts=("10.0.0.5", "10.0.0.6"), port=50051)
    layout.check(shards=3, workers=4)
    assert layout.shards_here(3) == [1] and layout.workers_here(4) == [1, 3]
    assert [layout.address(k) for k in range(3)] == ["10.0.0.5:50051", "10.0.0.6:50051", "10.0.0.5:50053"]
    with pytest.raises(LaunchError, match="needs --hosts with one address per node"):
        Layout(nnodes=2, node_rank=0, hosts=("a",)).check(2, 2)
    with pytest.raises(LaunchError, match="out of range"):
        Layout(nnodes=2, node_rank=2, hosts=("a", "b")).check(2, 2)


# -- comma-separated lists: one reader, one wording -------------------------------------------------------


@pytest.mark.parametrize(
    "text, options, message",
    [
        ("sync,warp", dict(choices=("sync", "async")), "--x: unknown warp; choose from sync, async"),
        ("4,lots", dict(kind=float, what="sizes in MB"), "--x: expected sizes in MB separated by commas, got '4,lots'"),
        ("2,0", dict(kind=int, at_least=1), "--x: every value must be at least 1, got '2,0'"),
        ("nan", dict(kind=float, at_least=0), "--x: every value must be at least 0, got 'nan'"),
        (" , ", dict(kind=int, what="whole numbers"), "--x: give at least one (whole numbers separated by commas)"),
        ("", dict(choices=("a", "b")), "--x: give at least one of a, b"),
    ],
)
def test_a_comma_list_names_the_flag_and_what_was_wrong(text, options, message):
    with pytest.raises(argparse.ArgumentTypeError) as info:
        comma_list(text, "--x", **options)
    assert str(info.value) == message


def test_a_comma_list_strips_and_drops_empty_items_and_repeats_when_told():
    assert comma_list(" 1gbit, ,10gbit,1gbit ") == ["1gbit", "10gbit", "1gbit"]
    assert comma_list("a,b,a", unique=True) == ["a", "b"]
    assert comma_list("", empty=True) == []
    assert comma_list("2,1", kind=int, at_least=1) == [2, 1]
    with pytest.raises(ValueError, match="^--w: unknown z"):
        comma_list("z", "--w", choices=("y",), error=ValueError)


def test_every_comma_separated_flag_is_read_by_the_one_reader():
    """No command splits a flag's value on commas itself: psgd.config.parsing.comma_list reads every list."""
    root = Path(psgd.__file__).parent
    commands = [p for folder in ("cli", "bench") for p in sorted((root / folder).rglob("*.py"))]
    found = [
        f"{p.relative_to(root)}:{n}"
        for p in commands
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if '.split(",")' in line
    ]
    assert found == [], found


@pytest.mark.parametrize(
    "command, argv, env, said",
    [
        (psgd_main.main, ["launch", "--policy", "asynch"], {}, "--policy asynch: [cluster] policy must be one of"),
        (psgd_main.main, ["launch", "--workers", "0"], {}, "--workers 0: [cluster] workers must be an integer"),
        (psgd_main.main, ["train", "--set", "cluster.polcy=x"], {}, "--set cluster.polcy=x: [cluster] unknown key"),
        (psgd_main.main, ["launch"], {"PSGD_WORKERS": "0"}, "PSGD_WORKERS=0: [cluster] workers must be an integer"),
        (
            psgd_worker.main,
            ["--rank", "0", "--servers", "a:1", "--policy", "asynch"],
            {},
            "--policy asynch: [cluster] policy must be one of",
        ),
    ],
)
def test_a_value_refused_is_blamed_on_the_flag_or_variable_that_gave_it(command, argv, env, said, monkeypatch, capsys):
    """Not on "<defaults>", which the user never wrote; a job file's own mistake still names the file."""
    for name in ("PSGD_WORKERS", "PSGD_SHARDS", "PSGD_SERVERS", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert command(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {said}" in err and "<defaults>" not in err


def test_a_job_files_own_mistake_still_names_the_file(tmp_path, capsys):
    job_file = tmp_path / "job.toml"
    job_file.write_text('[cluster]\nworkers = 0\n')
    assert psgd_main.main(["launch", "-c", str(job_file)]) == 2
    assert f"error: {job_file}: [cluster] workers must be an integer" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["train", "--optimizer", "adamm"], ["launch", "--optimizer", "adamm"]])
def test_an_unknown_optimizer_is_refused_before_anything_starts(argv, capsys):
    """Not after a "training ..." line (psgd train), nor in a shard's log once the shards are up (psgd launch)."""
    assert psgd_main.main(argv) == 2
    err = capsys.readouterr().err
    assert "error: unknown optimizer 'adamm': choose sgd, momentum" in err
    assert "training" not in err and "shard" not in err


def test_psgd_help_lists_every_command_once(capsys):
    """psgd --help listed its commands twice, once in its own words without psgd run."""
    parser = psgd_main.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    lines = capsys.readouterr().out.splitlines()
    listed = [line.split()[0] for line in lines if line.startswith("  ") and line.split()[0] in commands]
    assert sorted(listed) == sorted(commands), listed
    assert {"run", "launch", "train", "report"} <= set(commands)
