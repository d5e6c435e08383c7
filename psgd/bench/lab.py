"""What a convergence lab runs: one job shared by every run, the contenders, the injected delays, presets.

A lab is the cross product of *scenarios* (an injected delay, or none) and
*contenders* (ways to train: a parameter-server policy, or all-reduce); every
run trains the same model on the same data with the same seed, worker count
and optimizer, as real processes on this machine.

Contenders are named by short specs (the ``policies`` of a :class:`LabConfig`):

- ``sync``         parameter server, bulk-synchronous rounds
- ``async``        parameter server, every push applied on arrival
- ``ssp:S``        parameter server, bounded staleness S
- ``local:T``      parameter server, local SGD: T steps on a worker's own copy between pull and push
- ``backup:B``     parameter server, sync with B backup workers (a round closes after N-B pushes)
- ``allreduce``    no servers: N MPI ranks average their gradients every step

A name of :data:`psgd.policy.POLICIES` whose options all have defaults is a spec of its own.  A
parameter-server spec may go on with ``+`` modifiers (:data:`MODIFIERS`): ``async+dc``, ``ssp:2+slr``,
``async+im+bf16``.

Scenarios are delay specs for ``psgd-worker --delay`` (see
:mod:`psgd.training.delay`), or ``none``.
"""

from __future__ import annotations

import dataclasses
import re

from psgd.config import ConfigError, JobConfig
from psgd.policy import POLICIES, PolicyOption
from psgd.training.delay import DelayError, parse_delay


@dataclasses.dataclass(frozen=True)
class Contender:
    """One way to train (a parameter-server policy or all-reduce): how it is launched and the job keys it sets."""

    spec: str  # as given: sync | async | ssp:S | local:T | backup:B | allreduce, + modifiers
    label: str  # for tables and legends
    mode: str  # ps | allreduce
    sets: tuple[str, ...] = ()  # job overrides (cluster.policy=...)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """An injected delay shared by every run of the scenario ('' means none)."""

    delay: str = ""

    @property
    def name(self) -> str:
        """A file-name-safe slug: ``no-straggler`` or e.g. ``slowdown4-at0``."""
        if not self.delay:
            return "no-straggler"
        return re.sub(r"[^A-Za-z0-9.-]+", "", self.delay.replace("@", "-at").replace(":", "-"))

    @property
    def title(self) -> str:
        return "no straggler" if not self.delay else f"delay {self.delay}"


def _plain_policies() -> list[str]:
    """The parameter-server policies named by their name alone: those that need no option."""
    return [name for name, cls in POLICIES.items() if not any(o.required for o in cls.options)]


def _shorthands() -> dict[str, tuple[str, PolicyOption]]:
    """The first word of each ``WORD:N`` contender, with the policy and the option its number sets."""
    return {
        o.shorthand.partition(":")[0]: (name, o) for name, cls in POLICIES.items() for o in cls.options if o.shorthand
    }


def contender_families() -> list[str]:
    """Every first word a contender may start with, policies first, in the order of :data:`POLICIES`."""
    return list(dict.fromkeys([*POLICIES, *_shorthands(), "allreduce"]))


def family(spec: str) -> str:
    """The first word of a contender (``ssp`` of ``ssp:2+bf16``)."""
    return spec.strip().split("+")[0].partition(":")[0]


#: A network of the lab that is this machine's own loopback (no emulated hosts), beside shaped ones.
LOOPBACK = "loopback"
#: What a parameter-server contender may add after a ``+``: gradient compression on the wire (``async+bf16``),
#: and the remedies for staleness of async, ssp and local pushes (``async+dc``), with the strengths
#: Zheng et al. 2017 used on CIFAR-10 for delay compensation (constant 0.04, adaptive 2).
MODIFIERS = {
    "bf16": ("bf16 gradients", ("cluster.wire_dtype=bfloat16",)),
    "fp16": ("fp16 gradients", ("cluster.wire_dtype=float16",)),
    "slr": ("lr / staleness", ("cluster.staleness_lr=true",)),
    "dc": ("delay compensation 0.04", ("cluster.dc_lambda=0.04",)),
    "dca": ("adaptive delay compensation 2", ("cluster.dc_lambda=2.0", "cluster.dc_adaptive=true")),
    "im": ("implicit momentum", ("cluster.implicit_momentum=true",)),
}


def parse_contender(spec: str) -> Contender:
    """A :class:`Contender` from ``sync``, ``async``, ``ssp:S``, ``local:T``, ``backup:B`` or ``allreduce``; a
    parameter-server one may go on with ``+`` and any of :data:`MODIFIERS` (``async+dc+bf16``)."""
    text = spec.strip()
    base, *added = text.split("+")
    inner = _parse_base(base, spec)
    for name in added:
        if name not in MODIFIERS:
            raise ConfigError(f"policy {spec!r}: +{name} is none of +{', +'.join(MODIFIERS)}")
        if inner.mode != "ps":
            raise ConfigError(f"policy {spec!r}: +{name} is for parameter-server policies")
        words, sets = MODIFIERS[name]
        inner = Contender(text, f"{inner.label}, {words}", "ps", (*inner.sets, *sets))
    return inner


def _parse_base(text: str, spec: str) -> Contender:
    kind, _, arg = text.partition(":")
    if text == "allreduce":
        return Contender(text, "allreduce (MPI)", "allreduce")
    if kind in _plain_policies() and not arg:
        return Contender(text, kind, "ps", (f"cluster.policy={kind}",))
    if kind in _shorthands() and arg.isdigit():
        policy, option = _shorthands()[kind]
        value = int(arg)
        if kind != policy and value == option.default:
            raise ConfigError(
                f"policy {spec!r}: {option.shorthand} needs a value other than {option.default} "
                f"(plain {policy} is {policy!r})"
            )
        return Contender(
            text,
            option.label.format(value),
            "ps",
            (f"cluster.policy={policy}", f"cluster.{option.cluster_key}={value}"),
        )
    forms = [o.shorthand for _, o in _shorthands().values()]
    raise ConfigError(f"unknown policy {spec!r}: use {', '.join(_plain_policies() + forms)} or allreduce")


