import re

import pytest

from psgd.config import ConfigError, JobConfig, parse_value


def write(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_defaults_are_the_bundled_digits_mlp():
    job = JobConfig()
    assert job.model["name"] == "mlp" and job.data["name"] == "digits"
    assert job.train.batch_size == 32 and job.train.device == "cpu"


def test_file_sections_and_options(tmp_path):
    job = JobConfig.load(
        write(
            tmp_path,
            """
[model]
name = "cnn"
channels = [4, 8]
[optimizer]
lr = 0.1
[train]
batch_size = 16
epochs = 2
""",
        )
    )
    assert job.model == {"name": "cnn", "channels": [4, 8]}
    assert job.optimizer == {"name": "momentum", "lr": 0.1}  # options merge into the default optimizer
    assert job.options("model") == {"channels": [4, 8]}
    assert (job.train.batch_size, job.train.epochs) == (16, 2)


def test_overrides_and_set(tmp_path):
    job = JobConfig()
    job = job.apply_sets(["model.hidden=[256,128]", "train.epochs=3", "data.name=synthetic", "optimizer.name=adam"])
    assert job.model["hidden"] == [256, 128] and job.train.epochs == 3
    assert job.data == {"name": "synthetic"}
    assert job.optimizer == {"name": "adam"}  # a new name drops the old options
    assert parse_value("abc") == "abc" and parse_value("1e-3") == 0.001 and parse_value("true") is True


@pytest.mark.parametrize(
    "text, words",
    [
        ("[model\nname='mlp'", "not valid TOML"),
        ("[modle]\nname='mlp'", "unknown section"),
        ("[train]\nbatchsize = 4", "unknown key 'batchsize'"),
        ("[train]\nbatch_size = 0", "batch_size must be an integer from 1 to 16777216, got 0"),
        ("[train]\nbatch_size = 'big'", "batch_size"),
        ("[train]\ndtype = 'float16'", "dtype"),
        ("[optimizer]\nlr = -1.0", "lr must be a positive number"),
        ("[model]\nname = 3", "[model] needs a name"),
        ("model = 3", "[model] must be a table"),
        ("[cluster]\npolicy = 'bsp'", "policy must be one of sync, async, ssp"),
        ("[cluster]\nworkers = 2\nbackup_workers = 2", "backup_workers (2) must be less than workers (2)"),
        ("[cluster]\nshards = 2\nservers = ['127.0.0.1:1']", "lists 1 server address(es) but shards = 2"),
        ("[cluster]\nservers = ['nohost']", "host:port"),
        ("[cluster]\nlease_seconds = 0", "lease_seconds must be a number of seconds from 0.1 to 86400"),
        # a lease of 1e-9 s was accepted: every worker expired at once, again and again
        ("[cluster]\nlease_seconds = 1e-9", "lease_seconds must be a number of seconds from 0.1 to 86400, got 1e-09"),
        ("[cluster]\nhello_timeout = 1e-6", "hello_timeout must be a number of seconds from 0.01 to 3600"),
        # bounds: each accepted once and then failed (a worker retrying forever, a shard at 3.1 GB in 18 s)
        (
            "[cluster]\nrequest_timeout = 1e10",
            "request_timeout must be a number of seconds from 0.01 to 86400, got 10000000000.0",
        ),
        ("[cluster]\nworkers = 10000000", "workers must be an integer from 1 to 10000, got 10000000"),
        ("[cluster]\nshards = 5000", "shards must be an integer from 1 to 1024"),
        ("[train]\nseed = -1", "seed must be an integer from 0 to"),
    ],
)
def test_malformed_job_files_name_file_section_and_key(tmp_path, text, words):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        JobConfig.load(path)
    assert words in str(info.value)
    assert str(path) in str(info.value)


def test_missing_file_and_bad_set(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        JobConfig.load(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="section.key=value"):
        JobConfig().apply_sets(["epochs"])
    with pytest.raises(ConfigError, match="cannot override"):
        JobConfig().apply_sets(["nosuch.x=1"])


def test_cluster_section(tmp_path):
    job = JobConfig.load(
        write(
            tmp_path,
            """
[cluster]
policy = "ssp"
staleness = 3
shards = 2
servers = ["127.0.0.1:5000", "127.0.0.1:5001"]
""",
        )
    )
    assert job.cluster.policy == "ssp" and job.cluster.consistency.staleness == 3
    job = job.override("cluster.servers", "10.0.0.1:1,10.0.0.2:2")
    assert job.cluster.servers == ("10.0.0.1:1", "10.0.0.2:2")
    assert job.to_dict()["cluster"]["shards"] == 2


def test_the_cluster_section_is_a_few_keys_and_parts_that_say_what_they_are_about(tmp_path):
    """[cluster] was 25 flat fields checked in several places: now at most 12 direct fields, the rest in parts; a job
    file still writes every key flat, and each lands in its part."""
    import dataclasses

    from psgd.config import PARTS, ClusterConfig

    assert len(dataclasses.fields(ClusterConfig)) <= 12
    flat = JobConfig().cluster.keys()
    assert len(flat) == len(set(flat)) and {f.name for part in PARTS.values() for f in dataclasses.fields(part)} <= set(
        flat
    )
    job = JobConfig.load(
        write(
            tmp_path,
            """
[cluster]
policy = "async"
dc_lambda = 0.5
transport = "tcp"
request_timeout = 5.0
replicas = 1
local_steps = 7
""",
        )
    )
    c = job.cluster
    assert (
        c.remedies.dc_lambda,
        c.links.transport,
        c.deadlines.request_timeout,
        c.recovery.replicas,
        c.consistency.local_steps,
    ) == (0.5, "tcp", 5.0, 1, 7)
    assert {k: job.to_dict()["cluster"][k] for k in ("dc_lambda", "transport", "replicas")} == {
        "dc_lambda": 0.5,
        "transport": "tcp",
        "replicas": 1,
    }
    with pytest.raises(ConfigError, match=r"\[cluster\] unknown key 'remedies'"):
        job = job.override("cluster.remedies", {})  # a part is not a key of the file
    taken = c.remedies  # a part is frozen: what a shard took whole does not change under it
    with pytest.raises(dataclasses.FrozenInstanceError):
        taken.dc_lambda = 1.0
    job = job.override("cluster.dc_lambda", 0.25)
    assert (taken.dc_lambda, job.cluster.remedies.dc_lambda) == (0.5, 0.25)


def test_job_written_as_toml_reads_back_the_same(tmp_path):
    from psgd.config import to_toml

    job = JobConfig()
    job = job.apply_sets(
        [
            "model.hidden=[256, 128]",
            'data.name="synthetic"',
            "data.n_train=500",
            "optimizer.lr=0.125",
            "cluster.policy=ssp",
            "cluster.staleness_lr=true",
            'cluster.servers=["127.0.0.1:1", "127.0.0.1:2"]',
            'train.device="cpu"',
        ]
    )
    path = tmp_path / "job.toml"
    path.write_text(to_toml(job.to_dict()))
    assert JobConfig.load(path).to_dict() == job.to_dict()


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("async_lr", '"half"', 'async_lr must be "divided" (each async or ssp push at lr / workers) or "full"'),
        ("dc_lambda", "-0.5", "dc_lambda must be a number from 0 (no delay compensation) to 1e6, got -0.5"),
        ("dc_lambda", "inf", "dc_lambda must be a number from 0"),
        ("dc_lambda", "true", "dc_lambda must be a number from 0"),
        ("dc_adaptive", "1", "dc_adaptive must be true or false, got 1"),
        ("implicit_momentum", '"yes"', "implicit_momentum must be true or false, got 'yes'"),
    ],
)
def test_the_async_remedies_are_checked(key, value, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        JobConfig().apply_sets([f"cluster.{key}={value}"])


def test_implicit_momentum_needs_a_momentum_optimizer():
    JobConfig().apply_sets(["cluster.implicit_momentum=true", 'optimizer.name="nesterov"'])
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "implicit_momentum lowers a momentum optimizer's momentum; "
            "[optimizer] name is 'adam' (use momentum or nesterov)"
        ),
    ):
        JobConfig().apply_sets(["cluster.implicit_momentum=true", 'optimizer.name="adam"'])


