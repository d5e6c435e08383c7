"""``psgd check-model``, and the documentation's example models: the code it shows is the code that passes.

The page's ``tanhnet.py`` (docs/howto/your-model.md: a network written as its forward pass) and ``tanhbyhand.py``
(the same network with its gradients by hand) are written into a temporary folder and used from there, as a user
would: checked (in process and as a real ``psgd`` process run from that folder) and trained.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from psgd.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {"tanhnet": ROOT / "tests" / "data" / "tanhnet.py", "tanhbyhand": ROOT / "tests" / "data" / "tanhbyhand.py"}
CHECKS = ["build", "specs", "init", "loss_and_grads", "gradients", "predict", "finite differences"]

BROKEN = """
from tanhbyhand import TanhMLPByHand


class NoB2(TanhMLPByHand):
    def loss_and_grads(self, params, x, y):
        loss, grads = super().loss_and_grads(params, x, y)
        del grads["b2"]
        return loss, grads


class Swapped(TanhMLPByHand):
    def loss_and_grads(self, params, x, y):
        loss, grads = super().loss_and_grads(params, x, y)
        return grads, loss
"""


PAGE = ROOT / "docs" / "howto" / "your-model.md"


def readme_model(name: str = "tanhnet") -> str:
    """The python block of the documentation's page on your own model that holds ``name``.py."""
    section = PAGE.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    (block,) = [b for b in blocks if b.startswith(f"# {name}.py")]
    return block


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A working folder holding the page's tanhnet.py (and broken.py), as the current folder."""
    for name in EXAMPLES:
        (tmp_path / f"{name}.py").write_text(readme_model(name))
    (tmp_path / "broken.py").write_text(BROKEN)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # sys.path is restored afterwards, whatever main() adds
    for name in (*EXAMPLES, "broken"):
        sys.modules.pop(name, None)
    yield tmp_path
    for name in (*EXAMPLES, "broken"):
        sys.modules.pop(name, None)


def run(capsys, *argv: str) -> tuple[int, list[str], str]:
    code = main(["check-model", *argv])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def test_readme_model_is_the_tested_file():
    for name, path in EXAMPLES.items():
        assert readme_model(name) == path.read_text(encoding="utf-8")
    readme = PAGE.read_text(encoding="utf-8")
    for command in (
        "psgd check-model tanhnet:TanhMLP",
        "psgd train --model tanhnet:TanhMLP",
        "psgd launch --model tanhnet:TanhMLP",
    ):
        assert command in readme
    for initializer in ("`zeros`", "`he_normal`", "`glorot_uniform`", "`normal` (std `scale`"):
        assert initializer in readme


@pytest.mark.parametrize("model", ["tanhnet:TanhMLP", "tanhbyhand:TanhMLPByHand"])
def test_readme_model_passes(folder, capsys, model):
    code, lines, err = run(capsys, model)
    assert code == 0, lines + [err]
    assert lines[0] == f"checking model {model} for digits: input (8, 8) float32, 10 classes, on cpu"
    assert [line.split(":")[0] for line in lines[1:-1]] == [f"ok   {c}" for c in CHECKS]
    assert "ok   specs: 4 variables, 4,810 parameters, float32" in lines
    assert re.match(
        r"ok   finite differences: 12 coordinates of 4 gradients agree with central differences in "
        r"float64 \(largest relative error \S+, tolerance 1e-04\)$",
        lines[-2],
    )
    assert re.match(r"all 7 checks passed in \d+\.\d\d s$", lines[-1])


def test_readme_model_trains(folder, capsys):
    """The forward-only network, as the page trains it (psgd train's defaults), reaches 95% on the digits."""
    code = main(["train", "--model", "tanhnet:TanhMLP", "--no-progress", "-q", "--json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["test_accuracy"] >= 0.95


def test_options_and_dtype_reach_the_model(folder, capsys):
    code, lines, _ = run(capsys, "tanhnet:TanhMLP", "--set", "model.width=16", "--dtype", "float64")
    assert code == 0, lines
    assert "ok   build: TanhMLP(input_shape=(8, 8), num_classes=10, dtype='float64', width=16)" in lines
    assert "ok   specs: 4 variables, 1,210 parameters, float64" in lines


def test_a_missing_gradient_fails_with_exit_status_2(folder, capsys):
    code, lines, _ = run(capsys, "broken:NoB2")
    assert code == 2
    assert (
        "FAIL gradients: no gradient for 'b2' (loss_and_grads must return one for every variable in specs(), "
        "zeros included)"
    ) in lines
    assert lines[-1] == ("1 of 7 checks failed (gradients); fix the first one first, the others may follow from it")
    assert lines[-2].startswith("ok   finite differences: 9 coordinates of 3 gradients agree")


def test_swapped_order_is_said_in_words(folder, capsys):
    code, lines, _ = run(capsys, "broken:Swapped")
    assert code == 2
    assert "FAIL loss_and_grads: returned (gradients, loss); it must return (loss, gradients), in that order" in lines
    assert "ok   gradients: one per variable, with its shape and dtype, all finite" in lines


def test_a_model_that_does_not_build(folder, capsys):
    code, lines, _ = run(capsys, "tanhnet:TanhMLP", "--set", "model.widht=3")
    assert code == 2
    assert lines[1:] == [
        "FAIL build: model 'tanhnet:TanhMLP': got an unexpected keyword argument 'widht' (options it takes: width)",
        "the model could not be built",
    ]
    code, lines, _ = run(capsys, "nosuchmodule:Net")
    assert code == 2 and lines[1].startswith("FAIL build: model 'nosuchmodule:Net': cannot import module")


def test_builtin_names_and_the_jobs_model(folder, capsys):
    for argv in (["cnn"], ["softmax", "--dtype", "float64"], []):
        code, lines, _ = run(capsys, *argv)
        assert code == 0, lines
    assert lines[0].startswith("checking model mlp for digits")  # no MODEL: the job's (the default mlp)
    code, _, err = run(capsys, "cnn", "--model", "mlp")
    assert code == 2 and "two models given" in err


def test_help_has_an_example(capsys):
    with pytest.raises(SystemExit) as info:
        main(["check-model", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "psgd check-model tanhnet:TanhMLP" in out and "finite differences" in out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "\n    check-model\n" in capsys.readouterr().out  # listed among the commands


def test_real_psgd_process_from_the_models_folder(tmp_path):
    """The console script, started in the folder holding tanhnet.py; no PYTHONPATH for that folder."""
    for name in EXAMPLES:
        (tmp_path / f"{name}.py").write_text(readme_model(name))
    (tmp_path / "broken.py").write_text(BROKEN)
    command = [shutil.which("psgd")] if shutil.which("psgd") else [sys.executable, "-m", "psgd.cli.main"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's psgd, whichever is installed
    good = subprocess.run(
        [*command, "check-model", "tanhnet:TanhMLP"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert good.returncode == 0, good.stdout + good.stderr
    assert "ok   gradients: one per variable" in good.stdout and "all 7 checks passed" in good.stdout
    bad = subprocess.run(
        [*command, "check-model", "broken:NoB2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "FAIL gradients: no gradient for 'b2'" in bad.stdout
