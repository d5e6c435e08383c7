"""The job file as a whole: its sections, read from TOML and overridden from the command line, and the checks of
each section but ``[cluster]``'s (:mod:`psgd.config.cluster`)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import tomllib
from pathlib import Path
from typing import Any, Iterable

from psgd.config.checks import check_bools, check_ints
from psgd.config.cluster import ClusterConfig
from psgd.errors import ConfigError
from psgd.tables.rules import ROW_OPTIMIZERS

DTYPES = ("float32", "float64")


@dataclasses.dataclass
class TrainConfig:
    batch_size: int = 32         # examples in each process's minibatch (a sync round of N workers: N x this)
    epochs: int = 30             # passes over the training data (each worker over its own share)
    seed: int = 0                # initial weights and data order
    device: str = "cpu"          # cpu, cuda or cuda:N: where each process computes
    dtype: str = "float32"       # float32 or float64: the weights and gradients
    eval_every: int = 0  # steps between evaluations on the test split; 0 = once per epoch
    eval_batch_size: int = 1024  # examples evaluated at once
    eval_beside: bool = False  # evaluate a copy of the weights on a thread beside training: steps never wait for it
    graphs: bool = True  # on a GPU, steps replayed as a CUDA graph where the model allows (psgd train: updates too)
    threads: int = 0  # BLAS/OpenMP threads of each process; 0 = automatic (see psgd.compute.threads)
    prefetch: bool = True  # rows read from disk (npy:DIR): the next batch gathered on a thread while a step computes
    augment: str = ""  # package.module:function called on each training batch on the host, f(x, y, rng) -> (x, y)


#: Ranges that work, (lowest, highest), of the integer keys: beyond them a job would exhaust memory or time
#: before it did anything useful (the bounds are far past any real job).
_INT_KEYS = {"batch_size": (1, 1 << 24), "epochs": (1, 10**7), "eval_every": (0, 10**9),
             "eval_batch_size": (1, 1 << 24), "threads": (0, 4096), "seed": (0, 2**63 - 1)}


@dataclasses.dataclass
class TablesConfig:
    """How a model's embedding tables are trained and kept (psgd.tables.rules, psgd.tables.held); unused without
    tables."""

    optimizer: str = "rowwise_adagrad"  # the rule for rows: sgd, rowwise_adagrad or lazy_adam
    lr: float = 0.05              # the rows' learning rate
    eps: float = 1e-8             # rowwise_adagrad, lazy_adam
    initial: float = 0.0          # rowwise_adagrad: each row's accumulator to start with
    beta1: float = 0.9            # lazy_adam
    beta2: float = 0.999          # lazy_adam
    admit_after: int = 0          # a row is made at its id's k-th sighting (0, 1: at once)
    idle_updates: int = 0         # rows untouched for this many updates of their table are evicted (0: never)
    max_rows: int = 0             # rows one table may hold in one process (0: from a quarter of its memory; -1: no cap)
    when_full: str = "fail"       # at max_rows: "fail" (refuse the rows) or "evict" (the least recently touched)


_TABLES_INT_KEYS = {"admit_after": (0, 1 << 16), "idle_updates": (0, 2**62), "max_rows": (-1, 2**40)}


@dataclasses.dataclass
class TLSConfig:
    """Mutual TLS between every process of the job, from PEM files (a relative path is read from the job file's
    folder); the same three as ``psgd launch --tls-cert/--tls-key/--tls-ca``, which take precedence."""

    cert: str = ""  # the certificate every shard serves with and every worker (and observer) shows
    key: str = ""   # its private key
    ca: str = ""    # the CA that signed it: shards demand client certificates it signed, workers trust shards it signed


@dataclasses.dataclass
class JobConfig:
    """A whole job; ``model``, ``data`` and ``optimizer`` are name + free options."""

    model: dict[str, Any] = dataclasses.field(default_factory=lambda: {"name": "mlp"})
    data: dict[str, Any] = dataclasses.field(default_factory=lambda: {"name": "digits"})
    optimizer: dict[str, Any] = dataclasses.field(default_factory=lambda: {"name": "momentum", "lr": 0.05})
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    tls: TLSConfig = dataclasses.field(default_factory=TLSConfig)
    tables: TablesConfig = dataclasses.field(default_factory=TablesConfig)
    source: str = "<defaults>"

    SECTIONS = ("model", "data", "optimizer", "train", "cluster", "tls", "tables")

    # -- construction -----------------------------------------------------
    @classmethod
    def from_dict(cls, doc: dict[str, Any], source: str = "<dict>") -> "JobConfig":
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
                setattr(job, section, merged)
        for section in ("train", "cluster", "tls", "tables"):
            for key, value in _table(doc.get(section, {}), source, section).items():
                job._set_field(section, key, value)
        folder = Path(source).parent if Path(source).is_file() else None
        for key in ("cert", "key", "ca"):  # a path in a job file is read from the job file's folder
            value = getattr(job.tls, key)
            if folder is not None and isinstance(value, str) and value and not Path(value).is_absolute():
                setattr(job.tls, key, str(folder.resolve() / value))
        job.validate()
        return job

    @classmethod
    def load(cls, path: str | Path) -> "JobConfig":
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
    def override(self, dotted: str, value: Any) -> None:
        """Set ``section.key`` to ``value`` (``model.name`` replaces the model's options).

        Only the key is checked here; call :meth:`validate` once every override is in, so
        that values which must agree (servers and shards, workers and backup workers) are
        judged together, whatever order they were given in."""
        section, _, key = dotted.partition(".")
        if section not in self.SECTIONS or not key:
            raise ConfigError(f"cannot override {dotted!r}: use section.key with section one of {', '.join(self.SECTIONS)}")
        if section in ("train", "cluster", "tls", "tables"):
            self._set_field(section, key, value)
        else:
            table = getattr(self, section)
            if key == "name" and value != table.get("name"):
                table.clear()
            table[key] = value

    def apply_sets(self, assignments: Iterable[str], validate: bool = True) -> None:
        """Apply ``--set section.key=value`` strings (values parsed as TOML, bare words as strings),
        then validate the job once (unless ``validate`` is false: more overrides are coming)."""
        for item in assignments:
            dotted, sep, raw = item.partition("=")
            if not sep:
                raise ConfigError(f"--set {item!r}: expected section.key=value")
            self.override(dotted.strip(), parse_value(raw.strip()))
        if validate:
            self.validate()

    # -- checks -----------------------------------------------------------
    def _set_field(self, section: str, key: str, value: Any) -> None:
        target = getattr(self, section)
        fields = target.keys() if section == "cluster" else [f.name for f in dataclasses.fields(target)]
        if (section, key) == ("cluster", "data_path"):
            raise ConfigError(f"{self.source}: [cluster] data_path was replaced by transport: data_path = true is "
                              "transport = \"tcp\" (or \"auto\", the default, which also uses shared memory on a "
                              "shard's host), data_path = false is transport = \"grpc\"")
        if key not in fields:
            raise ConfigError(f"{self.source}: [{section}] unknown key {key!r}; known keys: {', '.join(sorted(fields))}")
        if (section, key) in (("cluster", "servers"), ("cluster", "replica_servers")) and isinstance(value, str):
            value = [a.strip() for a in value.split(",") if a.strip()]
        if (section, key) == ("cluster", "data_ports") and isinstance(value, (str, int)) \
                and not isinstance(value, bool):  # --set cluster.data_ports=50052,50054 or one port
            value = [int(p) if p.strip().isdigit() else p.strip() for p in str(value).split(",") if p.strip()]
        if section == "cluster":
            target.set(key, value)
        else:
            setattr(target, key, value)

    def validate(self) -> None:
        src = self.source
        for section in ("model", "data", "optimizer"):
            name = getattr(self, section).get("name")
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{src}: [{section}] needs a name (a string)")
        t = self.train
        check_ints(src, "train", t, _INT_KEYS)
        check_bools(src, "train", t, ("eval_beside", "graphs", "prefetch"))
        if not isinstance(t.augment, str) or t.augment and ":" not in t.augment:
            raise ConfigError(f"{src}: [train] augment must name a function as package.module:function, got "
                              f"{t.augment!r}")
        if t.dtype not in DTYPES:
            raise ConfigError(f"{src}: [train] dtype must be one of {DTYPES}, got {t.dtype!r}")
        if not isinstance(t.device, str):
            raise ConfigError(f"{src}: [train] device must be a string such as 'cpu' or 'cuda:0', got {t.device!r}")
        self.cluster.check(src, self.optimizer.get("name"))
        files = [getattr(self.tls, k) for k in ("cert", "key", "ca")]
        if not all(isinstance(f, str) for f in files):
            raise ConfigError(f"{src}: [tls] cert, key and ca must be paths (strings), got {files!r}")
        if any(files) and not all(files):
            raise ConfigError(f"{src}: [tls] needs cert, key and ca together (mutual TLS: every shard serves with "
                              "the certificate, every worker shows it, and both trust the CA), or none of them")
        self._validate_tables()
        lr = self.optimizer.get("lr")
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0):
            raise ConfigError(f"{src}: [optimizer] lr must be a positive number, got {lr!r}")

    def _validate_tables(self) -> None:
        src, t = self.source, self.tables
        if t.optimizer not in ROW_OPTIMIZERS:
            raise ConfigError(f"{src}: [tables] optimizer must be one of {', '.join(ROW_OPTIMIZERS)}, "
                              f"got {t.optimizer!r}")
        ranges = {"lr": "> 0", "eps": "> 0", "initial": ">= 0", "beta1": "in [0, 1)", "beta2": "in [0, 1)"}
        for key, words in ranges.items():
            value = getattr(t, key)
            number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            if not number or value < 0 or (words == "> 0" and value == 0) or (words == "in [0, 1)" and value >= 1):
                raise ConfigError(f"{src}: [tables] {key} must be a finite number {words}, got {value!r}")
        check_ints(src, "tables", t, _TABLES_INT_KEYS)
        if t.when_full not in ("fail", "evict"):
            raise ConfigError(f"{src}: [tables] when_full must be \"fail\" or \"evict\", got {t.when_full!r}")

    def options(self, section: str) -> dict[str, Any]:
        """A section's options without its name."""
        return {k: v for k, v in getattr(self, section).items() if k != "name"}

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": copy.deepcopy(self.model),
            "data": copy.deepcopy(self.data),
            "optimizer": copy.deepcopy(self.optimizer),
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