def test_eval_beside_is_true_or_false():
    assert JobConfig().train.eval_beside is False
    with pytest.raises(ConfigError, match=re.escape("[train] eval_beside must be true or false, got 'yes'")):
        JobConfig().apply_sets(['train.eval_beside="yes"'])


def test_variables_that_do_not_fit_the_memory_are_refused_before_allocating():
    """Initializing makes each variable in float64 and casts it: 8 + itemsize bytes per parameter at the peak."""
    from psgd.job import check_fits
    from psgd.model.base import VarSpec

    specs = [VarSpec("w", (1000, 1000), "float32"), VarSpec("b", (1000,), "float32")]
    check_fits(specs, "model 'mlp'", total=12 * 1_001_000)  # exactly fits
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "model 'mlp': its variables (1,001,000 parameters of float32, "
            "0.0 GiB while they are initialized) do not fit this machine's "
            "0.0 GiB of memory"
        ),
    ):
        check_fits(specs, "model 'mlp'", total=12 * 1_001_000 - 1)


def test_tls_files_in_the_job_file_are_read_from_its_folder_and_come_together(tmp_path):
    import argparse

    from psgd.config import to_toml
    from psgd.wire.tls import tls_from_args

    (tmp_path / "certs").mkdir()
    job = JobConfig.load(write(tmp_path, '[tls]\ncert = "certs/a.pem"\nkey = "certs/a.key"\nca = "/etc/ca.pem"\n'))
    assert (job.tls.cert, job.tls.key, job.tls.ca) == (
        str(tmp_path / "certs/a.pem"),
        str(tmp_path / "certs/a.key"),
        "/etc/ca.pem",
    )
    again = JobConfig.from_dict(__import__("tomllib").loads(to_toml(job.to_dict())))
    assert again.tls == job.tls  # written back with the paths resolved
    none = argparse.Namespace(tls_cert=None, tls_key=None, tls_ca=None)
    assert tls_from_args(none, job).cert == str(tmp_path / "certs/a.pem")
    flags = argparse.Namespace(tls_cert="f.pem", tls_key="f.key", tls_ca="f-ca.pem")
    assert tls_from_args(flags, job).cert == "f.pem"  # flags win
    assert not tls_from_args(none, JobConfig()).enabled
    for text in ('[tls]\ncert = "a.pem"\n', '[tls]\ncert = "a.pem"\nkey = "a.key"\n'):
        with pytest.raises(ConfigError, match=r"\[tls\] needs cert, key and ca together"):
            JobConfig.load(write(tmp_path, text))
    with pytest.raises(ConfigError, match=r"\[tls\] cert must be a path \(a string\), got 1"):
        JobConfig.load(write(tmp_path, '[tls]\ncert = 1\nkey = "k"\nca = "c"\n'))
    with pytest.raises(ConfigError, match=r"\[tls\] unknown key 'password'"):
        JobConfig.load(write(tmp_path, '[tls]\npassword = "x"\n'))


