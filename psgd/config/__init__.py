"""The job file: one TOML document that every psgd process reads.

Sections: ``[model]`` and ``[data]`` (a name and its options), ``[optimizer]``, ``[train]`` (the loop),
``[cluster]`` (shards, workers, policy and how they talk), ``[tables]`` (embedding tables' rules) and ``[tls]``;
every key, its default and its meaning: docs/reference/job-file.md.

Command-line flags override the file; ``--set section.key=value`` overrides any key (the value is read as TOML, so
``--set model.hidden=[256,128]`` works).  Every mistake, the rules across keys included (which every command, psgd
doctor and a starting shard share), is a :class:`ConfigError` whose message names the file, the section and the key.
"""

from psgd.config.cluster import (
    ASYNC_LR,
    CUT_ROUNDS,
    PARTS,
    ClusterConfig,
    Consistency,
    Deadlines,
    Links,
    Recovery,
    Remedies,
    workers_range,
)
from psgd.config.job import DTYPES, JobConfig, TablesConfig, TLSConfig, TrainConfig, parse_value, to_toml
from psgd.errors import ConfigError

__all__ = [
    "ASYNC_LR",
    "CUT_ROUNDS",
    "DTYPES",
    "PARTS",
    "ClusterConfig",
    "ConfigError",
    "Consistency",
    "Deadlines",
    "JobConfig",
    "Links",
    "Recovery",
    "Remedies",
    "TLSConfig",
    "TablesConfig",
    "workers_range",
    "TrainConfig",
    "parse_value",
    "to_toml",
]
