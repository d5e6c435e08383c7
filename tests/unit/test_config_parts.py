"""Each settings part refuses a bad value when it is made, naming the key, the value and what it may be, and is
frozen: a job that changes a key makes a new part."""

import dataclasses
import math
import re

import pytest

from psgd.config import (PARTS, ClusterConfig, ConfigError, Consistency, JobConfig, TablesConfig, TLSConfig,
                         TrainConfig)

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


@pytest.mark.parametrize("cls, key, value", [(Consistency, "staleness", -5), (ClusterConfig, "shards", 0),
                                             (ClusterConfig, "policy", "bsp"), (TrainConfig, "batch_size", 0),
                                             (TablesConfig, "lr", 0.0), (TLSConfig, "cert", 1)])
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
    job.apply_sets(["cluster.workers=3", "train.epochs=2"])
    assert (cluster.workers, train.epochs) == (2, 30)  # what was taken before is as it was
    assert (job.cluster.workers, job.train.epochs) == (3, 2)
    with pytest.raises(ConfigError, match=re.escape("<defaults>: [cluster] staleness must be an integer from 0 to "
                                                    "1000000, got -5")):
        job.override("cluster.staleness", -5)
    assert job.cluster.consistency.staleness == 2