def test_busy_poll_is_microseconds_from_minus_one():
    """-1 (the default) is psgd launch's choice, and none for a process started by hand."""
    assert JobConfig().cluster.links.busy_poll_us == -1 and JobConfig().cluster.links.busy_poll_seconds == 0.0
    job = JobConfig()
    job = job.apply_sets(["cluster.busy_poll_us=250"])
    assert job.cluster.links.busy_poll_seconds == 250e-6
    with pytest.raises(ConfigError, match=re.escape("busy_poll_us")):
        JobConfig().apply_sets(["cluster.busy_poll_us=-2"])


def test_launch_watches_only_where_each_process_has_a_core(monkeypatch):
    from psgd.compute import threads
    from psgd.launcher.layout import busy_poll
    from psgd.wire import protocol

    monkeypatch.setattr(threads, "available_cores", lambda: 4)
    assert busy_poll(4)[0] == protocol.BUSY_POLL_US and busy_poll(1)[0] == protocol.BUSY_POLL_US
    assert busy_poll(5) == (0, "5 process(es) on 4 core(s): data connections sleep at once ([cluster] busy_poll_us)")


def test_data_ports_name_one_port_per_shard_or_none():
    job = JobConfig()
    job = job.apply_sets(["cluster.shards=2", "cluster.data_ports=50152,50154"])
    assert job.cluster.links.data_ports == (50152, 50154)
    job = job.apply_sets(["cluster.data_ports=[]"])
    assert job.cluster.links.data_ports == ()
    for bad, words in (
        ("cluster.data_ports=50152", "lists 1 data port(s) but shards = 2"),
        ("cluster.data_ports=[0, 1]", "must be a list of ports (1-65535)"),
        ("cluster.data_ports=[\"a\", 2]", "must be a list of ports"),
    ):
        with pytest.raises(ConfigError, match=re.escape(words)):
            JobConfig().apply_sets(["cluster.shards=2", bad])


def test_overlapping_ports_are_said_with_whose_they_are():
    from psgd.ops.ports import overlaps

    job = JobConfig()
    job = job.apply_sets(
        ["cluster.shards=2", "cluster.servers=localhost:50151,127.0.0.1:50152", "cluster.data_ports=50152,50153"]
    )
    assert overlaps(job.cluster) == ["127.0.0.1:50152 is shard 0's data port and shard 1's gRPC port"]
    job = job.apply_sets(["cluster.servers=10.0.0.5:50151,10.0.0.6:50152", "cluster.data_ports=50153,50153"])
    assert overlaps(job.cluster) == []  # the same ports on two hosts


def test_the_shard_and_the_workers_client_take_the_settings_whole():
    """A role takes [cluster]'s parts as the job built them, never their keys one by one (which could drift apart
    from the part a job file validated)."""
    import dataclasses
    import inspect

    from psgd.config import PARTS
    from psgd.server.state.core import ShardCore
    from psgd.worker.client import PSClient

    keys = {f.name for part in PARTS.values() for f in dataclasses.fields(part)}
    for role, parts in ((ShardCore, {"deadlines", "remedies"}), (PSClient, {"links", "deadlines"})):
        taken = set(inspect.signature(role).parameters)
        assert parts <= taken, role
        assert not taken & keys, (role, sorted(taken & keys))
