"""The tree passes ruff's lint and is as ruff formats it ([tool.ruff] in pyproject.toml): unused imports, undefined
names and import order are found here, not by a reader."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_tree_passes_the_linter():
    done = ruff("check", "--no-cache", "--output-format", "concise", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_tree_is_as_the_formatter_writes_it():
    done = ruff("format", "--no-cache", "--check", ".")
    assert done.returncode == 0, f"{done.stdout}{done.stderr}run `ruff format .` to write these as ruff does"


def test_the_linter_finds_an_unused_import_and_an_undefined_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f():\n    return undefined_name\n")
    done = ruff("check", "--no-cache", "--isolated", "--select", "F", "--output-format", "concise", str(bad))
    assert done.returncode == 1 and "F401" in done.stdout and "F821" in done.stdout, done.stdout
