"""What to run: the widths, worker counts and configurations (with the quick and default sets), one
:class:`Run` and its ``psgd`` command line, the column labels, and :class:`Settings` with its plan."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from psgd.compute.threads import THREAD_VARIABLES, available_cores

WIDTHS = (64, 128, 256, 512, 1024, 2048, 4096)
WORKERS = (1, 2, 4)
CONFIGS = ("single", "sync", "async", "allreduce", "peer", "allcores", "cnn")
KINDS = ("single", "sync", "async", "allreduce")
DEFAULTS = {"widths": WIDTHS, "workers": WORKERS, "configs": CONFIGS, "epochs": 20, "repeats": 3}
QUICK = {
    "widths": (64, 512),
    "workers": (1, 2),
    "configs": ("single", "sync", "peer", "allcores"),
    "epochs": 1,
    "repeats": 1,
}
DEFAULT_TIMEOUT = 300.0
DEFAULT_OUT = "benchmarks/results/scaling"

#: The peer column's environment: one BLAS/OpenMP thread per process, set in that run's environment only.
PEER_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
PEER_LABEL = "2w sync, 1 BLAS thread (peer)"
#: The column that shows what the thread budget prevents: every process with a thread per core (--threads).
ALLCORES_LABEL = "2w sync, all cores each (no budget)"
RATIO_LABEL = "as shipped / peer"
PEER_TARGET = 0.8
#: Variables that set thread counts; those present in the caller's environment are recorded.
THREAD_VARS = THREAD_VARIABLES


@dataclasses.dataclass(frozen=True)
class Run:
    """One configuration of one model: ``row`` is a hidden width ("64") or "cnn"."""

    row: str
    kind: str  # single | sync | async | allreduce (and ssp, for psgd bench simulate)
    workers: int = 1
    peer: bool = False  # PEER_ENV in its environment (the labelled peer column)
    all_cores: bool = False  # --threads <this machine's cores> on every process: no thread budget
    shards: int = 1  # parameter-server shards (psgd bench simulate's validation runs 2 too)

    @property
    def column(self) -> str:
        return column_label(self.kind, self.workers, self.peer, self.all_cores) + (
            f" {self.shards}s" if self.shards != 1 else ""
        )

    @property
    def label(self) -> str:
        return f"{row_label(self.row)} | {self.column}"

    def argv(self, epochs: int, run_dir: Path | None = None, timeout: float = DEFAULT_TIMEOUT) -> list[str]:
        """The ``psgd`` command line of this run, as a user would type it (without the leading ``psgd``)."""
        model = ["--model", "cnn"] if self.row == "cnn" else ["--set", f"model.hidden=[{self.row}]"]
        common = ["--optimizer", "sgd", "--lr", "0.1", "--epochs", str(epochs), *model, "--no-progress", "--json"]
        if self.kind == "single":
            return ["train", *common]
        mode = (
            ["--mode", "allreduce"]
            if self.kind == "allreduce"
            else ["--mode", "ps", "--policy", self.kind, "--shards", str(self.shards)]
        )
        threads = ["--threads", str(available_cores())] if self.all_cores else []
        return [
            "launch",
            *mode,
            "--workers",
            str(self.workers),
            *common,
            *threads,
            "--run-dir",
            str(run_dir),
            "--timeout",
            f"{timeout:g}",
        ]


def column_label(kind: str, workers: int = 1, peer: bool = False, all_cores: bool = False) -> str:
    if peer:
        return PEER_LABEL
    if all_cores:
        return ALLCORES_LABEL
    if kind == "single":
        return "1 process"
    return f"{kind_name(kind)} {workers}w"


def kind_name(kind: str) -> str:
    return "all-reduce" if kind == "allreduce" else kind


def row_label(row: str) -> str:
    return "CNN" if row == "cnn" else f"MLP {row}"


@dataclasses.dataclass
class Settings:
    widths: list[int]
    workers: list[int]
    configs: list[str]
    epochs: int
    repeats: int
    timeout: float
    out: str
    quick: bool = False
    network: str = ""  # a link rate (1gbit, 10gbit, none): launches on emulated hosts (psgd.bench.hosted)

    @property
    def rows(self) -> list[str]:
        return [str(w) for w in self.widths] + (["cnn"] if "cnn" in self.configs else [])

    def plan(self) -> list[Run]:
        """The runs of one repeat, row by row; the peer run comes right after its as-shipped twin."""
        runs = []
        peer, all_cores = "peer" in self.configs, "allcores" in self.configs
        for row in self.rows:
            if "single" in self.configs:
                runs.append(Run(row, "single"))
            for n in sorted(set(self.workers) | ({2} if peer or all_cores else set())):
                for kind in ("sync", "async", "allreduce"):
                    pair = (peer or all_cores) and kind == "sync" and n == 2  # their as-shipped twin always runs
                    if pair or (kind in self.configs and n in self.workers):
                        runs.append(Run(row, kind, n))
                    if pair and peer:
                        runs.append(Run(row, "sync", 2, peer=True))
                    if pair and all_cores:
                        runs.append(Run(row, "sync", 2, all_cores=True))
        return runs

    def columns(self) -> list[str]:
        """The table's columns, in a fixed order: one process, sync, async, all-reduce, peer."""
        runs = {(r.kind, r.workers, r.peer, r.all_cores) for r in self.plan()}
        order = sorted(runs, key=lambda k: (k[2] or k[3], k[3], KINDS.index(k[0]), k[1]))
        return [column_label(*k) for k in order]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
