"""psgd: parameter-server and all-reduce training for networks written in NumPy/CuPy.

From Python (:mod:`psgd.api`): :func:`train` in this process, :func:`launch` over shards and workers, each
returning a :class:`Result`; :class:`JobConfig` and :func:`job_config`, the job's settings as objects;
:func:`join`, in a script ``psgd run`` started: this worker's place in the job, for a loop of its own.  Loaded
when first used, so that ``import psgd`` stays quick for the commands.
"""

from typing import Any

__version__ = "0.1.0"

#: the public names, and the module each comes from
PUBLIC = {
    "train": "psgd.api",
    "launch": "psgd.api",
    "Result": "psgd.api",
    "job_config": "psgd.api",
    "join": "psgd.worker.script",
    "Worker": "psgd.worker.script",
    "JobConfig": "psgd.config",
    "ConfigError": "psgd.config",
    "PsgdError": "psgd.errors",
    "LaunchInterrupted": "psgd.launcher",
    "LaunchError": "psgd.launcher",
    "Dataset": "psgd.data",
    "dataset_from": "psgd.data",
}

#: the modules a user imports from, whose names (their ``__all__``) keep their meaning from release to release: these
#: and the names above are psgd's public API; every other module is psgd's own and may change without notice
PUBLIC_MODULES = ("psgd", "psgd.autodiff", "psgd.autodiff.nn", "psgd.autodiff.ops", "psgd.model", "psgd.model.losses")

__all__ = ["__version__", *PUBLIC]


def __getattr__(name: str) -> Any:
    if name in PUBLIC:
        import importlib

        value = getattr(importlib.import_module(PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'psgd' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(PUBLIC))
