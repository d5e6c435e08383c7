"""psgd from Python (psgd.api): the job's settings from keywords, your own model and data in psgd.train, and what
psgd.launch refuses before it starts anything."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import psgd
from psgd.autodiff import ops
from psgd.config import ConfigError
from psgd.data import DataError, dataset_from
from psgd.model import Linear, Network
from psgd.model.errors import ModelError


class Blobs:
    """A map-style dataset: three clouds of points."""

    def __init__(self, n=300, seed=1):
        rng = np.random.default_rng(seed)
        self.y = rng.integers(0, 3, n)
        self.x = rng.normal(size=(n, 4)) + 3.0 * np.eye(3, 4)[self.y]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Small(Network):
    def __init__(self, input_shape, num_classes, dtype="float32", width=8):
        super().__init__(dtype)
        self.hidden = Linear(input_shape[0], width)
        self.out = Linear(width, num_classes)

    def forward(self, x):
        return self.out(ops.relu(self.hidden(x)))


def test_settings_are_the_job_files_keys_by_name():
    job = psgd.job_config(
        epochs=3,
        batch_size=16,
        workers=4,
        policy="ssp",
        staleness=2,
        lr=0.2,
        optimizer="sgd",
        settings={"tables.lr": 0.5},
    )
    assert (job.train.epochs, job.train.batch_size, job.cluster.workers, job.cluster.policy) == (3, 16, 4, "ssp")
    assert job.cluster.consistency.staleness == 2 and job.optimizer == {"name": "sgd", "lr": 0.2}
    assert job.tables.lr == 0.5
    with pytest.raises(ConfigError, match="unknown setting colour="):
        psgd.job_config(colour="red")
    with pytest.raises(ConfigError, match="epochs"):
        psgd.job_config(epochs=0)


def test_a_class_and_a_map_style_dataset_of_ones_own_train_in_this_process():
    heard = []
    result = psgd.train(
        Small, Blobs(), epochs=4, lr=0.1, dtype="float64", model_options={"width": 12}, on_step=heard.append
    )
    assert result.test_accuracy > 0.9
    assert [p["epoch"] for p in result.history] == [1, 2, 3, 4]
    assert result.weights["hidden/W"].shape == (4, 12) and result.weights["hidden/W"].dtype == np.float64
    assert len(heard) == result.steps == 4 * (240 // 32)


def test_a_model_built_already_and_arrays_with_a_test_split_of_their_own():
    train, held = Blobs(240, seed=2), Blobs(60, seed=3)
    net = Small((4,), 3, width=8)
    result = psgd.train(net, (train.x, train.y), test=(held.x, held.y), epochs=2)
    assert result.steps == 2 * (240 // 32)
    assert result.history[-1]["test_accuracy"] == result.test_accuracy
    same = psgd.train(Small, (train.x, train.y), test=(held.x, held.y), epochs=2)
    for name, w in same.weights.items():  # a class built here is the same network, from the same seed
        np.testing.assert_array_equal(w, result.weights[name])


def test_own_data_is_checked_with_a_line_that_names_it():
    class Broken(Blobs):
        def __getitem__(self, i):
            return self.x[i]

    with pytest.raises(DataError, match=r"Broken\[0\] must be a pair \(x, y\)"):
        dataset_from(Broken())
    with pytest.raises(DataError, match="300 inputs but 299 targets"):
        dataset_from((np.zeros((300, 4)), np.zeros(299)))
    with pytest.raises(DataError, match="num_classes=2, but a label is 2"):
        dataset_from(Blobs(), num_classes=2)


def test_launch_refuses_a_model_its_processes_could_not_import_before_it_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match="pass the class .* not an instance"):
        psgd.launch(Small((4,), 3), Blobs())

    def local():
        class Inside(Small):
            pass

        return Inside

    with pytest.raises(ModelError, match="defined inside a function"):
        psgd.launch(local(), Blobs())
    script = type("Script", (Small,), {"__module__": "__main__"})
    with pytest.raises(ModelError, match="defined in the script being run"):
        psgd.launch(script, Blobs())
    with pytest.raises(ModelError, match="add it to PYTHONPATH"):  # this test module: not under tmp_path
        psgd.launch(Small, Blobs())
    assert not (tmp_path / "runs").exists()


def test_the_reference_shows_every_public_name_from_its_docstring():
    import inspect

    from psgd.cli import reference

    page = reference.python_api()
    for name in psgd.PUBLIC:
        obj = getattr(psgd, name)
        assert f"## {name}\n" in page
        assert inspect.cleandoc(obj.__doc__).splitlines()[0].replace("``", "`").split(":")[0] in page
    for word in ("model_options", "settings", "on_step", "resume", "**keys"):
        assert word in page


def test_import_psgd_loads_the_api_only_when_it_is_used():
    import subprocess
    import sys

    code = (
        "import sys, psgd; before = 'psgd.api' in sys.modules or 'numpy' in sys.modules; "
        "psgd.train; print(before, 'psgd.api' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["False", "True"], done.stderr


def test_the_job_files_model_and_data_hold_unless_others_are_given(tmp_path):
    job = {"model": {"name": "softmax"}, "data": {"name": "synthetic", "n_train": 200, "n_test": 50}}
    config = psgd.job_config(job)
    assert (config.model["name"], config.data["name"]) == ("softmax", "synthetic")
    result = psgd.train(job=job, epochs=1)
    assert sorted(result.weights) == ["dense0/W", "dense0/b"] and result.steps == 200 // 32
    assert sorted(psgd.train("mlp", job=job, epochs=1, model_options={"hidden": [4]}).weights) == [
        "dense0/W",
        "dense0/b",
        "dense1/W",
        "dense1/b",
    ]


def flip(x, y, rng):
    """An augmentation: each example's features reversed, where a coin says so."""
    flips = rng.random(len(x)) < 0.5
    x = x.copy()
    x[flips] = x[flips, ::-1]
    return x, y


