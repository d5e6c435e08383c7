"""The documentation's Python examples (docs/howto/python.md) run as a user runs them: ``python train_blobs.py``
trains a network and a dataset class of its own in the script's process; ``python launch_blobs.py`` launches shards
and workers on a class they import by name, with the script's arrays handed to them as a file."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "howto" / "python.md"


def page_files(folder: Path) -> None:
    """Each ``# NAME.py`` block of the page, written to ``folder`` as that file."""
    for block in re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), flags=re.S):
        name = re.match(r"# (\w+\.py):", block)
        if name:
            (folder / name.group(1)).write_text(block)


def run(script: str, folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, script], cwd=folder, capture_output=True, text=True, timeout=300)


def test_the_page_runs_each_command_it_shows():
    commands = re.findall(r"^python (\S+)$", PAGE.read_text(encoding="utf-8"), flags=re.M)
    assert commands == ["train_blobs.py", "launch_blobs.py"]


def test_a_network_and_a_dataset_class_of_ones_own_train_from_a_script(tmp_path):
    page_files(tmp_path)
    done = run("train_blobs.py", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    accuracy = float(re.search(r"^test accuracy ([\d.]+) after (\d+) steps$", done.stdout, re.M).group(1))
    assert accuracy > 0.9, done.stdout
    assert len(re.findall(r"^  epoch \d+: test accuracy", done.stdout, re.M)) == 5
    assert "hidden/W (4, 16)" in done.stdout and "out/b (3,)" in done.stdout


def test_launch_from_a_script_hands_the_workers_its_class_by_name_and_its_arrays_as_a_file(tmp_path):
    page_files(tmp_path)
    done = run("launch_blobs.py", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    said = re.search(r"^test accuracy ([\d.]+); run folder (\S+)$", done.stdout, re.M)
    assert float(said.group(1)) > 0.8, done.stdout
    folder = tmp_path / said.group(2)
    with np.load(folder / "data.npz", allow_pickle=False) as data:
        assert sorted(data.files) == ["num_classes", "x_test", "x_train", "y_test", "y_train"]
        assert len(data["x_train"]) + len(data["x_test"]) == 900
    with np.load(folder / "final.npz", allow_pickle=False) as weights:
        assert weights["hidden/W"].shape == (4, 16)
    assert 'name = "nets:TwoLayers"' in (folder / "job.toml").read_text()
