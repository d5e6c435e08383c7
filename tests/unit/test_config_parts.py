"""Each settings part refuses a bad value when it is made, naming the key, the value and what it may be, and is
frozen: a job that changes a key makes a new part."""

import dataclasses
import math
import re

import pytest

from psgd.config import PARTS, ClusterConfig, ConfigError, Consistency, JobConfig, TablesConfig, TLSConfig, TrainConfig

SETTINGS = [*PARTS.values(), ClusterConfig, TrainConfig, TablesConfig, TLSConfig]


def _section(cls) -> str:
    return {TrainConfig: "train", TablesConfig: "tables", TLSConfig: "tls"}.get(cls, "cluster")


def _out_of_range():
    """(part, key, value): for each key with a range, the numbers just past its ends, and a bool (never a number)."""
    found = []
    for cls in SETTINGS:
        for f in dataclasses.fields(cls):
            rule = f.metadata.get("rule")
            if rule is not None and rule.range is not None:
                low, high = rule.range
                found += [(cls, f.name, v) for v in (low - 1, high + 1, True) if math.isfinite(v)]
    return found


@pytest.mark.parametrize(
    "cls, key, value",
    [
        (Consistency, "staleness", -5),
        (ClusterConfig, "shards", 0),
        (ClusterConfig, "policy", "bsp"),
        (TrainConfig, "batch_size", 0),
        (TablesConfig, "lr", 0.0),
        (TLSConfig, "cert", 1),
    ],
)
def test_a_bad_value_is_refused_when_the_part_is_made(cls, key, value):
    with pytest.raises(ConfigError, match=re.escape(f"[{_section(cls)}] {key} must ")) as info:
        cls(**{key: value})
    assert str(info.value).endswith(f"got {value!r}")


@pytest.mark.parametrize("cls, key, value", _out_of_range(), ids=lambda v: getattr(v, "__name__", repr(v)))
def test_every_key_refuses_the_values_past_the_ends_of_its_own_range(cls, key, value):
    with pytest.raises(ConfigError) as info:
        cls(**{key: value})
    rule = next(f.metadata["rule"] for f in dataclasses.fields(cls) if f.name == key)
    assert str(info.value) == f"[{_section(cls)}] {key} {rule.words}, got {value!r}"


def test_every_key_of_every_part_has_a_rule_and_its_default_keeps_it():
    for cls in SETTINGS:
        for f in dataclasses.fields(cls):
            if f.name not in PARTS:
                rule = f.metadata.get("rule")
                assert rule is not None, (cls.__name__, f.name)
                assert rule.accepts(getattr(cls(), f.name)), (cls.__name__, f.name)


@pytest.mark.parametrize("cls", SETTINGS)
def test_every_part_is_frozen(cls):
    made = cls()
    key = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(made, key, getattr(made, key))


def test_a_job_changes_a_key_by_making_a_new_part_and_names_its_file_when_refused(tmp_path):
    job = JobConfig()
    cluster, train = job.cluster, job.train
    job = job.apply_sets(["cluster.workers=3", "train.epochs=2"])
    assert (cluster.workers, train.epochs) == (2, 30)  # what was taken before is as it was
    assert (job.cluster.workers, job.train.epochs) == (3, 2)
    with pytest.raises(
        ConfigError, match=re.escape("<defaults>: [cluster] staleness must be an integer from 0 to 1000000, got -5")
    ):
        job = job.override("cluster.staleness", -5)
    assert job.cluster.consistency.staleness == 2


def test_a_job_is_frozen_all_the_way_down():
    job = JobConfig().apply_sets(
        [
            "cluster.policy=async",
            "cluster.shards=1",
            "cluster.servers=127.0.0.1:7001",
            "cluster.data_ports=7002",
            "cluster.replicas=1",
            "cluster.replica_servers=127.0.0.1:7003",
            "model.hidden=[8]",
        ]
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.train = TrainConfig(epochs=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.model = {"name": "softmax"}
    for listed in (job.cluster.servers, job.cluster.links.data_ports, job.cluster.recovery.replica_servers):
        with pytest.raises(AttributeError):
            listed.append(listed[0])
    for table in (job.model, job.data, job.optimizer):
        with pytest.raises(TypeError):
            table["name"] = "other"
    assert job.cluster.servers == ("127.0.0.1:7001",) and job.cluster.links.data_ports == (7002,)
    assert dict(job.model) == {"name": "mlp", "hidden": [8]} and job.data["name"] == "digits"


def test_a_job_keeps_a_copy_of_the_tables_it_is_given():
    model = {"name": "mlp", "hidden": [8]}
    job = JobConfig(model=model)
    model["name"], model["hidden"][0] = "softmax", 9
    assert dict(job.model) == {"name": "mlp", "hidden": [8]}


def test_an_override_returns_a_new_job_and_leaves_this_one_as_it_was():
    job = JobConfig()
    other = job.override("model.name", "softmax")
    assert (dict(job.model), dict(other.model)) == ({"name": "mlp"}, {"name": "softmax"})
    made = job.apply_sets(["cluster.shards=1", "cluster.workers=3", "optimizer.lr=0.1"])
    assert (job.cluster.shards, job.cluster.workers, job.optimizer["lr"]) == (2, 2, 0.05)
    assert (made.cluster.shards, made.cluster.workers, made.optimizer["lr"]) == (1, 3, 0.1)
    with pytest.raises(ConfigError, match=re.escape("backup_workers (2) must be less than workers (2)")):
        job = job.apply_sets(["cluster.backup_workers=2"])  # the new job is validated whole
    assert job.cluster.consistency.backup_workers == 0


def test_a_job_is_written_back_with_lists_and_plain_tables():
    doc = JobConfig().apply_sets(["cluster.shards=1", "cluster.servers=127.0.0.1:7001", "model.hidden=[8]"]).to_dict()
    assert type(doc["cluster"]["servers"]) is list and doc["cluster"]["servers"] == ["127.0.0.1:7001"]
    assert type(doc["cluster"]["data_ports"]) is list and type(doc["model"]) is dict
    assert doc["model"] == {"name": "mlp", "hidden": [8]}
