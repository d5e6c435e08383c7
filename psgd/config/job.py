"""The job file as a whole: its sections, read from TOML and overridden from the command line.

``[train]``, ``[tables]`` and ``[tls]`` (and ``[cluster]``, :mod:`psgd.config.cluster`) are frozen parts that refuse
a bad value when made, each key's range beside its field; a :class:`JobConfig` is frozen too, its free sections
read-only: :meth:`JobConfig.override` returns a new job with the key's section made anew, and
:meth:`JobConfig.validate` keeps the rules across keys and sections."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import tomllib
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from psgd.config.checks import flag, integer, number, one_of, refuse_bad, text
from psgd.config.cluster import ClusterConfig
from psgd.errors import ConfigError
from psgd.tables.rules import ROW_OPTIMIZERS

DTYPES = ("float32", "float64")


def _named(function: str) -> bool:  # [train] augment: none, or package.module:function
    return not function or ":" in function


# The integer keys' ranges (lowest, highest) are those that work: beyond them a job would exhaust memory or time
# before it did anything useful (the bounds are far past any real job).
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    batch_size: int = integer(32, 1, 1 << 24)  # examples in each process's minibatch (a sync round of N workers: N x
    #                              this)
    epochs: int = integer(30, 1, 10**7)  # passes over the training data (each worker over its own share)
    seed: int = integer(0, 0, 2**63 - 1)  # initial weights and data order
    device: str = text("cpu", "must be a string such as 'cpu' or 'cuda:0'")  # cpu, cuda or cuda:N: where each
    #                              process computes
    dtype: str = one_of("float32", DTYPES)  # float32 or float64: the weights and gradients
    eval_every: int = integer(0, 0, 10**9)  # steps between evaluations on the test split; 0 = once per epoch
    eval_batch_size: int = integer(1024, 1, 1 << 24)  # examples evaluated at once
    eval_beside: bool = flag(False)  # evaluate a copy of the weights on a thread beside training: steps never wait
    #                              for it
    graphs: bool = flag(True)  # on a GPU, steps replayed as a CUDA graph where the model allows (psgd train: updates
    #                              too)
    threads: int = integer(0, 0, 4096)  # BLAS/OpenMP threads of each process; 0 = automatic (see
    #                              psgd.compute.threads)
    prefetch: bool = flag(True)  # rows read from disk (npy:DIR): the next batch gathered on a thread while a step
    #                              computes
    augment: str = text("", "must name a function as package.module:function", _named)  # package.module:function
    #                              called on each training batch on the host, f(x, y, rng) -> (x, y)

    def __post_init__(self) -> None:
        refuse_bad(self, "train")


@dataclasses.dataclass(frozen=True)
class TablesConfig:
    """How a model's embedding tables are trained and kept (psgd.tables.rules, psgd.tables.held); unused without
    tables."""

    optimizer: str = one_of("rowwise_adagrad", ROW_OPTIMIZERS)  # the rule for rows: sgd, rowwise_adagrad or lazy_adam
    lr: float = number(0.05, "a finite number > 0", 0, above=True)  # the rows' learning rate
    eps: float = number(1e-8, "a finite number > 0", 0, above=True)  # rowwise_adagrad, lazy_adam
    initial: float = number(0.0, "a finite number >= 0", 0)  # rowwise_adagrad: each row's accumulator to start with
    beta1: float = number(0.9, "a finite number in [0, 1)", 0, 1, below=True)  # lazy_adam
    beta2: float = number(0.999, "a finite number in [0, 1)", 0, 1, below=True)  # lazy_adam
    admit_after: int = integer(0, 0, 1 << 16)  # a row is made at its id's k-th sighting (0, 1: at once)
    idle_updates: int = integer(0, 0, 2**62)  # rows untouched for this many updates of their table are evicted (0:
    #                               never)
    max_rows: int = integer(0, -1, 2**40)  # rows one table may hold in one process (0: from a quarter of its memory;
    #                               -1: no cap)
    when_full: str = one_of("fail", ("fail", "evict"), quoted=True)  # at max_rows: "fail" (refuse the rows) or
    #                               "evict" (the least recently touched)

    def __post_init__(self) -> None:
        refuse_bad(self, "tables")


_PATH = "must be a path (a string)"


@dataclasses.dataclass(frozen=True)
class TLSConfig:
    """Mutual TLS between every process of the job, from PEM files (a relative path is read from the job file's
    folder); the same three as ``psgd launch --tls-cert/--tls-key/--tls-ca``, which take precedence."""

    cert: str = text("", _PATH)  # the certificate every shard serves with and every worker (and observer) shows
    key: str = text("", _PATH)  # its private key
    ca: str = text("", _PATH)  # the CA that signed it: shards demand client certificates it signed, workers trust
    #                              shards it signed

    def __post_init__(self) -> None:
        refuse_bad(self, "tls")


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """A whole job; ``model``, ``data`` and ``optimizer`` are name + free options, read-only (a copy of the table
    given), as a shard, a worker and a job's fingerprint take the job whole and it must not change under them."""

    model: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {"name": "mlp"})
    data: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {"name": "digits"})
    optimizer: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {"name": "momentum", "lr": 0.05})
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    tls: TLSConfig = dataclasses.field(default_factory=TLSConfig)
    tables: TablesConfig = dataclasses.field(default_factory=TablesConfig)
    source: str = "<defaults>"

    SECTIONS = ("model", "data", "optimizer", "train", "cluster", "tls", "tables")

    def __post_init__(self) -> None:
        for section in ("model", "data", "optimizer"):
            object.__setattr__(self, section, types.MappingProxyType(copy.deepcopy(dict(getattr(self, section)))))

    # -- construction -----------------------------------------------------
    @classmethod
    def from_dict(cls, doc: dict[str, Any], source: str = "<dict>") -> JobConfig:
        job = cls(source=source)
        unknown = set(doc) - set(cls.SECTIONS)
        if unknown:
            raise ConfigError(
                f"{source}: unknown section(s) {sorted(unknown)}; known sections: {', '.join(cls.SECTIONS)}"
            )
        for section in ("model", "data", "optimizer"):
            if section in doc:
                table = _table(doc[section], source, section)
                merged = dict(table) if "name" in table else {**getattr(job, section), **table}
                job = dataclasses.replace(job, **{section: merged})
        for section in ("train", "cluster", "tls", "tables"):
            for key, value in _table(doc.get(section, {}), source, section).items():
                job = job._with_field(section, key, value)
        folder = Path(source).parent if Path(source).is_file() else None
        for key in ("cert", "key", "ca"):  # a path in a job file is read from the job file's folder
            value = getattr(job.tls, key)
            if folder is not None and value and not Path(value).is_absolute():
                job = job._with_field("tls", key, str(folder.resolve() / value))
        job.validate()
        return job

    @classmethod
    def load(cls, path: str | Path) -> JobConfig:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"job file {path} does not exist") from None
        except OSError as exc:
            raise ConfigError(f"cannot read job file {path}: {exc.strerror or exc}") from None
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        return cls.from_dict(doc, source=str(path))

    # -- overrides --------------------------------------------------------
    def override(self, dotted: str, value: Any) -> JobConfig:
        """A new job with ``section.key`` set to ``value`` (``model.name`` replaces the model's options), this one
        unchanged: a fixed section is made anew, refusing a bad value.

        Only the key is checked here; call :meth:`validate` once every override is in, so
        that values which must agree (servers and shards, workers and backup workers) are
        judged together, whatever order they were given in."""
        section, _, key = dotted.partition(".")
        if section not in self.SECTIONS or not key:
            raise ConfigError(
                f"cannot override {dotted!r}: use section.key with section one of {', '.join(self.SECTIONS)}"
            )
        if section in ("train", "cluster", "tls", "tables"):
            return self._with_field(section, key, value)
        table = getattr(self, section)
        kept = {} if key == "name" and value != table.get("name") else table
        return dataclasses.replace(self, **{section: {**kept, key: value}})

    def apply_sets(self, assignments: Iterable[str], validate: bool = True) -> JobConfig:
        """A new job with ``--set section.key=value`` strings applied (values parsed as TOML, bare words as
        strings), validated once (unless ``validate`` is false: more overrides are coming)."""
        job = self
        for item in assignments:
            dotted, sep, raw = item.partition("=")
            if not sep:
                raise ConfigError(f"--set {item!r}: expected section.key=value")
            job = job.override(dotted.strip(), parse_value(raw.strip()))
        if validate:
            job.validate()
        return job

    # -- checks -----------------------------------------------------------
    def _with_field(self, section: str, key: str, value: Any) -> JobConfig:
        target = getattr(self, section)
        fields = target.keys() if section == "cluster" else [f.name for f in dataclasses.fields(target)]
        if (section, key) == ("cluster", "data_path"):
            raise ConfigError(
                f"{self.source}: [cluster] data_path was replaced by transport: data_path = true is "
                "transport = \"tcp\" (or \"auto\", the default, which also uses shared memory on a "
                "shard's host), data_path = false is transport = \"grpc\""
            )
        if key not in fields:
            raise ConfigError(
                f"{self.source}: [{section}] unknown key {key!r}; known keys: {', '.join(sorted(fields))}"
            )
        if (section, key) in (("cluster", "servers"), ("cluster", "replica_servers")) and isinstance(value, str):
            value = [a.strip() for a in value.split(",") if a.strip()]
        if (
            (section, key) == ("cluster", "data_ports")
            and isinstance(value, (str, int))
            and not isinstance(value, bool)
        ):  # --set cluster.data_ports=50052,50054 or one port
            value = [int(p) if p.strip().isdigit() else p.strip() for p in str(value).split(",") if p.strip()]
        try:
            made = (
                target.with_value(key, value) if section == "cluster" else dataclasses.replace(target, **{key: value})
            )
        except ConfigError as exc:  # the part names the section and the key; the job, where they were given
            raise ConfigError(f"{self.source}: {exc}") from None
        return dataclasses.replace(self, **{section: made})

    def validate(self) -> None:
        """The rules across keys and sections, and the free sections' names (each fixed key was checked when its
        section was made)."""
        src = self.source
        for section in ("model", "data", "optimizer"):
            name = getattr(self, section).get("name")
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{src}: [{section}] needs a name (a string)")
        self.cluster.check_across(src, self.optimizer.get("name"))
        files = [getattr(self.tls, k) for k in ("cert", "key", "ca")]
        if any(files) and not all(files):
            raise ConfigError(
                f"{src}: [tls] needs cert, key and ca together (mutual TLS: every shard serves with "
                "the certificate, every worker shows it, and both trust the CA), or none of them"
            )
        lr = self.optimizer.get("lr")
        if lr is not None and (
            isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0
        ):
            raise ConfigError(f"{src}: [optimizer] lr must be a positive number, got {lr!r}")

    def options(self, section: str) -> dict[str, Any]:
        """A section's options without its name."""
        return {k: v for k, v in getattr(self, section).items() if k != "name"}

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": copy.deepcopy(dict(self.model)),
            "data": copy.deepcopy(dict(self.data)),
            "optimizer": copy.deepcopy(dict(self.optimizer)),
            "train": dataclasses.asdict(self.train),
            "cluster": self.cluster.flat(),
            "tls": dataclasses.asdict(self.tls),
            "tables": dataclasses.asdict(self.tables),
        }


def to_toml(doc: dict[str, dict[str, Any]]) -> str:
    """Write a job (``JobConfig.to_dict()``) back as TOML: tables of scalars and lists of scalars."""
    lines = []
    for section, table in doc.items():
        lines.append(f"[{section}]")
        for key, value in table.items():
            lines.append(f"{key} = {_toml_value(value, f'{section}.{key}')}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}: {value} cannot be written to a job file")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v, where) for v in value) + "]"
    raise ConfigError(f"{where}: a {type(value).__name__} cannot be written to a job file")


def _table(value: Any, source: str, section: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: [{section}] must be a table, got {type(value).__name__}")
    return value


def parse_value(raw: str) -> Any:
    """Read a command-line value as TOML (numbers, booleans, arrays); anything else is a string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
