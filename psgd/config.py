"""The job file: one TOML document that every psgd process reads.

Sections: ``[model]`` and ``[data]`` (a name and its options), ``[optimizer]``, ``[train]`` (the loop),
``[cluster]`` (shards, workers, policy and how they talk), ``[tables]`` (embedding tables' rules) and ``[tls]``;
every key, its default and its meaning: docs/reference/job-file.md.

Command-line flags override the file; ``--set section.key=value`` overrides any key (the value is read as TOML, so
``--set model.hidden=[256,128]`` works).  Every mistake, the rules across keys included (which every command, psgd
doctor and a starting shard share), is a :class:`ConfigError` whose message names the file, the section and the key.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import tomllib
from pathlib import Path
from typing import Any, Iterable

from psgd.errors import InputError
from psgd.optim.rows import ROW_OPTIMIZERS
from psgd.policy import POLICIES
from psgd.wire import TRANSPORTS

DTYPES = ("float32", "float64")


class ConfigError(InputError):
    """A malformed or inconsistent job file or override."""


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
    threads: int = 0  # BLAS/OpenMP threads of each process; 0 = automatic (see psgd.threads)


#: Ranges that work, (lowest, highest), of the integer keys: beyond them a job would exhaust memory or time
#: before it did anything useful (the bounds are far past any real job).
_INT_KEYS = {"batch_size": (1, 1 << 24), "epochs": (1, 10**7), "eval_every": (0, 10**9),
             "eval_batch_size": (1, 1 << 24), "threads": (0, 4096), "seed": (0, 2**63 - 1)}


@dataclasses.dataclass
class ClusterConfig:
    """How the parameter-server job is laid out and how shards apply updates."""

    policy: str = "sync"          # a consistency policy: a name in psgd.policy.POLICIES
    staleness: int = 2            # ssp: how many clocks a worker may run ahead of the slowest
    backup_workers: int = 0       # sync: close a round after workers - backup_workers pushes
    local_steps: int = 4          # local: steps a worker takes on its own copy between pull and push
    staleness_lr: bool = False    # scale each gradient's learning rate by 1/staleness
    async_lr: str = "divided"     # async, ssp: each push at lr / workers ("divided") or at lr ("full")
    dc_lambda: float = 0.0        # async, ssp: delay compensation (DC-ASGD) of strength lambda; 0: none
    dc_adaptive: bool = False     # async, ssp: lambda / sqrt(mean square of the gradients), per weight
    implicit_momentum: bool = False  # async, ssp: lower the optimizer's momentum by asynchrony's (1 - 1/workers)
    shards: int = 2               # parameter-server shards (psgd-server processes) holding the weights
    workers: int = 2              # workers (psgd-worker processes), each on its own share of the data
    servers: list = dataclasses.field(default_factory=list)  # shard addresses, host:port, in shard order
    data_ports: list = dataclasses.field(default_factory=list)  # each shard's data port, in shard order; empty: free ones
    slice_bytes: int = 4 << 20    # tensors larger than this are cut into slices
    lease_seconds: float = 10.0   # a worker silent this long leaves the round
    join_timeout: float = 120.0   # a worker that never registers within this leaves the round
    request_timeout: float = 60.0  # longest wait for any one call (a sync pull included)
    hello_timeout: float = 2.0    # a data-port connection that has not sent its hello by then is closed
    busy_poll_us: int = -1        # µs a waiting end of a data connection watches for its answer before it sleeps;
    #                               -1: psgd launch chooses (1000 where each process it starts has a core), else 0
    transport: str = "auto"       # pulls and pushes: auto (shared memory on a shard's host, else tcp), shm, tcp, grpc
    wire_dtype: str = ""          # "float16" or "bfloat16": compress pushed float32 gradients on the wire
    overlap: bool = False         # all-reduce: buckets reduced during backward; PS: next pull beside this push
    checkpoint_rounds: int = -1   # sync: every shard checkpoints at each multiple of this many rounds, all at the
    #                               same versions (cuts); 0: every psgd-server --checkpoint-every seconds, at any
    #                               version; -1: 100 under sync without backup workers, else 0 (a shard without
    #                               a checkpoint folder has no cuts then)
    on_cut_failure: str = "stop"  # a shard that cannot write a cut: "stop" (it refuses every call) or "continue"
    replicas: int = 0             # async, ssp: 1 runs each shard twice, a replica applying every update before the
    #                               push is acknowledged; workers fail over to it when the primary dies
    replica_servers: list = dataclasses.field(default_factory=list)  # the replicas' addresses, in shard order

    @property
    def cut_rounds(self) -> int:
        """Rounds between cuts (0: none): ``checkpoint_rounds``, or where it is -1, :data:`CUT_ROUNDS` under sync
        without backup workers (a killed shard then changes nothing) and none under the other policies."""
        if self.checkpoint_rounds >= 0:
            return self.checkpoint_rounds
        return CUT_ROUNDS if POLICIES[self.policy].accumulates and not self.backup_workers else 0

    def shard_cut_rounds(self, checkpoints: bool) -> int:
        """A shard's rounds between cuts: a checkpoint_rounds that is set holds for every shard; the default's only
        for one that keeps checkpoints (``checkpoints``: it has a folder to write them to)."""
        return self.cut_rounds if checkpoints or self.checkpoint_rounds > 0 else 0

    @property
    def busy_poll_seconds(self) -> float:
        """Seconds a waiting end of a data connection watches before it sleeps (``busy_poll_us``; -1 is none)."""
        return max(self.busy_poll_us, 0) / 1e6


#: [cluster] checkpoint_rounds of a sync job that does not set it: a cut every this many rounds
CUT_ROUNDS = 100
#: how an async or ssp push is scaled: "divided" (lr / workers, so N pushes move the weights as one sync
#: round does) or "full" (lr, each push a whole step)
ASYNC_LR = ("divided", "full")
_CLUSTER_INT_KEYS = {"staleness": (0, 10**6), "backup_workers": (0, 10**4), "local_steps": (1, 10**6),
                     "checkpoint_rounds": (-1, 10**9), "replicas": (0, 1),
                     "shards": (1, 1024), "workers": (1, 10**4), "slice_bytes": (64, 1 << 30),
                     "busy_poll_us": (-1, 10**6)}
#: Seconds, (least, most): more than the most and a call's deadline no longer fits gRPC's clock (1e10 s did not);
#: less than the least and no heartbeat or answer can come in time (a lease of 1e-9 s expired every worker at once).
_CLUSTER_TIME_KEYS = {"lease_seconds": (0.1, 86400.0), "join_timeout": (0.1, 7 * 86400.0),
                      "request_timeout": (0.01, 86400.0), "hello_timeout": (0.01, 3600.0)}


@dataclasses.dataclass
class TablesConfig:
    """How a model's embedding tables are trained and kept (psgd.optim.rows, psgd.tables); unused without tables."""

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
        fields = {f.name for f in dataclasses.fields(target)}
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
        setattr(target, key, value)

    def validate(self) -> None:
        src = self.source
        for section in ("model", "data", "optimizer"):
            name = getattr(self, section).get("name")
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{src}: [{section}] needs a name (a string)")
        t = self.train
        _check_ints(src, "train", t, _INT_KEYS)
        for key in ("eval_beside", "graphs"):
            if not isinstance(getattr(t, key), bool):
                raise ConfigError(f"{src}: [train] {key} must be true or false, got {getattr(t, key)!r}")
        if t.dtype not in DTYPES:
            raise ConfigError(f"{src}: [train] dtype must be one of {DTYPES}, got {t.dtype!r}")
        if not isinstance(t.device, str):
            raise ConfigError(f"{src}: [train] device must be a string such as 'cpu' or 'cuda:0', got {t.device!r}")
        self._validate_cluster()
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

    def _validate_replicas(self) -> None:
        src, c = self.source, self.cluster
        if not isinstance(c.replica_servers, list) or not all(
                isinstance(a, str) and a.rpartition(":")[2].isdigit() for a in c.replica_servers):
            raise ConfigError(f"{src}: [cluster] replica_servers must be a list of host:port strings, "
                              f"got {c.replica_servers!r}")
        if c.replica_servers and (len(c.replica_servers) != c.shards or not c.replicas):
            raise ConfigError(f"{src}: [cluster] lists {len(c.replica_servers)} replica address(es); with "
                              f"replicas = 1 it lists one per shard ({c.shards}), without replicas none")
        if c.checkpoint_rounds > 0 and not POLICIES[c.policy].accumulates:
            raise ConfigError(f"{src}: [cluster] checkpoint_rounds = {c.checkpoint_rounds} cuts checkpoints at common "
                              f"rounds, which only a sync policy has (this job's: {c.policy}); leave it 0")
        if c.checkpoint_rounds > 0 and c.backup_workers:
            raise ConfigError(f"{src}: [cluster] checkpoint_rounds = {c.checkpoint_rounds} takes a job back to a cut "
                              f"with every worker in every round, and backup_workers = {c.backup_workers} closes "
                              "rounds without some: use one of them")
        if c.replicas and POLICIES[c.policy].accumulates:
            raise ConfigError(f"{src}: [cluster] replicas = 1 keeps a copy of each shard for async and ssp; a sync "
                              "job comes back from a killed shard without losing anything with checkpoint_rounds")

    def _validate_cluster(self) -> None:
        src, c = self.source, self.cluster
        if not isinstance(c.policy, str) or c.policy not in POLICIES:
            raise ConfigError(f"{src}: [cluster] policy must be one of {', '.join(POLICIES)}, got {c.policy!r}")
        _check_ints(src, "cluster", c, _CLUSTER_INT_KEYS)
        for key, (least, most) in _CLUSTER_TIME_KEYS.items():
            value = getattr(c, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not least <= value <= most:
                raise ConfigError(f"{src}: [cluster] {key} must be a number of seconds from {least:g} to {most:g}, "
                                  f"got {value!r}")
        if c.backup_workers >= c.workers:
            raise ConfigError(f"{src}: [cluster] backup_workers ({c.backup_workers}) must be less than workers ({c.workers})")
        if not isinstance(c.servers, list) or not all(isinstance(a, str) and a.rpartition(":")[2].isdigit()
                                                        for a in c.servers):
            raise ConfigError(f"{src}: [cluster] servers must be a list of host:port strings, got {c.servers!r}")
        if c.servers and len(c.servers) != c.shards:
            raise ConfigError(f"{src}: [cluster] lists {len(c.servers)} server address(es) but shards = {c.shards}")
        if not isinstance(c.data_ports, list) or not all(
                isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in c.data_ports):
            raise ConfigError(f"{src}: [cluster] data_ports must be a list of ports (1-65535), one per shard, got "
                              f"{c.data_ports!r}")
        if c.data_ports and len(c.data_ports) != c.shards:
            raise ConfigError(f"{src}: [cluster] lists {len(c.data_ports)} data port(s) but shards = {c.shards}: one "
                              "per shard, or none (each shard takes a free one)")
        self._validate_replicas()
        if isinstance(c.dc_lambda, bool) or not isinstance(c.dc_lambda, (int, float)) \
                or not 0 <= c.dc_lambda <= 1e6:
            raise ConfigError(f"{src}: [cluster] dc_lambda must be a number from 0 (no delay compensation) to "
                              f"1e6, got {c.dc_lambda!r}")
        for key in ("staleness_lr", "overlap", "dc_adaptive", "implicit_momentum"):
            if not isinstance(getattr(c, key), bool):
                raise ConfigError(f"{src}: [cluster] {key} must be true or false, got {getattr(c, key)!r}")
        if c.implicit_momentum and self.optimizer.get("name") not in ("momentum", "nesterov"):
            raise ConfigError(f"{src}: [cluster] implicit_momentum lowers a momentum optimizer's momentum; "
                              f"[optimizer] name is {self.optimizer.get('name')!r} (use momentum or nesterov)")
        if POLICIES[c.policy].local:
            pushing = [k for k in ("dc_lambda", "implicit_momentum", "overlap") if getattr(c, k)]
            if pushing:
                raise ConfigError(f"{src}: [cluster] {', '.join(pushing)} cannot go with policy {c.policy!r}: its "
                                  "workers push their progress after local steps, not a gradient of the weights "
                                  "they pulled")
        if c.async_lr not in ASYNC_LR:
            raise ConfigError(f"{src}: [cluster] async_lr must be \"divided\" (each async or ssp push at lr / "
                              f"workers) or \"full\" (at lr), got {c.async_lr!r}")
        if c.transport not in TRANSPORTS:
            raise ConfigError(f"{src}: [cluster] transport must be one of {', '.join(map(repr, TRANSPORTS))}, "
                              f"got {c.transport!r}")
        if c.on_cut_failure not in ("stop", "continue"):
            raise ConfigError(f"{src}: [cluster] on_cut_failure must be \"stop\" or \"continue\", got "
                              f"{c.on_cut_failure!r}")
        if c.wire_dtype not in ("", "float16", "bfloat16"):
            raise ConfigError(f"{src}: [cluster] wire_dtype must be \"\", \"float16\" or \"bfloat16\", "
                              f"got {c.wire_dtype!r}")

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
        _check_ints(src, "tables", t, _TABLES_INT_KEYS)
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
            "cluster": dataclasses.asdict(self.cluster),
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


def _check_ints(source: str, section: str, values: Any, ranges: dict[str, tuple[int, int]]) -> None:
    for key, (low, high) in ranges.items():
        value = getattr(values, key)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(f"{source}: [{section}] {key} must be an integer from {low} to {high}, got {value!r}")


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
