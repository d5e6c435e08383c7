"""``[cluster]``: how the parameter-server job is laid out and how its shards apply updates, in parts that say what
they are about.

A job file writes every key of the section flat (``[cluster] staleness = 3``, ``--set cluster.staleness=3``); in
memory each key belongs to one part, frozen: :class:`Consistency` (a policy's own settings), :class:`Remedies`
(what shards do to a stale async push), :class:`Links` (how pulls and pushes travel), :class:`Deadlines` and
:class:`Recovery` (checkpoint cuts and replicas).  Each key says beside its field what it may be, and a part (and
:class:`ClusterConfig`, frozen too) refuses a bad value when it is made; the rules across keys, between parts or with
the optimizer, are :meth:`ClusterConfig.check_across`, the one place every command, ``psgd doctor`` and a starting
shard share.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from psgd.config.checks import addresses, flag, integer, number, one_of, ports, refuse_bad, seconds
from psgd.errors import ConfigError
from psgd.policy import POLICIES
from psgd.wire import TRANSPORTS

#: [cluster] checkpoint_rounds of a sync job that does not set it: a cut every this many rounds
CUT_ROUNDS = 100
#: how an async or ssp push is scaled: "divided" (lr / workers, so N pushes move the weights as one sync
#: round does) or "full" (lr, each push a whole step)
ASYNC_LR = ("divided", "full")
_ASYNC_LR_SAID = '"divided" (each async or ssp push at lr / workers) or "full" (at lr)'


def workers_range(value: Any) -> tuple[int, int]:
    """``[cluster] workers`` as (fewest, most): an integer N is (N, N), a string ``"MIN:MAX"`` a range (torchrun's
    ``--nnodes``), ``"N"`` is N.  Anything else is a ConfigError that says what it may be."""
    if isinstance(value, str):
        low, sep, high = value.strip().partition(":")
        try:
            fewest, most = (int(low), int(high)) if sep else (int(low), int(low))
        except ValueError:
            fewest = most = -1
        if not sep and most >= 0 or fewest >= 1 and most >= fewest:  # a count's range is the field's to check
            return fewest, most
    elif isinstance(value, int) and not isinstance(value, bool):
        return value, value  # its range is the field's to check
    raise ConfigError(
        f"[cluster] workers must be a number of workers or a range \"MIN:MAX\" with 1 <= MIN <= MAX, got {value!r}"
    )


@dataclasses.dataclass(frozen=True)
class Consistency:
    """A policy's own settings (each read only by the policies named)."""

    staleness: int = integer(2, 0, 10**6)  # ssp: how many clocks a worker may run ahead of the slowest
    backup_workers: int = integer(0, 0, 10**4)  # sync: close a round after workers - backup_workers pushes
    local_steps: int = integer(4, 1, 10**6)  # local: steps a worker takes on its own copy between pull and push

    def __post_init__(self) -> None:
        refuse_bad(self, "cluster")


@dataclasses.dataclass(frozen=True)
class Remedies:
    """What a shard does to an async or ssp push computed on old weights (psgd.server.state.remedies)."""

    staleness_lr: bool = flag(False)  # scale each gradient's learning rate by 1/staleness
    async_lr: str = one_of("divided", ASYNC_LR, _ASYNC_LR_SAID)  # async, ssp: each push at lr / workers ("divided")
    #                               or at lr ("full")
    dc_lambda: float = number(0.0, "a number from 0 (no delay compensation) to 1e6", 0, 1e6)  # async, ssp: delay
    #                               compensation (DC-ASGD) of strength lambda; 0: none
    dc_adaptive: bool = flag(False)  # async, ssp: lambda / sqrt(mean square of the gradients), per weight
    implicit_momentum: bool = flag(False)  # async, ssp: lower the optimizer's momentum by asynchrony's (1 - 1/workers)

    def __post_init__(self) -> None:
        refuse_bad(self, "cluster")


@dataclasses.dataclass(frozen=True)
class Links:
    """How pulls and pushes travel between workers and shards."""

    transport: str = one_of("auto", TRANSPORTS, quoted=True)  # pulls and pushes: auto (shared memory on a shard's
    #                               host, else tcp), shm, tcp, grpc
    wire_dtype: str = one_of("", ("", "float16", "bfloat16"), quoted=True)  # "float16" or "bfloat16": compress
    #                               pushed float32 gradients on the wire
    slice_bytes: int = integer(4 << 20, 64, 1 << 30)  # tensors larger than this are cut into slices
    data_ports: tuple = ports()  # each shard's data port, in shard order; empty: free ones
    hello_timeout: float = seconds(2.0, 0.01, 3600.0)  # a data-port connection that has not sent its hello by then is
    #                               closed
    busy_poll_us: int = integer(-1, -1, 10**6)  # µs a waiting end of a data connection watches for its answer
    #                               before it sleeps;
    #                               -1: psgd launch chooses (1000 where each process it starts has a core), else 0

    def __post_init__(self) -> None:
        refuse_bad(self, "cluster")

    @property
    def busy_poll_seconds(self) -> float:
        """Seconds a waiting end of a data connection watches before it sleeps (``busy_poll_us``; -1 is none)."""
        return max(self.busy_poll_us, 0) / 1e6


