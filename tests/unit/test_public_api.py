"""psgd's public API, pinned: the names a network or a script imports (``psgd.PUBLIC_MODULES``' ``__all__``), every
command and the flags its help shows, and the moved names that still answer (psgd.moved), as recorded in
tests/unit/public_api.txt.  A rename or a removal fails here until the record is written again on purpose and
CHANGELOG.md says what changed: a decision, not an accident.

Write the record again: ``python tests/unit/test_public_api.py --write``."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

RECORD = Path(__file__).with_name("public_api.txt")
HEADER = (
    "# psgd's public API, compared by tests/unit/test_public_api.py. After a deliberate change, write it again\n"
    "# with `python tests/unit/test_public_api.py --write` and say in CHANGELOG.md what a user must change.\n"
)


def api() -> list[str]:
    """One line per public thing, sorted: ``name MODULE.NAME``, ``command COMMAND``, ``flag COMMAND FLAG``,
    ``moved OLD.NAME NEW.NAME``."""
    import psgd
    from psgd.cli import reference
    from psgd.moved import MOVED

    lines = [
        f"name {module}.{name}" for module in psgd.PUBLIC_MODULES for name in importlib.import_module(module).__all__
    ]
    for command, parser in reference.parsers():
        lines.append(f"command {command}")
        lines += [f"flag {command} {flag}" for flag in reference.flags(parser, hidden=False)]
    lines += [f"moved {old}.{name} {new}.{name}" for old, names in MOVED.items() for name, new in names.items()]
    return sorted(set(lines))


def difference(recorded: list[str], now: list[str]) -> str:
    """What a user would meet, in words: the lines gone and the lines new, and how to record them on purpose."""
    gone, new = sorted(set(recorded) - set(now)), sorted(set(now) - set(recorded))
    if not gone and not new:
        return ""
    return (
        "psgd's public API is not what tests/unit/public_api.txt records:\n"
        + "".join(f"  gone: {line}\n" for line in gone)
        + "".join(f"  new:  {line}\n" for line in new)
        + "A name or flag gone breaks users' code: keep the old one answering (a moved name: psgd/moved.py), "
        "or make the change on purpose: write the record again with `python tests/unit/test_public_api.py "
        "--write` and say in CHANGELOG.md what a user must change."
    )


def recorded() -> list[str]:
    return [line for line in RECORD.read_text(encoding="utf-8").splitlines() if line and not line.startswith("#")]


def test_the_public_api_is_as_recorded():
    message = difference(recorded(), api())
    assert not message, message


def test_a_rename_is_caught_and_said(monkeypatch):
    """The comparison can fail: a public name renamed, a flag dropped and a shim removed are each said."""
    import psgd.model
    from psgd.cli import reference

    monkeypatch.setattr(psgd.model, "__all__", [n if n != "Linear" else "Dense" for n in psgd.model.__all__])
    parsers = reference.parsers()
    monkeypatch.setattr(
        reference, "parsers", lambda: [(name, parser) for name, parser in parsers if name != "psgd report"]
    )
    monkeypatch.setitem(__import__("psgd.moved", fromlist=["MOVED"]).MOVED, "psgd.xp", {})
    message = difference(recorded(), api())
    assert "  gone: name psgd.model.Linear\n" in message and "  new:  name psgd.model.Dense\n" in message
    assert "  gone: command psgd report\n" in message and "  gone: flag psgd report --png\n" in message
    assert "  gone: moved psgd.xp.get_array_module psgd.model.get_array_module\n" in message
    assert message.endswith("say in CHANGELOG.md what a user must change.")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(f"usage: python {sys.argv[0]} --write  (writes {RECORD.name} from the code as it is now)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    RECORD.write_text(HEADER + "".join(f"{line}\n" for line in api()), encoding="utf-8")
    print(f"wrote {RECORD} ({len(api())} lines): say in CHANGELOG.md what a user must change")