def test_an_augmentation_sees_every_training_batch_seeded_by_the_step(monkeypatch):
    seen = []

    def counted(x, y, rng):
        seen.append((x.shape, rng.bit_generator.state["state"]["state"]))  # (its seed, not a draw from it)
        return flip(x, y, rng)

    data = Blobs(300)
    runs = [psgd.train(Small, data, epochs=2, dtype="float64", augment=f) for f in (counted, flip, None)]
    assert len(seen) == runs[0].steps == 2 * (240 // 32) and {shape for shape, _ in seen} == {(32, 4)}
    assert len({draw for _, draw in seen}) == len(seen)  # a generator of its own for each step
    for name, w in runs[0].weights.items():  # the same step augmented the same way again
        np.testing.assert_array_equal(w, runs[1].weights[name])
    assert any(not np.array_equal(w, runs[2].weights[name]) for name, w in runs[0].weights.items())
    by_name = psgd.train(Small, data, epochs=2, dtype="float64", augment="test_api:flip")
    for name, w in runs[0].weights.items():
        np.testing.assert_array_equal(w, by_name.weights[name])
    with pytest.raises(DataError, match="must return \\(x, y\\) of the shapes it was given"):
        psgd.train(Small, data, epochs=1, augment=lambda x, y, rng: (x[:1], y))
    with pytest.raises(ConfigError, match="augment must name a function as package.module:function"):
        psgd.train(Small, data, epochs=1, augment="flip")


@pytest.mark.parametrize(
    "labels,words",
    [
        (lambda y: y + 3, "label 5 for a job of 3 classes"),  # trained to a NaN loss, and exit 0
        (lambda y: y - 3, "label -3 for a job of 3 classes"),
        (lambda y: y + 0.5, "labels of float64: class labels are integers"),
    ],
)
def test_labels_an_augmentation_returns_are_checked_as_the_datas_own_are(labels, words):
    with pytest.raises(DataError, match=f"augment .*returned {words}"):
        psgd.train(Small, Blobs(300), epochs=1, augment=lambda x, y, rng: (x, labels(y)))


def test_an_augmentation_whose_module_fails_to_import_is_one_error(tmp_path, monkeypatch):
    (tmp_path / "broken_augment.py").write_text(
        "raise RuntimeError('no GPU here')\n\ndef f(x, y, rng):\n    return x, y\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(DataError, match="augment 'broken_augment:f': importing it raised RuntimeError: no GPU here"):
        psgd.train(Small, Blobs(300), epochs=1, augment="broken_augment:f")


def test_an_iterable_factory_is_read_as_the_examples_it_yields():
    blobs = Blobs(300)

    def examples():
        for i in range(len(blobs)):
            yield blobs.x[i], blobs.y[i]

    from_factory, from_map = dataset_from(examples), dataset_from(blobs)
    assert from_factory.name == "examples" and from_factory.n_train == 240
    np.testing.assert_array_equal(from_factory.x_train, from_map.x_train)
    np.testing.assert_array_equal(from_factory.y_test, from_map.y_test)
    with pytest.raises(DataError, match="nothing: has no examples"):
        dataset_from(lambda: iter(()), name="nothing")


def test_a_run_stopped_halfway_and_resumed_ends_with_the_weights_of_one_never_stopped(tmp_path):
    import threading

    job = dict(epochs=4, dtype="float64", optimizer="adam", lr=0.01, model_options={"hidden": [8]})
    whole = psgd.train("mlp", Blobs(), **job)
    stop, kept = threading.Event(), tmp_path / "state.npz"
    halted = psgd.train(
        "mlp",
        Blobs(),
        **job,
        checkpoint=str(kept),
        stop=stop,
        on_step=lambda point: point["clock"] == 12 and stop.set(),
    )
    assert halted.checkpoint == str(kept) and halted.steps == 13 < whole.steps
    with np.load(kept, allow_pickle=False) as saved:
        assert int(saved["step"]) == 13
    resumed = psgd.train("mlp", Blobs(), **job, resume=str(kept))
    assert resumed.steps == whole.steps - 13 and resumed.checkpoint is None
    for name, w in whole.weights.items():
        np.testing.assert_array_equal(resumed.weights[name], w)  # bitwise
    with pytest.raises(ConfigError, match="it is the state of another job"):
        psgd.train("mlp", Blobs(), **{**job, "lr": 0.02}, resume=str(kept))


TAMPERED = {  # name: (what is done to the arrays, the words of the refusal)
    "one element for a weight": (
        lambda a: a.update({"w:dense0/W": np.array([0.5])}),
        "dense0/W has shape \\(1,\\), the model's is \\(4, 8\\)",
    ),
    "a NaN weight": (lambda a: a["w:dense1/b"].__setitem__(0, np.nan), "dense1/b holds NaN or infinite values"),
    "an infinite optimizer state": (
        lambda a: a[next(k for k in a if k.startswith("o:") and not k.endswith("::t"))].flat.__setitem__(0, np.inf),
        "holds NaN or infinite values",
    ),
    "a step past the run's": (lambda a: a.update(step=np.array(10**15)), "step 1000000000000000 is not in 0..28"),
    "a negative step": (lambda a: a.update(step=np.array(-1)), "step -1 is not in 0..28"),
    "a step that is no integer": (lambda a: a.update(step=np.array(1.5)), "step must be an integer"),
    "no step": (lambda a: a.pop("step"), "no step"),
    "a weight missing": (lambda a: a.pop("w:dense0/b"), "missing dense0/b"),
    "a weight of another dtype": (
        lambda a: a.update({"w:dense0/b": a["w:dense0/b"].astype(np.float32)}),
        "dense0/b is float32, the model's is float64",
    ),
    "an optimizer state of another shape": (
        lambda a: a.update({k: np.zeros(3) for k in a if k.startswith("o:") and not k.endswith("::t")}),
        "the optimizer's state",
    ),
}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_a_tampered_state_file_is_refused_before_anything_is_installed(tmp_path, case):
    """A state file kept under its job's name but changed: each change refused in one line naming the file (a
    1-element array was spread over every weight, NaNs and step 10^15 went in, a missing key was a KeyError)."""
    import threading

    from psgd.weights import save_weights

    job = dict(epochs=4, dtype="float64", optimizer="adam", lr=0.01, model_options={"hidden": [8]})
    stop, kept = threading.Event(), tmp_path / "state.npz"
    psgd.train(
        "mlp",
        Blobs(),
        **job,
        checkpoint=str(kept),
        stop=stop,
        on_step=lambda point: point["clock"] == 12 and stop.set(),
    )
    with np.load(kept, allow_pickle=False) as saved:
        arrays = {k: saved[k].copy() for k in saved.files}
    change, words = TAMPERED[case]
    change(arrays)
    save_weights(kept, arrays)
    with pytest.raises(ConfigError, match=f"^--resume {kept}: .*{words}"):
        psgd.train("mlp", Blobs(), **job, resume=str(kept))


def test_the_documentation_imports_only_what_is_public():
    """Every ``import psgd...`` and ``from psgd... import`` in the documentation's Python (the README, docs/, the
    examples the pages show) names a public module (``psgd.PUBLIC_MODULES``) and, from it, names its ``__all__``
    holds: what a user is shown to import is what psgd keeps stable."""
    import importlib
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    pages = [
        root / "README.md",
        *sorted((root / "docs").rglob("*.md")),
        *sorted((root / "tests" / "data").glob("*.py")),
    ]
    seen = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        blocks = [text] if page.suffix == ".py" else re.findall(r"```python\n(.*?)```", text, flags=re.S)
        for block in blocks:
            for module, names in re.findall(r"^\s*from (psgd[\w.]*) import ([\w, ]+)$", block, flags=re.M):
                assert module in psgd.PUBLIC_MODULES, f"{page.name}: from {module} import {names}"
                public = importlib.import_module(module).__all__
                assert all(n.strip() in public for n in names.split(",")), f"{page.name}: {module}: {names}"
                seen.append(module)
            for module in re.findall(r"^\s*import (psgd[\w.]*)", block, flags=re.M):
                assert module in psgd.PUBLIC_MODULES, f"{page.name}: import {module}"
                seen.append(module)
    assert {"psgd", "psgd.autodiff", "psgd.model", "psgd.model.losses"} <= set(seen)
    assert "## What is public" in __import__("psgd.cli.reference", fromlist=["x"]).python_api()


def test_each_psgd_train_keeps_its_csv_and_tensorboard_files_in_a_run_folder_of_its_own(tmp_path, monkeypatch, caplog):
    """The metrics lines go where ``metrics=`` says; their CSV and TensorBoard files go into the run's own folder
    (a new one under runs/, as psgd launch makes), never into the current folder, so two runs never mix."""
    monkeypatch.chdir(tmp_path)
    caplog.set_level("INFO", logger="psgd")
    runs = [psgd.train("softmax", "digits", epochs=1, metrics="train_one.jsonl", progress=False) for _ in range(2)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", "train_one.jsonl"]
    folders = [Path(r.run_dir) for r in runs]
    assert folders[0] != folders[1] and all(f.parent == Path("runs") and "-local" in f.name for f in folders)
    for folder in folders:
        assert (folder / "train_one.csv").is_file()
        assert len(list((folder / "tensorboard" / "local").iterdir())) == 1  # one event file: this run's
    assert f"in {folders[1]}" in caplog.records[-1].getMessage()  # the last line names the folder
    given = psgd.train("softmax", "digits", epochs=1, run_dir="mine", progress=False)  # a run folder, as launch's
    assert given.run_dir == "mine" and {"local.jsonl", "local.csv", "tensorboard"} <= set(os.listdir("mine"))


def test_a_stopped_launch_is_a_keyboard_interrupt_psgd_exports():
    """Ctrl-C under psgd.launch raised the launcher's own RuntimeError, which psgd did not export."""
    assert issubclass(psgd.LaunchInterrupted, KeyboardInterrupt) and issubclass(psgd.LaunchInterrupted, psgd.PsgdError)
    assert "LaunchInterrupted" in dir(psgd)