@dataclasses.dataclass(frozen=True)
class Deadlines:
    """How long anything waits for a worker or an answer."""

    # more than the most and a call's deadline no longer fits gRPC's clock (1e10 s did not); less than the least
    # and no heartbeat or answer can come in time (a lease of 1e-9 s expired every worker at once)
    lease_seconds: float = seconds(10.0, 0.1, 86400.0)  # a worker silent this long leaves the round
    join_timeout: float = seconds(120.0, 0.1, 7 * 86400.0)  # a worker that never registers within this leaves the
    #                               round
    request_timeout: float = seconds(60.0, 0.01, 86400.0)  # longest wait for any one call (a sync pull included)

    def __post_init__(self) -> None:
        refuse_bad(self, "cluster")


@dataclasses.dataclass(frozen=True)
class Recovery:
    """How a job comes back from a killed shard: checkpoint cuts (sync) or a replica of each shard (async, ssp)."""

    checkpoint_rounds: int = integer(-1, -1, 10**9)  # sync: every shard checkpoints at each multiple of this many
    #                               rounds, all at the same versions (cuts); 0: every psgd-server --checkpoint-every
    #                               seconds, at any version; -1: 100 under sync without backup workers, else 0 (a
    #                               shard without a checkpoint folder has no cuts then)
    on_cut_failure: str = one_of("stop", ("stop", "continue"), quoted=True)  # a shard that cannot write a cut:
    #                               "stop" (it refuses every call) or "continue"
    replicas: int = integer(0, 0, 1)  # async, ssp: 1 runs each shard twice, a replica applying every update before
    #                               the push is acknowledged; workers fail over to it when the primary dies
    replica_servers: tuple = addresses()  # the replicas' addresses, in shard order

    def __post_init__(self) -> None:
        refuse_bad(self, "cluster")


