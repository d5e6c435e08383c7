"""One registry of consistency policies (psgd.policy.POLICIES): each policy describes itself, and the job
file, the command line and the server read it from there."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import types

import pytest

from psgd.cli.common import add_job_arguments, job_from_args
from psgd.config import ClusterConfig, ConfigError, Consistency, JobConfig
from psgd.policy import (
    ACCUMULATE,
    POLICIES,
    AsyncPolicy,
    LocalPolicy,
    PolicyError,
    PolicyOption,
    SSPPolicy,
    SyncPolicy,
    make_policy,
    policy_from_cluster,
)

REGISTERED = sorted(POLICIES)


def cluster_parser() -> argparse.ArgumentParser:
    """What psgd-server, psgd-worker and psgd launch build: the job flags with the [cluster] ones."""
    parser = argparse.ArgumentParser(prog="psgd-test")
    add_job_arguments(parser, cluster=True)
    return parser


@pytest.mark.parametrize("name", REGISTERED)
def test_every_policy_declares_what_it_is(name):
    cls = POLICIES[name]
    declared = {k for c in cls.__mro__[:-2] for k in vars(c)}  # the class and its parents, not Policy/ABC
    assert {"name", "summary", "options", "accumulates"} <= declared
    assert cls.name == name
    assert isinstance(cls.summary, str) and cls.summary and "\n" not in cls.summary and "%" not in cls.summary
    assert isinstance(cls.accumulates, bool)
    assert isinstance(cls.options, tuple) and all(isinstance(o, PolicyOption) for o in cls.options)


@pytest.mark.parametrize("name", REGISTERED)
def test_options_match_the_constructor_and_the_cluster_section(name):
    cls = POLICIES[name]
    parameters = inspect.signature(cls.__init__).parameters
    cluster_keys = {f.name for f in dataclasses.fields(Consistency)}  # a policy's own settings
    assert [o.name for o in cls.options] == [p for p in parameters if p not in ("self", "num_workers")]
    for option in cls.options:
        default = parameters[option.name].default
        if option.required:
            assert option.default is None and default is inspect.Parameter.empty
        else:
            assert option.default == default
        assert option.cluster_key in cluster_keys and option.help
        with pytest.raises(dataclasses.FrozenInstanceError):
            option.default = 1


@pytest.mark.parametrize("name", REGISTERED)
def test_accumulates_says_what_the_policy_answers_to_a_push(name):
    required = {o.name: 1 for o in POLICIES[name].options if o.required}
    policy = make_policy(name, 2, **required)
    assert (policy.push(0, 0).action == ACCUMULATE) is POLICIES[name].accumulates
    assert policy.option_values() == {o.name: getattr(policy, o.name) for o in POLICIES[name].options}


def test_only_sync_accumulates():
    assert [n for n in REGISTERED if POLICIES[n].accumulates] == ["sync"]
    assert POLICIES == {"sync": SyncPolicy, "async": AsyncPolicy, "ssp": SSPPolicy, "local": LocalPolicy}
    assert [n for n in REGISTERED if POLICIES[n].local] == ["local"]


@pytest.mark.parametrize(
    "sets, words",
    [
        (["cluster.policy=local", "cluster.local_steps=0"], "local_steps must be an integer from 1 to 1000000"),
        (["cluster.policy=local", "cluster.dc_lambda=0.1"], "dc_lambda cannot go with policy 'local'"),
        (
            ["cluster.policy=local", "cluster.overlap=true", "cluster.implicit_momentum=true"],
            "implicit_momentum, overlap cannot go with policy 'local': its workers push their progress",
        ),
    ],
)
def test_local_sgd_options_are_checked(sets, words):
    with pytest.raises(ConfigError, match=words):
        JobConfig().apply_sets(sets)
    with pytest.raises(PolicyError, match="local_steps must be an integer >= 1, got 0"):
        make_policy("local", 2, local_steps=0)


@pytest.mark.parametrize(
    "name, options, words",
    [
        (
            "sync",
            {"staleness": 1, "bogus": 2},
            ["unknown option(s) bogus, staleness", "options it takes: backup_workers"],
        ),
        ("async", {"staleness": 1}, ["unknown option(s) staleness", "options it takes: none"]),
        ("ssp", {}, ["needs the option(s) staleness", "options it takes: staleness"]),
        ("ssp", {"backup_workers": 1}, ["unknown option(s) backup_workers", "options it takes: staleness"]),
    ],
)
def test_make_policy_refuses_unknown_and_missing_options_by_name(name, options, words):
    with pytest.raises(PolicyError) as info:
        make_policy(name, 3, **options)
    for word in words:
        assert word in str(info.value)


def test_the_job_file_accepts_exactly_the_registered_policies():
    for name in REGISTERED:
        JobConfig.from_dict({"cluster": {"policy": name}})
    for bad in ("bsp", "SYNC", ["sync"], 3):
        with pytest.raises(ConfigError) as info:
            JobConfig.from_dict({"cluster": {"policy": bad}})
        assert f"policy must be one of {', '.join(POLICIES)}, got {bad!r}" in str(info.value)


def test_the_policy_flag_help_lists_every_policy_and_its_summary(monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")  # one line per flag: no wrapping to undo
    text = cluster_parser().format_help()
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("--policy"))
    for name, cls in POLICIES.items():
        assert f"{name}: {cls.summary}" in line
    for name, cls in POLICIES.items():
        for option in cls.options:
            assert "--" + option.cluster_key.replace("_", "-") in text and f"{name}: {option.help}" in text


@pytest.mark.parametrize(
    "argv, name, options",
    [
        (["--policy", "ssp", "--staleness", "5", "--workers", "3"], "ssp", {"staleness": 5}),
        (
            ["--policy", "sync", "--backup-workers", "1", "--workers", "3", "--staleness", "7"],
            "sync",
            {"backup_workers": 1},
        ),
        (["--policy", "async", "--workers", "3", "--staleness", "7"], "async", {}),
    ],
)
def test_policy_from_cluster_reads_each_option_from_its_cluster_key(argv, name, options):
    job = job_from_args(cluster_parser().parse_args(argv), environ={})
    policy = policy_from_cluster(job.cluster)
    assert type(policy) is POLICIES[name] and policy.num_workers == 3
    assert policy.option_values() == options


def test_policy_from_cluster_takes_any_object_with_the_keys():
    cluster = ClusterConfig(policy="ssp", workers=2, consistency=Consistency(staleness=0))
    assert policy_from_cluster(cluster).staleness == 0
    with pytest.raises(PolicyError, match="unknown policy 'bsp'"):
        policy_from_cluster(types.SimpleNamespace(policy="bsp", workers=2, consistency=Consistency()))
