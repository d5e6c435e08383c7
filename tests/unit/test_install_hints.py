"""Every message and page says how to install one of psgd's extras the one way: from psgd's folder, editable, held
to the tested versions (``python3 -m pip install -c requirements.lock -e ".[mpi]"``), as the README installs it.
``psgd report`` said ``pip install -e ".[bench]"``, MPI's hint ``pip install 'psgd[mpi]'`` (psgd is not on a
package index); and a page that shows ``tensorboard --logdir`` says how to install TensorBoard."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from psgd.errors import install_extra

ROOT = Path(__file__).resolve().parents[2]
#: what a user reads: psgd's code (its messages and help), its pages, the benchmarks' results page
READ = sorted(
    [
        *(ROOT / "psgd").rglob("*.py"),
        *(ROOT / "psgd").rglob("*.md"),
        *(ROOT / "docs").rglob("*.md"),
        ROOT / "README.md",
        ROOT / "benchmarks" / "RESULTS.md",
        ROOT / "pyproject.toml",
    ]
)
#: an install of an extra of psgd's: psgd[...] or .[...]
EXTRA = re.compile(r"pip install\b[^\n`]*?['\"]?(?:psgd|\.)\[")
ONE_WAY = re.compile(r'python3 -m pip install (?:-q )?-c requirements\.lock -e "\.\[')


def test_one_way_is_the_readmes():
    assert install_extra("mpi") == 'python3 -m pip install -c requirements.lock -e ".[mpi]"'
    assert install_extra("mpi") in (ROOT / "docs" / "getting-started.md").read_text().replace("[all]", "[mpi]")


@pytest.mark.parametrize("path", READ, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_hint_installs_an_extra_the_one_way(path):
    text = path.read_text(encoding="utf-8")
    other = [
        text[m.start() - 30 : m.end() + 10]
        for m in EXTRA.finditer(text)
        if not ONE_WAY.match(text, m.start() - len("python3 -m "))
    ]
    assert other == [], f"say {install_extra('EXTRA')!r} (psgd.errors.install_extra): {other}"


def test_the_messages_say_it():
    from psgd.cli import report
    from psgd.collective.mpi import INSTALL_HINT

    assert install_extra("mpi") in INSTALL_HINT
    assert install_extra("bench") in report.DESCRIPTION.replace("\n", " ")


def test_a_page_that_shows_tensorboard_says_how_to_install_it():
    pages = [p for p in (ROOT / "docs").rglob("*.md") if "tensorboard --logdir" in p.read_text(encoding="utf-8")]
    assert pages
    for page in pages:
        assert "python3 -m pip install -c requirements.lock tensorboard" in page.read_text(encoding="utf-8"), page