PARTS = {"consistency": Consistency, "remedies": Remedies, "links": Links, "deadlines": Deadlines, "recovery": Recovery}
#: each key a job file writes under [cluster] that belongs to a part -> that part's name
PART_OF = {f.name: part for part, cls in PARTS.items() for f in dataclasses.fields(cls)}


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """How the parameter-server job is laid out and how shards apply updates."""

    policy: str = one_of("sync", POLICIES)  # a consistency policy: a name in psgd.policy.POLICIES
    shards: int = integer(2, 1, 1024)  # parameter-server shards (psgd-server processes) holding the weights
    workers: int = integer(2, 1, 10**4)  # workers (psgd-worker processes), each on its own share of the data; in a
    #                               job with a range ("MIN:MAX"), the most that may train at once
    min_workers: int = integer(0, 0, 10**4)  # a job with a range: the fewest it trains with (0: a fixed count);
    #                               written in a job file as workers = "MIN:MAX"
    servers: tuple = addresses()  # shard addresses, host:port, in shard order
    overlap: bool = flag(False)  # all-reduce: buckets reduced during backward; PS: next pull beside this push
    consistency: Consistency = dataclasses.field(default_factory=Consistency)
    remedies: Remedies = dataclasses.field(default_factory=Remedies)
    links: Links = dataclasses.field(default_factory=Links)
    deadlines: Deadlines = dataclasses.field(default_factory=Deadlines)
    recovery: Recovery = dataclasses.field(default_factory=Recovery)

    def __post_init__(self) -> None:
        refuse_bad(self, "cluster")

    # -- the job file's flat keys ---------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """Every key the section takes, as a job file writes it (``min_workers`` is in ``workers = "MIN:MAX"``)."""
        return [f.name for f in dataclasses.fields(self) if f.name not in PARTS and f.name != "min_workers"] + list(
            PART_OF
        )

    def get(self, key: str) -> Any:
        """The value of a job file's key (``staleness`` is ``consistency.staleness``; ``workers`` of a job with a
        range is ``"MIN:MAX"``)."""
        if key == "workers" and self.elastic:
            return f"{self.min_workers}:{self.workers}"
        part = PART_OF.get(key)
        return getattr(self if part is None else getattr(self, part), key)

    def with_value(self, key: str, value: Any) -> ClusterConfig:
        """A new section with a job file's key given a value (and its part made anew): the section and its parts are
        frozen, as a shard or a worker takes them whole and they do not change under it."""
        if key == "workers":
            fewest, most = workers_range(value)
            return dataclasses.replace(self, workers=most, min_workers=0 if fewest == most else fewest)
        part = PART_OF.get(key)
        if part is None:
            return dataclasses.replace(self, **{key: value})
        return dataclasses.replace(self, **{part: dataclasses.replace(getattr(self, part), **{key: value})})

    def flat(self) -> dict[str, Any]:
        """The section as a job file writes it: every key, flat (a list as a list, as the file had it)."""
        return {
            key: list(value) if isinstance(value, tuple) else value
            for key, value in ((key, self.get(key)) for key in self.keys())
        }

    # -- what it means ---------------------------------------------------------------------------------------------
    @property
    def elastic(self) -> bool:
        """Whether the job has a range of workers: workers may join it and leave it while it runs."""
        return 0 < self.min_workers < self.workers

    @property
    def fewest(self) -> int:
        """The workers a job starts with and trains on at the least: MIN of a range, else all of them."""
        return self.min_workers if self.elastic else self.workers

    @property
    def cut_rounds(self) -> int:
        """Rounds between cuts (0: none): ``checkpoint_rounds``, or where it is -1, :data:`CUT_ROUNDS` under sync
        without backup workers (a killed shard then changes nothing) and none under the other policies."""
        if self.recovery.checkpoint_rounds >= 0:
            return self.recovery.checkpoint_rounds
        return CUT_ROUNDS if POLICIES[self.policy].accumulates and not self.consistency.backup_workers else 0

    def shard_cut_rounds(self, checkpoints: bool) -> int:
        """A shard's rounds between cuts: a checkpoint_rounds that is set holds for every shard; the default's only
        for one that keeps checkpoints (``checkpoints``: it has a folder to write them to)."""
        return self.cut_rounds if checkpoints or self.recovery.checkpoint_rounds > 0 else 0

    # -- the rules across keys --------------------------------------------------------------------------------------
    def check_across(self, src: str, optimizer: str | None) -> None:
        """Every rule across keys (each key's own was kept when the section was made; ``optimizer``: the job's
        optimizer's name).  Apart from making, as a job's overrides may pass through a section that breaks one."""
        c, r, rec = self.consistency, self.remedies, self.recovery
        policy = POLICIES[self.policy]
        if self.min_workers > self.workers:
            raise ConfigError(
                f"{src}: [cluster] workers = \"{self.min_workers}:{self.workers}\": the fewest (MIN) must not be more "
                "than the most (MAX)"
            )
        if c.backup_workers >= self.fewest:
            raise ConfigError(
                f"{src}: [cluster] backup_workers ({c.backup_workers}) must be less than workers ({self.fewest}"
                + (", the fewest of its range)" if self.elastic else ")")
            )
        if self.servers and len(self.servers) != self.shards:
            raise ConfigError(
                f"{src}: [cluster] lists {len(self.servers)} server address(es) but shards = {self.shards}"
            )
        if self.links.data_ports and len(self.links.data_ports) != self.shards:
            raise ConfigError(
                f"{src}: [cluster] lists {len(self.links.data_ports)} data port(s) but shards = "
                f"{self.shards}: one per shard, or none (each shard takes a free one)"
            )
        if rec.replica_servers and (len(rec.replica_servers) != self.shards or not rec.replicas):
            raise ConfigError(
                f"{src}: [cluster] lists {len(rec.replica_servers)} replica address(es); with "
                f"replicas = 1 it lists one per shard ({self.shards}), without replicas none"
            )
        if rec.checkpoint_rounds > 0 and not policy.accumulates:
            raise ConfigError(
                f"{src}: [cluster] checkpoint_rounds = {rec.checkpoint_rounds} cuts checkpoints at "
                f"common rounds, which only a sync policy has (this job's: {self.policy}); leave it 0"
            )
        if rec.checkpoint_rounds > 0 and c.backup_workers:
            raise ConfigError(
                f"{src}: [cluster] checkpoint_rounds = {rec.checkpoint_rounds} takes a job back to a "
                f"cut with every worker in every round, and backup_workers = {c.backup_workers} "
                "closes rounds without some: use one of them"
            )
        if rec.replicas and self.elastic:
            raise ConfigError(
                f'{src}: [cluster] replicas = 1 with workers = "{self.min_workers}:{self.workers}": a shard\'s replica '
                "does not keep the batches shard 0 hands out to a job with a range of workers yet; give workers one "
                "number, or leave replicas 0"
            )
        if rec.replicas and policy.accumulates:
            raise ConfigError(
                f"{src}: [cluster] replicas = 1 keeps a copy of each shard for async and ssp; a sync "
                "job comes back from a killed shard without losing anything with checkpoint_rounds"
            )
        if r.implicit_momentum and optimizer not in ("momentum", "nesterov"):
            raise ConfigError(
                f"{src}: [cluster] implicit_momentum lowers a momentum optimizer's momentum; "
                f"[optimizer] name is {optimizer!r} (use momentum or nesterov)"
            )
        if policy.local:
            pushing = [
                k
                for k, on in (
                    ("dc_lambda", r.dc_lambda),
                    ("implicit_momentum", r.implicit_momentum),
                    ("overlap", self.overlap),
                )
                if on
            ]
            if pushing:
                raise ConfigError(
                    f"{src}: [cluster] {', '.join(pushing)} cannot go with policy {self.policy!r}: "
                    "its workers push their progress after local steps, not a gradient of the weights "
                    "they pulled"
                )
