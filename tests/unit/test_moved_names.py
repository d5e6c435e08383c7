"""Names the documentation once showed users and psgd has since moved keep working for a while: each answers from
its new home with a DeprecationWarning that names that home (psgd.moved.MOVED), and CHANGELOG.md lists it."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import psgd.model

ROOT = Path(__file__).resolve().parents[2]
#: what pages of psgd's documentation showed, before the names moved (docs/howto/your-model.md)
SHOWN = {"psgd.xp": "get_array_module", "psgd.compute.xp": "get_array_module"}


def _fresh(module: str):
    """``module`` imported anew, so that its first use of a name warns again."""
    sys.modules.pop(module, None)
    return importlib.import_module(module)


@pytest.mark.parametrize("module", sorted(SHOWN))
def test_an_old_name_answers_from_its_new_home_and_says_where(module):
    _fresh(module)
    with pytest.warns(
        DeprecationWarning,
        match=rf"^{re.escape(module)}\.get_array_module has moved: import it "
        r"from psgd\.model",
    ) as said:
        exec(f"from {module} import {SHOWN[module]} as found", {}, scope := {})
    assert scope["found"] is psgd.model.get_array_module
    assert [w.filename for w in said] == ["<string>"]  # the warning points at the line that imported it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(f"from {module} import {SHOWN[module]}", {})  # once per name: no second warning


def test_an_old_module_has_no_other_names():
    with pytest.raises(AttributeError, match=r"psgd\.xp has no attribute 'to_host'.*psgd\.model"):
        _fresh("psgd.xp").to_host  # noqa: B018


def test_a_model_written_for_the_old_name_loads_and_its_user_is_told(tmp_path):
    """A network's module importing ``psgd.xp``, as the pages once showed, is loaded by name as a job's processes
    load it (it was: cannot import module ... No module named 'psgd.xp'), and the warning reaches stderr, where
    Python's own filters hide a DeprecationWarning raised outside ``__main__``."""
    (tmp_path / "oldnet.py").write_text(
        textwrap.dedent("""
        from psgd.xp import get_array_module
        from psgd.model import MLP

        class OldNet(MLP):
            pass
    """)
    )
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from psgd.model import load_model_class\nprint(load_model_class('oldnet:OldNet').__name__)",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout == "OldNet\n", done.stderr
    assert re.search(
        r"oldnet\.py:2: DeprecationWarning: psgd\.xp\.get_array_module has moved: import it from "
        r"psgd\.model",
        done.stderr,
    ), done.stderr


def test_the_changelog_lists_every_moved_name():
    from psgd.moved import MOVED

    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    listed = re.findall(r"^\| `([\w.]+)` \| `([\w.]+)` \|", text, flags=re.M)
    assert sorted(listed) == sorted(
        (f"{old}.{name}", f"{new}.{name}") for old, names in MOVED.items() for name, new in names.items()
    )
    assert {old for old in MOVED} >= set(SHOWN)
