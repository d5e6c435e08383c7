"""The lab's contenders with gradient compression, and the link-bound step time its table shows."""

from __future__ import annotations

import re

import pytest

from psgd.bench.convergence import link_step_seconds
from psgd.bench.lab import parse_contender
from psgd.config import ConfigError


def test_a_parameter_server_policy_may_compress_its_gradients():
    c = parse_contender("async+bf16")
    assert (c.mode, c.label, c.sets) == (
        "ps",
        "async, bf16 gradients",
        ("cluster.policy=async", "cluster.wire_dtype=bfloat16"),
    )
    c = parse_contender("ssp:2+fp16")
    assert c.sets == ("cluster.policy=ssp", "cluster.staleness=2", "cluster.wire_dtype=float16")
    assert c.label == "ssp s=2, fp16 gradients"


def test_remedies_and_local_sgd_are_contenders():
    c = parse_contender("async+dc")
    assert c.sets == ("cluster.policy=async", "cluster.dc_lambda=0.04") and c.label == "async, delay compensation 0.04"
    assert parse_contender("ssp:2+slr+bf16").sets == (
        "cluster.policy=ssp",
        "cluster.staleness=2",
        "cluster.staleness_lr=true",
        "cluster.wire_dtype=bfloat16",
    )
    assert parse_contender("async+dca").sets[1:] == ("cluster.dc_lambda=2.0", "cluster.dc_adaptive=true")
    assert parse_contender("async+im").sets[1:] == ("cluster.implicit_momentum=true",)
    c = parse_contender("local:8")
    assert (c.mode, c.sets) == ("ps", ("cluster.policy=local", "cluster.local_steps=8"))
    assert parse_contender("local").sets == ("cluster.policy=local",)  # its option has a default


@pytest.mark.parametrize(
    "spec, words",
    [
        ("allreduce+bf16", "parameter-server policies"),
        ("sync+int8", "+int8 is none of +bf16, +fp16, +slr"),
        ("nope+bf16", "unknown policy"),
        ("local:x", "local:T"),
    ],
)
def test_compression_is_refused_where_it_means_nothing(spec, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        parse_contender(spec)


def test_the_link_bound_step_counts_the_busiest_link_pull_then_push():
    model = 40e6
    # one worker, one shard: the model down, the gradient up, one after the other
    assert link_step_seconds(model, 1, 1, 125e6) == pytest.approx(0.64)
    # four workers on two shards: each shard link carries two workers' share of the model each way
    assert link_step_seconds(model, 4, 2, 125e6) == pytest.approx(1.28)
    # more shards than workers: the worker's own link is the bound
    assert link_step_seconds(model, 2, 4, 125e6) == pytest.approx(0.64)
    # 16-bit gradients halve the push, not the pull
    assert link_step_seconds(model, 1, 1, 125e6, 0.5) == pytest.approx(0.48)


def test_every_policy_keeps_its_colour_and_compression_is_dashed():
    from psgd.bench.plots import OKABE_ITO, style

    assert style("sync")["color"] == style("sync", ["async", "sync"])["color"] == OKABE_ITO[0]
    assert style("async+bf16") == {"color": style("async")["color"], "linestyle": "--"}
    assert style("async")["linestyle"] == "-"
    mine = ["sync", "ssp:7", "backup:3"]  # not in the fixed table: the free colours, in the lab's order
    assert style("ssp:7", mine)["color"] != style("backup:3", mine)["color"]
    assert style("ssp:7", mine)["color"] in OKABE_ITO
    remedies = ["async", "async+dc", "async+slr", "async+dc+bf16"]
    assert len({style(s, remedies)["color"] for s in remedies[:3]}) == 3  # each remedy a colour of its own
    assert style("async+dc+bf16", remedies) == {"color": style("async+dc", remedies)["color"], "linestyle": "--"}


@pytest.mark.parametrize(
    "spec, words",
    [
        ("slowdown:4@0", "worker 0 four times slower"),
        ("fixed:0.01@1", "worker 1 10 ms slower per step"),
        ("exp:0.005", "every worker slowed by random pauses (mean 5 ms a step)"),
        ("", "no straggler"),
    ],
)
def test_scenarios_are_titled_in_words(spec, words):
    from psgd.bench.answer import situation

    assert situation("", spec) == f"loopback, {words}"
    assert situation("1gbit", spec) == f"1 Gbit/s links, {words}"


def test_the_lab_reads_its_contenders_and_colours_from_the_policy_registry():
    import inspect

    from psgd.bench import plots
    from psgd.bench.lab import contender_families
    from psgd.policy import POLICIES

    for name, cls in POLICIES.items():
        assert (
            parse_contender(name if not any(o.required for o in cls.options) else f"{name}:2").sets[0]
            == f"cluster.policy={name}"
        )
        for option in cls.options:
            if option.shorthand:
                word = option.shorthand.partition(":")[0]
                assert parse_contender(f"{word}:3").sets == (
                    f"cluster.policy={name}",
                    f"cluster.{option.cluster_key}=3",
                )
    families = contender_families()
    one_each = [f if f in POLICIES or f == "allreduce" else f"{f}:1" for f in families]
    assert len({plots.style(spec, one_each)["color"] for spec in one_each}) == len(families)
    source = inspect.getsource(plots)
    assert not [name for name in POLICIES if f'"{name}"' in source]  # no policy written out in the plots


def test_the_summary_plot_draws_the_spread_of_the_repeats(tmp_path, monkeypatch):
    """summary.png showed each policy's median time to target only; the repeats' least and most are whiskers."""
    import types

    import matplotlib.pyplot as plt

    from psgd.bench import plots
    from psgd.bench.answer import Row

    drawn = []
    monkeypatch.setattr(plt, "close", lambda fig: drawn.append(fig))  # kept to be read, not closed
    result = types.SimpleNamespace(
        config=types.SimpleNamespace(policies=["sync", "async"], target_accuracy=0.95, name="digits")
    )
    rows = [
        Row("loopback", "sync", "sync", 4.0, 0.96, None, (3.0, 6.0)),
        Row("loopback", "async", "async", 2.0, 0.95, None, (1.5, 2.5)),
        Row("1 Gbit/s", "sync", "sync", None, 0.5, None, None),  # not reached: no bar, no whisker
        Row("1 Gbit/s", "async", "async", 5.0, 0.95, None, (5.0, 5.0)),
    ]
    plots.summary(result, rows, tmp_path / "summary.png")
    ax = drawn[0].axes[0]
    whiskers = [c for c in ax.containers if type(c).__name__ == "ErrorbarContainer"]
    spans = sorted(tuple(round(v, 6) for v in seg[:, 1]) for c in whiskers for seg in c.lines[2][0].get_segments())
    assert spans == [(1.5, 2.5), (3.0, 6.0), (5.0, 5.0)]
    assert "least to most" in ax.get_ylabel() and (tmp_path / "summary.png").stat().st_size > 10_000