def parse_scenario(text: str) -> Scenario:
    """A :class:`Scenario` from ``none`` or a delay spec such as ``slowdown:4@0``."""
    text = text.strip()
    if text in ("", "none"):
        return Scenario("")
    try:
        parse_delay(text)
    except DelayError as exc:
        raise ConfigError(str(exc)) from None
    return Scenario(text)


@dataclasses.dataclass
class LabConfig:
    """Everything a lab run depends on; recorded in its JSON output."""

    name: str = "default"
    job: list[str] = dataclasses.field(default_factory=list)  # --set overrides of the default job
    policies: list[str] = dataclasses.field(
        default_factory=lambda: ["sync", "async", "ssp:1", "ssp:4", "backup:1", "allreduce"]
    )
    delays: list[str] = dataclasses.field(default_factory=lambda: ["none", "slowdown:4@0"])
    target_accuracy: float = 0.95
    eval_interval: float = 0.05  # seconds between the observer's evaluations of the shards (ps runs)
    allreduce_eval_every: int = 2  # steps between rank 0's evaluations (allreduce runs)
    repeats: int = 1  # runs of every (scenario, policy); the table shows medians
    run_timeout: float = 600.0  # seconds; a run that takes longer fails
    networks: list[str] = dataclasses.field(default_factory=list)  # link rates (psgd.bench.netns); []: loopback

    def job_config(self) -> JobConfig:
        config = JobConfig()
        config = config.apply_sets(self.job)
        return config

    def contenders(self) -> list[Contender]:
        return [parse_contender(p) for p in self.policies]

    def scenarios(self) -> list[Scenario]:
        return [parse_scenario(d) for d in self.delays]

    def check(self) -> None:
        """Fail early, with one line, on anything a run would trip over later."""
        job = self.job_config()
        contenders = self.contenders()
        self.scenarios()
        if not contenders:
            raise ConfigError("no policies to run")
        for p in contenders:
            if p.spec.startswith("backup:") and int(p.spec.split(":")[1]) >= job.cluster.workers:
                raise ConfigError(f"policy {p.spec}: needs fewer backup workers than workers ({job.cluster.workers})")
        if not 0.0 < self.target_accuracy <= 1.0:
            raise ConfigError(f"target accuracy {self.target_accuracy} is not in (0, 1]")
        if self.repeats < 1:
            raise ConfigError(f"repeats must be >= 1, got {self.repeats}")
        if self.eval_interval <= 0 or self.allreduce_eval_every < 1:
            raise ConfigError("the evaluation interval must be > 0 seconds and >= 1 step")
        if self.networks:
            from psgd.bench import netns

            if len(set(self.networks)) != len(self.networks):
                raise ConfigError(f"--network lists a rate twice: {','.join(self.networks)}")
            try:
                netns.check_networks([n for n in self.networks if n != LOOPBACK])
            except netns.NetworkError as exc:
                raise ConfigError(str(exc)) from None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_DIGITS = ["cluster.workers=4", "cluster.shards=2", "train.epochs=30", "optimizer.name=momentum", "optimizer.lr=0.02"]

PRESETS: dict[str, LabConfig] = {
    # The default configuration: MLP on the bundled digits, 4 workers, 2 shards.
    "default": LabConfig(name="default", job=list(_DIGITS), repeats=3),
    # A lab of the lab: small enough for CI, still every output.
    "quick": LabConfig(
        name="quick",
        job=["cluster.workers=2", "cluster.shards=2", "train.epochs=4", "optimizer.name=momentum", "optimizer.lr=0.02"],
        policies=["sync", "async", "allreduce"],
        target_accuracy=0.8,
    ),
    # Communication dominates: a ~9.7M-parameter MLP (38.7 MB of float32) on synthetic teacher data.
    "synthetic": LabConfig(
        name="synthetic",
        job=[
            "cluster.workers=4",
            "cluster.shards=2",
            "data.name=synthetic",
            "data.input_dim=64",
            "data.n_train=3072",
            "data.n_test=256",
            "model.hidden=[3072, 3072]",
            "train.epochs=2",
            "optimizer.name=momentum",
            "optimizer.lr=0.01",
        ],
        policies=["sync", "async", "ssp:2", "backup:1", "allreduce"],
        target_accuracy=0.5,
        eval_interval=2.0,
        allreduce_eval_every=2,
    ),
    # Real data that takes minutes: a CNN (0.8M parameters) on 5,000 MNIST images (the mnist extra).
    "mnist": LabConfig(
        name="mnist",
        job=[
            "cluster.workers=4",
            "cluster.shards=2",
            "data.name=mnist5k",
            "model.name=cnn",
            "model.channels=[32, 64]",
            "model.hidden=256",
            "train.epochs=6",
            "optimizer.name=momentum",
            "optimizer.lr=0.02",
        ],
        policies=["sync", "async", "ssp:2", "backup:1", "allreduce"],
        target_accuracy=0.95,
        eval_interval=1.0,
        allreduce_eval_every=5,
    ),
}


def preset(name: str) -> LabConfig:
    """A fresh copy of a named preset (``default``, ``quick`` or ``synthetic``)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}: use one of {', '.join(PRESETS)}")
    return dataclasses.replace(
        PRESETS[name],
        job=list(PRESETS[name].job),
        policies=list(PRESETS[name].policies),
        delays=list(PRESETS[name].delays),
    )
