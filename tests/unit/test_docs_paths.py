"""Every path of the project that a page names in backquotes (``psgd/...``, ``tests/...``, ``benchmarks/...``) is
there: a module that moved takes the pages that name it along."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md"])


def named_paths(text: str) -> list[str]:
    """The project paths a Markdown page names in backquotes (globs left out)."""
    return [p for p in re.findall(r"`((?:psgd|tests|benchmarks)/[A-Za-z0-9_./-]*)`", text) if "*" not in p]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_page_names_is_there(page):
    missing = [p for p in named_paths(page.read_text(encoding="utf-8")) if not (ROOT / p.rstrip("/")).exists()]
    assert missing == [], f"{page.relative_to(ROOT)} names what is not there: {missing}"


def test_the_paths_are_found_in_backquotes_only():
    assert named_paths("see `psgd/server/state/core.py` and psgd/x.py, `tests/unit/`, `psgd/*.py`") == [
        "psgd/server/state/core.py",
        "tests/unit/",
    ]
