"""A job assembled from its job file, once, and its identity: everything the processes of one job build
and must agree on.

:func:`build_job` (a trainer: the dataset loaded, a device opened, the model checked) and :func:`describe_job`
(a shard, an export, a check: the model from the dataset's headers, no data, no device) are the one place that
turns a :class:`~psgd.config.JobConfig` into the objects every process trains or serves with: the model, the
partition plan, and (:class:`Job`'s methods) the optimizer and the shard's consistency policy.  No other
module constructs a plan, a policy or an optimizer.

Every shard and worker derives the same identity from its job file and the
partition plan: the plan's hash, the consistency policy and its options, the
worker and shard counts, the optimizer with its options, and the dtype.  A
worker sends its identity when it registers; the shard compares it with its
own and refuses a mismatch with one line that names each field that differs,
so two processes started from different job files never train together
silently.  The fingerprint (a short hash of the identity) names the job: a
shard's checkpoints live under ``DIR/<fingerprint>/shard-K``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from psgd import data as datasets
from psgd import model as models
from psgd import optim
from psgd.compute import backend
from psgd.config import ConfigError, JobConfig
from psgd.partition import PartitionPlan
from psgd.policy import POLICIES, Policy, policy_from_cluster
from psgd.tables.held import RowTable, TableOptions
from psgd.tables.rules import ROW_OPTIMIZERS, build_row_optimizer

log = logging.getLogger(__name__)

#: the share of this machine's memory the embedding tables of one process may hold by default ([tables] max_rows =
#: 0), divided among the tables; each row counted twice, as a table grows by doubling
TABLE_MEMORY_SHARE = 0.25
#: The fields of an identity, in the order differences are reported; a job with embedding tables adds "tables"
#: (so a job without keeps the fingerprint it had before there were tables).
FIELDS = ("plan", "policy", "policy_options", "workers", "shards", "optimizer", "dtype")


def _fields(ident: Mapping[str, Any]) -> tuple[str, ...]:
    return FIELDS + (("tables",) if "tables" in ident else ())


_BOOT = secrets.token_hex(8)  # made once per interpreter


#: the environment variable through which a launch gives each worker a claim on its rank that outlives the
#: process (psgd.launcher.run.rank_claim): a resumed launch's worker takes the rank kept for its stopped one
RANK_CLAIM = "PSGD_RANK_CLAIM"


def process_incarnation() -> str:
    """What the shards know a worker process by when it registers: one process holds a rank at a time (a forked
    child differs from its parent by its pid), ``CLAIM/`` before it where a launch gave it a claim on its rank
    (:data:`RANK_CLAIM`)."""
    claim = os.environ.get(RANK_CLAIM, "").strip()
    return f"{claim}/{_BOOT}-{os.getpid()}" if claim else f"{_BOOT}-{os.getpid()}"


def alive_here(host: str, pid: int) -> bool:
    """Whether the process ``pid`` of ``host`` (as it registered: socket.gethostname()) is another one alive on
    this machine."""
    if host != socket.gethostname() or pid in (0, os.getpid()):
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True  # it exists, another user's
    except OSError:
        return False
    try:  # a process killed but not yet reaped by its parent (a zombie) still answers kill(0): it is dead
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def identity(config: JobConfig, plan_hash: str, tables: bool = False) -> dict[str, Any]:
    """What every process of a job must agree on (the shard index is checked apart); ``tables``: the plan has
    embedding tables, so how they are trained and kept (``[tables]``) is part of it."""
    c = config.cluster
    options: dict[str, Any] = {"staleness_lr": c.remedies.staleness_lr}
    if not POLICIES[c.policy].accumulates:  # each push an update of its own: at which rate is the job's meaning
        options.update(
            async_lr=c.remedies.async_lr,
            dc_lambda=c.remedies.dc_lambda,
            dc_adaptive=c.remedies.dc_adaptive,
            implicit_momentum=c.remedies.implicit_momentum,
        )
    options.update({o.name: getattr(c.consistency, o.cluster_key) for o in POLICIES[c.policy].options})
    if c.cut_rounds:  # every shard must cut at the same rounds (a job without keeps its fingerprint)
        options["checkpoint_rounds"] = c.cut_rounds
    return {
        "plan": plan_hash,
        "policy": c.policy,
        "policy_options": options,
        "workers": c.get("workers"),
        "shards": c.shards,
        "optimizer": dict(config.optimizer),
        "dtype": config.train.dtype,
        **({"tables": dataclasses.asdict(config.tables)} if tables else {}),
    }


def fingerprint(ident: Mapping[str, Any]) -> str:
    """A 16-hex-digit name of an identity (the same identity always gives the same name)."""
    text = json.dumps({k: ident.get(k) for k in _fields(ident)}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def differences(
    mine: Mapping[str, Any], theirs: Mapping[str, Any], me: str = "shard", them: str = "worker"
) -> list[str]:
    """Each field on which two identities differ, in words: ``policy: shard sync, worker async``."""
    out = []
    for key in dict.fromkeys(_fields(mine) + _fields(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):  # only the entries that differ
            keys = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
            a, b = ({k: v for k, v in d.items() if k in keys} for d in (a, b))
        if a != b:
            out.append(f"{key}: {me} {_show(a)}, {them} {_show(b)}")
    return out


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={v}" for k, v in sorted(value.items())) + "}"
    return "missing" if value is None else str(value)


@dataclasses.dataclass
class Job:
    """Everything one process builds from a job file: the model, the partition plan over the job's shards and,
    for a trainer, the dataset and the device; the optimizer and the policy are made by its methods."""

    config: JobConfig
    model: models.Model
    plan: PartitionPlan
    dataset: datasets.Dataset | None = None  # None: a role that never sees the data (a shard, an export)
    device: backend.Device | None = None  # None: a role that computes nothing on a device
    augment: Any = None  # what each training batch goes through ([train] augment), if anything

    @property
    def identity(self) -> dict[str, Any]:
        """What every process of the job must agree on (see :func:`identity`)."""
        return identity(self.config, self.plan.hash, tables=bool(self.plan.tables))

    def optimizer(self) -> optim.Optimizer:
        """A new optimizer as the job file's ``[optimizer]`` describes it (a trainer's, or a shard's), which moves
        the model's state variables (batch norm's running statistics) by their change instead of training them."""
        opt = job_optimizer(self.config)
        opt.state_vars = frozenset(s.name for s in self.plan.specs if s.state)
        return opt

    def policy(self) -> Policy:
        """A new consistency policy as the job's ``[cluster]`` describes it (a shard's)."""
        return policy_from_cluster(self.config.cluster)

    def shard_optimizer(self, rule: Policy) -> optim.Optimizer:
        """What a shard applies under ``rule``: the job's optimizer, or for a local policy, whose push is a
        worker's progress (x_pulled - x; its workers run the job's optimizer, state included), SGD at rate 1 (times
        the push's lr scale) that moves the centre by it."""
        return optim.SGD(1.0) if rule.local else self.optimizer()

    def one_shard_plan(self) -> PartitionPlan:
        """The job's variables as one shard would hold them (all-reduce ranks agree on its hash)."""
        return PartitionPlan(self.model.specs(), 1, tables=self.plan.tables)

    def row_tables(self, where: str = "this process") -> dict[str, RowTable]:
        """Every embedding table of the model, empty, as one process holds all of its rows (the reference
        trainer's), updated by the rule ``[tables]`` names and kept as it says."""
        t = self.config.tables
        rule = ROW_OPTIMIZERS[t.optimizer]
        rule_options = {k: getattr(t, k) for k in rule.options}
        tables = {}
        for spec in self.plan.tables:
            table = RowTable(
                spec,
                self.config.train.seed,
                build_row_optimizer(t.optimizer, lr=t.lr, **rule_options),
                TableOptions(t.admit_after, t.idle_updates, max(t.max_rows, 0), t.when_full),
                where,
            )
            if t.max_rows == 0:  # bounded from the memory this process may use: rows pulled cannot grow without end
                cap = int(physical_memory() * TABLE_MEMORY_SHARE) // len(self.plan.tables) // (2 * table.row_bytes())
                table.options = dataclasses.replace(table.options, max_rows=max(1, cap))
            tables[spec.name] = table
        return tables


def job_optimizer(config: JobConfig) -> optim.Optimizer:
    """A new optimizer as ``config``'s ``[optimizer]`` describes it: what needs no model (a benchmark of the
    update rules alone) asks here, a role with a :class:`Job` asks its :meth:`Job.optimizer`."""
    return optim.build_optimizer(config.optimizer["name"], **config.options("optimizer"))


def check_optimizer(config: JobConfig) -> None:
    """The job's ``[optimizer]`` made once and dropped: a name or an option no optimizer takes fails here in one
    line, before anything starts (a trainer, the launcher), not later in a shard's log."""
    job_optimizer(config)


def build_job(
    config: JobConfig,
    dataset: datasets.Dataset | None = None,
    check: bool = False,
    model: Any = None,
    augment: Any = None,
) -> Job:
    """A trainer's job: the dataset loaded, the device opened, the model built (errors are one line each).
    ``dataset``, ``model`` (a model, or its class built here with the job's options) and ``augment`` (a function):
    a caller's own objects instead of the ones the job file names (:func:`psgd.train`).

    With ``check`` (every trainer, not the shards), the model is first checked on a small random batch
    (:func:`psgd.model.check_model`): a model that would fail mid-training fails here, one line per fault.
    """
    check_optimizer(config)
    device = backend.use_device(config.train.device)  # current before any array, kernel or buffer is made
    dtype = config.train.dtype
    if dataset is None:
        dataset = datasets.load_dataset(config.data["name"], dtype=dtype, **config.options("data"))
    model = build_job_model(config, dataset, model)
    check_fits(model.specs(), f"model {config.model['name']!r}")  # a worker holds all of it
    if check:
        began = time.perf_counter()
        models.check_model(
            model,
            dataset.input_shape,
            dataset.num_classes,
            dtype,
            config.train.seed,
            name=config.model["name"],
            options=config.options("model"),
            device=device,
            id_shape=dataset.id_shape,
            target=dataset.target,
            target_shape=dataset.target_shape,
        )
        log.debug("model %s passed its check in %.3f s", config.model["name"], time.perf_counter() - began)
    if augment is None and config.train.augment:
        from psgd.data.ahead import load_augment  # (numpy.random: loaded for a job that augments)

        augment = load_augment(config.train.augment)
    return Job(config=config, model=model, plan=_plan(config, model), dataset=dataset, device=device, augment=augment)


def describe_job(config: JobConfig, model: models.Model | None = None) -> Job:
    """The job of a role that never trains (a shard, an export, ``psgd doctor``, a benchmark's observer): the
    model from the dataset's headers (or ``model``, a benchmark's own), its plan; no data, no device."""
    model = build_job_model(config) if model is None else model
    return Job(config=config, model=model, plan=_plan(config, model))


def _plan(config: JobConfig, model: models.Model) -> PartitionPlan:
    return PartitionPlan(
        model.specs(), config.cluster.shards, config.cluster.links.slice_bytes, tables=models.model_tables(model)
    )


def build_job_model(
    config: JobConfig, data: datasets.Dataset | datasets.DataShape | None = None, model: Any = None
) -> models.Model:
    """The model a job file describes, for ``data``'s input shape and class count.

    Without ``data`` they come from :func:`psgd.data.describe_dataset`, which reads headers and labels
    but not the inputs: what a shard needs, which holds parameters and never sees the data.  No device
    is opened and the model is not checked.
    """
    if model is not None and not isinstance(model, type):
        return model
    dtype = config.train.dtype
    if data is None:
        data = datasets.describe_dataset(config.data["name"], dtype=dtype, **config.options("data"))
    made = models.build_model(
        config.model["name"] if model is None else model,
        data.input_shape,
        data.num_classes,
        dtype=dtype,
        id_shape=data.id_shape,
        target=data.target,
        **config.options("model"),
    )
    if data.target == "classes" and data.target_shape and getattr(made, "target", None) == "classes":
        raise ConfigError(
            f"model {config.model['name']!r} gives one class per example, but {data.name}'s targets "
            f"are a class per position {data.target_shape}: write a model whose scores are "
            "(batch, *positions, classes) (docs/howto/your-model.md)"
        )
    return made


def physical_memory() -> int:
    """Bytes of memory this machine has."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(specs: list[models.VarSpec], what: str, total: int | None = None) -> None:
    """Refuse, in one line and before anything is allocated, variables this machine's memory cannot hold
    while they are initialized (each is made in float64, then cast to its dtype)."""
    total = physical_memory() if total is None else total
    count = sum(s.size for s in specs)
    need = sum(s.size * (8 + np.dtype(s.dtype).itemsize) for s in specs)
    if need > total:
        dtypes = "/".join(sorted({s.dtype for s in specs}))
        raise ConfigError(
            f"{what}: its variables ({count:,} parameters of {dtypes}, {need / 2**30:.1f} GiB while "
            f"they are initialized) do not fit this machine's {total / 2**30:.1f} GiB of memory"
        )


def params_to_device(params: Mapping[str, np.ndarray], device: backend.Device) -> dict[str, Any]:
    return {name: device.asarray(value) for name, value in params.items()}
