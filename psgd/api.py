"""psgd from Python: :func:`train` in this process (``psgd train``) and :func:`launch` over shards and workers
(``psgd launch``), each taking the model and the data as names or as your own objects, and returning a
:class:`Result`.

    import psgd
    result = psgd.train("mlp", "digits", epochs=5)
    print(result.test_accuracy)

The job's settings, in this order, validated once (a :class:`~psgd.config.ConfigError` names the key):

- ``job``: a job file's path, a :class:`~psgd.config.JobConfig`, or a dict of its sections;
- any ``[train]`` or ``[cluster]`` key by its name (``epochs=5``, ``batch_size=64``, ``workers=4``,
  ``policy="async"``), and ``optimizer`` and ``lr`` for ``[optimizer]``;
- ``settings``: any key of any section, as ``{"section.key": value}`` (``psgd ... --set``).

A launch runs other processes: each imports the model's class by its name (``package.module:Class``, so a
class defined in the script being run, or inside a function, is refused with a line that says what to do), and
reads your data from a ``.npz`` file written into the run folder.  Nothing is pickled.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import site
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from psgd.config import ConfigError, JobConfig, TrainConfig
from psgd.data import DataError, dataset_from
from psgd.data.ahead import load_augment
from psgd.launcher.folder import claim, new_run_folder, resume_command
from psgd.launcher.result import read_records
from psgd.launcher.run import launch as run_job
from psgd.launcher.supervise import LaunchInterrupted
from psgd.model.errors import ModelError
from psgd.model.registry import MODEL_METHODS, class_name, load_model_class
from psgd.observe.files import open_own
from psgd.observe.progress import bar_wanted
from psgd.training.local import train_local
from psgd.weights import read_npz, save_weights
from psgd.wire.tls import NO_TLS

log = logging.getLogger(__name__)

__all__ = ["Result", "train", "launch", "job_config"]


@dataclasses.dataclass(frozen=True)
class Result:
    """What a run ended with: ``test_accuracy`` and ``test_loss`` of the final weights on the held-out split
    (``test_r2`` instead of the accuracy where the targets are values: regression); ``seconds`` of training;
    ``history``, each evaluation (step, epoch, wall, train_loss, test_loss, test_accuracy or test_r2); ``weights``,
    the final weights on the host by variable name; ``worker_steps``, the steps each worker made, in rank order
    (psgd.train's one: the steps it made; a launch's: counted from the job's start, a resumed job's before its stop
    included), and ``steps``, their sum; ``run_dir``, the run folder (a launch's: logs, metrics, TensorBoard files,
    checkpoints; psgd.train's: its metrics' CSV and TensorBoard files, None where it kept no records);
    ``saved``, the ``.npz`` file the weights were written to; ``divergence``, what the divergence guard saw where it
    saw a run that was not training; ``checkpoint``, where a stopped psgd.train left its state (None: it ran to its
    end)."""

    test_accuracy: float | None
    test_loss: float
    seconds: float
    history: list[dict[str, Any]]
    weights: dict[str, np.ndarray]
    steps: int | None = None
    run_dir: str | None = None
    saved: str | None = None
    divergence: dict | None = None
    checkpoint: str | None = None
    test_r2: float | None = None
    worker_steps: tuple[int, ...] = ()


def job_config(
    job: Any = None, *, model: Any = None, data: Any = None, settings: Mapping[str, Any] | None = None, **keys: Any
) -> JobConfig:
    """The job :func:`train` and :func:`launch` run (see this module for ``job``, ``keys`` and ``settings``);
    ``model`` and ``data`` here are names (``"mlp"``, ``"mypkg.nets:Net"``; ``"digits"``, ``"npz:FILE"``)."""
    if job is None:
        config = JobConfig()
    elif isinstance(job, JobConfig):
        config = job  # frozen: each override below makes a new job, yours stays as it was
    elif isinstance(job, Mapping):
        config = JobConfig.from_dict(dict(job))
    elif isinstance(job, (str, os.PathLike)):
        config = JobConfig.load(job)
    else:
        raise ConfigError(f"job: give a job file's path, a JobConfig or a dict of sections, not a {type(job).__name__}")
    if model is not None:
        config = config.override("model.name", model)
    if data is not None:
        config = config.override("data.name", data)
    train_keys = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in keys.items() if v is not None}  # None: not given, the job's value holds
    for key, value in sorted(given.items(), key=lambda kv: kv[0] != "optimizer"):  # a name replaces its options
        if key in ("optimizer", "lr"):
            dotted = "optimizer.name" if key == "optimizer" else "optimizer.lr"
        elif key in train_keys:
            dotted = f"train.{key}"
        elif key in config.cluster.keys():
            dotted = f"cluster.{key}"
        else:
            raise ConfigError(
                f"unknown setting {key}=: name a [train] or [cluster] key (epochs, batch_size, "
                "workers, policy, ...), optimizer or lr; any other key as settings={'section.key': "
                "value}"
            )
        config = config.override(dotted, value)
    for dotted, value in (settings or {}).items():
        config = config.override(dotted, value)
    config.validate()
    return config


def train(
    model: Any = None,
    data: Any = None,
    *,
    job: Any = None,
    model_options: Mapping[str, Any] | None = None,
    test: Any = None,
    settings: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    metrics: str | None = None,
    save: str | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    checkpoint: str | None = None,
    resume: str | None = None,
    stop: threading.Event | None = None,
    run_dir: str | os.PathLike | None = None,
    **keys: Any,
) -> Result:
    """Train in this process, as ``psgd train``: the reference every other mode is measured against.

    ``model``: a name (``"mlp"``, ``"package.module:Class"``), a model class (built for the data with
    ``model_options``), or a model itself; by default the job's (``mlp`` without a job file).  ``data``: a
    dataset's name (``"digits"``, ``"npz:FILE"``), a :class:`psgd.data.Dataset`, a pair of arrays ``(x, y)``, or
    any map-style dataset (``len(d)``, ``d[i]`` -> ``(x, y)``) or iterable factory (a function returning an
    iterator of ``(x, y)``); by default the job's (``digits`` without a job file).  ``test``: its held-out
    examples, in the same forms (else a fixed fifth of each class).
    ``progress``: a progress bar on stderr (by default where stderr is a terminal); ``metrics``: a JSON-lines
    file of every step and evaluation, its CSV and TensorBoard files in the run folder; ``run_dir``: the run folder
    (with it, the JSON lines are ``RUN/local.jsonl`` unless ``metrics`` says where), else a new
    ``runs/DATE-TIME-local`` where there are records to keep, named in the last line logged and in the result's
    ``run_dir``; ``save``: a ``.npz`` file for the final weights; ``on_step``: called with each step's record.
    ``augment=f``: each training batch goes through ``f(x, y, rng) -> (x, y)`` on the host (a function, or its name
    as ``package.module:function``; psgd.launch's processes import it by name).
    ``stop`` (an event another thread may set): the step in hand is finished and the run ends early; its state
    (weights, optimizer, step) is then written to ``checkpoint`` (a ``.npz`` file), and ``resume=`` that file goes
    on from there, ending with the weights an unstopped run ends with."""
    augment = keys.pop("augment") if callable(keys.get("augment")) else None  # a function: this process's own
    config, own_model, dataset = _resolve(job, model, data, model_options, test, settings, keys)

    run = _records_folder(run_dir) if metrics or run_dir else None
    if run is not None and not metrics:
        metrics = str(run / "local.jsonl")
    result = train_local(
        config,
        dataset=dataset,
        model=own_model,
        augment=augment,
        progress=bar_wanted(progress),
        metrics_path=metrics,
        run_dir=run and str(run),
        on_step=on_step,
        keep=checkpoint,
        resume=resume,
        stop=stop,
    )
    if run is not None:
        log.info("the metrics lines are in %s; their CSV and TensorBoard files in %s", metrics, run)
    if save:
        save_weights(save, result.params)
    return Result(
        result.test_accuracy,
        result.test_loss,
        result.seconds,
        result.history,
        dict(result.params),
        result.steps,
        run_dir=run and str(run),
        saved=save or None,
        divergence=result.divergence,
        checkpoint=result.summary.get("kept"),
        test_r2=result.test_r2,
        worker_steps=(result.steps,),
    )


def launch(
    model: Any = None,
    data: Any = None,
    *,
    job: Any = None,
    model_options: Mapping[str, Any] | None = None,
    test: Any = None,
    settings: Mapping[str, Any] | None = None,
    mode: str = "ps",
    backend: str = "mpi",
    run_dir: str | os.PathLike | None = None,
    progress: bool | None = None,
    timeout: float = 900.0,
    save: str | None = None,
    resume: bool = False,
    tls: bool = True,
    **keys: Any,
) -> Result:
    """Run the job over processes of its own on this machine, as ``psgd launch``: shards and workers (``mode``
    ``"ps"``), or all-reduce ranks (``"allreduce"``, over ``backend`` ``"mpi"`` or ``"nccl"``).

    ``model``: a name, or a class its processes can import by name (``model_options`` go to it); by default the
    job's.  ``data``: as :func:`train` takes it; your own is written to ``RUN/data.npz`` for the workers to read.
    ``run_dir``: the run folder (else a new ``runs/DATE-TIME-MODE``); ``resume``: continue the job in ``run_dir``
    from its checkpoints.  ``save``: where the final weights go (else ``RUN/final.npz``).  ``timeout``: seconds
    the whole run may take.  ``tls``: mutual TLS between its processes, with a CA made for the job in ``RUN/tls``
    (or the job's ``[tls]`` files); False: plaintext.  ``augment``: a function its processes can import by name,
    or that name.
    A stop signal (Ctrl-C's SIGINT, SIGTERM, SIGHUP) stops every process of the job and raises
    :class:`LaunchInterrupted`, a KeyboardInterrupt whose message says how to go on from the shards' checkpoints:
    ``psgd.launch(..., run_dir=RUN, resume=True)``.  A process of the job that fails ends the launch with
    :class:`LaunchError`, whose ``failures`` are a record of each that did
    (:class:`~psgd.launcher.failures.ChildFailure`: its role, rank, pid, exit code or signal, when, its log and
    the log's last lines)."""
    if model is not None and not isinstance(model, (str, type)):
        raise ModelError(
            f"psgd.launch: its processes build the model themselves, each from its class: pass the "
            f"class ({type(model).__qualname__}) and its options as model_options=, not an instance"
        )
    if isinstance(model, type):
        model = _importable(model, "model", load_model_class, ModelError)
    if callable(keys.get("augment")):
        keys["augment"] = _importable(keys["augment"], "augmentation", load_augment, DataError)
    own = _own_data(data, test)
    config, _, _ = _resolve(job, model, None if own else data, model_options, None, settings, keys)
    run = Path(run_dir) if run_dir else new_run_folder(mode)
    claim(run, resume, mode)  # before your data goes into it
    if own:
        config = config.override("data.name", _written(data, test, run, config.train.dtype))
        config.validate()
    again = (
        f"psgd.launch(..., run_dir={str(run)!r}, resume=True) from Python, or "
        f"{resume_command(run, flags=[] if tls else ['--no-tls'])}"
    )
    try:
        done = run_job(
            config,
            mode=mode,
            backend=backend,
            run_dir=str(run),
            progress=bar_wanted(progress),
            timeout=timeout,
            save=save,
            resume=resume,
            tls=None if tls else NO_TLS,
            continue_with=again,
        )
    except LaunchInterrupted as exc:  # Ctrl-C: where the launcher was waiting is no news to the caller
        raise exc.with_traceback(None) from None
    return Result(
        done.test_accuracy,
        done.test_loss,
        done.seconds,
        _history(run, mode),
        read_npz(done.saved),
        sum(done.worker_steps),
        run_dir=str(run),
        saved=done.saved,
        divergence=done.divergence,
        test_r2=done.test_r2,
        worker_steps=tuple(done.worker_steps),
    )


def _records_folder(run_dir: str | os.PathLike | None) -> Path:
    """The folder of a psgd.train run's records: ``run_dir``, refused where it holds another run's, else a new
    ``runs/DATE-TIME-local``, as psgd launch makes its own, so that no two runs mix their files."""
    run = Path(run_dir) if run_dir else new_run_folder("local")
    claim(run, False, "local")
    return run


def _resolve(
    job: Any,
    model: Any,
    data: Any,
    model_options: Mapping[str, Any] | None,
    test: Any,
    settings: Mapping[str, Any] | None,
    keys: Mapping[str, Any],
) -> tuple[JobConfig, Any, Any]:
    """The job, the model object train takes beside it (None: the job file's), and the dataset (None: the job's)."""
    own_model = None
    if isinstance(model, str) or model is None:
        name = model
    elif isinstance(model, type):
        name, own_model = class_name(model), model
    elif all(callable(getattr(model, m, None)) for m in MODEL_METHODS):
        if model_options:
            raise ModelError("model_options= are for a model's class or name; this model is built already")
        name, own_model = class_name(type(model)), model
    else:
        raise ModelError(
            f"model: give a name, a model class or a model (with {', '.join(MODEL_METHODS)}), "
            f"not a {type(model).__name__}"
        )
    own = _own_data(data, test)
    dataset, data_name = (data, None) if own else (None, data)
    options = {f"model.{key}": value for key, value in (model_options or {}).items()}  # after the model's name
    config = job_config(job, model=name, data=data_name, settings={**options, **(settings or {})}, **keys)
    if dataset is not None:
        dataset = dataset_from(dataset, test, dtype=config.train.dtype)
        config = config.override("data.name", f"own:{dataset.name}")
    return config, own_model, dataset


def _own_data(data: Any, test: Any) -> bool:
    """Whether ``data`` is the caller's own (not a dataset's name); ``test`` goes only with one's own."""
    own = data is not None and not isinstance(data, str)
    if test is not None and not own:
        raise ConfigError("test=: give it with your own data; a dataset named by its name has its own split")
    return own


def _importable(obj: Any, what: str, load: Callable[[str], Any], error: type[Exception]) -> str:
    """``obj`` (the ``what``: a class or a function) as ``package.module:name``, checked to be what ``load`` gives
    a process started in this folder."""
    name = f"{obj.__module__}:{obj.__qualname__}"
    if obj.__module__ == "__main__":
        raise error(
            f"psgd.launch: {obj.__qualname__} is defined in the script being run (__main__), and the job's "
            f"processes import their {what} by name: put it in a module of its own beside the script and "
            "import it from there"
        )
    if "<locals>" in obj.__qualname__:
        raise error(
            f"psgd.launch: {obj.__qualname__} is defined inside a function, and the job's processes import "
            f"their {what} by name: define it at the top level of a module"
        )
    if load(name) is not obj:
        raise error(f"psgd.launch: {name} does not import as the {what} given")
    where = getattr(sys.modules[obj.__module__], "__file__", None)
    if where:
        depth = obj.__module__.count(".") + (Path(where).name == "__init__.py")
        root = Path(where).resolve().parents[depth]
        reach = [
            Path.cwd(),
            *(Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p),
            *(Path(p) for p in site.getsitepackages() + [site.getusersitepackages()]),
        ]
        if not any(root == r.resolve() for r in reach if r.exists()):
            raise error(
                f"psgd.launch: the job's processes start in {Path.cwd()} and import {name} by name, but its "
                f"module is in {root}: run from that folder, or add it to PYTHONPATH"
            )
    return name


def _written(data: Any, test: Any, run: Path, dtype: str) -> str:
    """Your data as ``RUN/data.npz`` (arrays only, no pickle), named as a job file names it."""
    dataset = dataset_from(data, test, dtype=dtype)
    if dataset.ids_train is not None:
        raise ConfigError(
            f"{dataset.name}: a dataset with categorical ids goes to psgd.launch as a file (npz) or a built-in name"
        )

    run.mkdir(parents=True, exist_ok=True)
    path = run / "data.npz"
    with open_own(path, "w", private=True, binary=True) as f:  # your data: yours alone to read
        np.savez(
            f,
            x_train=dataset.x_train,
            y_train=dataset.y_train,
            x_test=dataset.x_test,
            y_test=dataset.y_test,
            num_classes=np.int64(dataset.num_classes),
            target=np.array(dataset.target),
        )
    log.info("%s written to %s for the job's workers", dataset.describe(), path)
    return f"npz:{path.resolve()}"


def _history(run: Path, mode: str) -> list[dict[str, Any]]:
    """The evaluations the run's first worker (or rank 0) made, from its metrics lines."""
    path = run / ("worker-0.jsonl" if mode == "ps" else "allreduce.jsonl")
    keys = ("step", "epoch", "wall", "train_loss", "test_loss", "test_accuracy", "test_r2")
    return [
        {k: record[k] for k in keys if k in record}
        for record in read_records([path], 0.0)
        if record.get("event") == "eval"
    ]
