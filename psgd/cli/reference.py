"""The reference pages of the documentation, generated from what the code defines, so that they cannot drift:
every command's flags from its argparse parser (:func:`commands`), every job-file key with its default, what it
may be and the comment it is defined with in :mod:`psgd.config` (:func:`job_file`).  ``docs/hooks.py`` writes them
into the site at build time; the tests check that every flag and key is there."""

from __future__ import annotations

import argparse
import dataclasses
import io
import tokenize
from pathlib import Path
from typing import Any

import psgd
from psgd.config import PARTS, JobConfig

#: the command-line tools and where their parsers are built
TOOLS = (("psgd", "psgd.cli.main"), ("psgd-server", "psgd.cli.server"), ("psgd-worker", "psgd.cli.worker"))


def parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """(command, parser) of every command and subcommand, depth first: ``psgd``, ``psgd launch``, ``psgd bench
    simulate`` ... ``psgd-server``, ``psgd-worker``."""
    import importlib

    out = []

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        out.append((name, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    walk(f"{name} {sub}", child)

    for name, module in TOOLS:
        walk(name, importlib.import_module(module).build_parser())
    return out


def flags(parser: argparse.ArgumentParser, hidden: bool = True) -> list[str]:
    """Every option string of ``parser`` (not of its subcommands); ``hidden``: those its help leaves out too."""
    return [s for a in parser._actions for s in a.option_strings if hidden or a.help != argparse.SUPPRESS]


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%(" in text:
        text = text % {**vars(action), "prog": ""}
    return text


def commands() -> str:
    """Markdown: each command's usage, description and a table of its flags."""
    out = [
        "# Commands",
        "",
        "Generated from the commands' own parsers each time the documentation is built: what "
        "`--help` says, every flag.",
        "",
    ]
    for name, parser in parsers():
        out += [f"## `{name}`", "", "```text", parser.format_usage().strip(), "```", ""]
        if parser.description:
            out += ["```text", parser.description.strip(), "```", ""]
        rows = [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS]
        if rows:
            out += ["| flag | what it does |", "|---|---|"]
            for a in rows:
                names = ", ".join(
                    f"`{s}{' ' + a.metavar if isinstance(a.metavar, str) else ''}`" for s in a.option_strings
                )
                out.append(f"| {names} | {_cell(_help(a))} |")
            out.append("")
        positional = [
            a
            for a in parser._actions
            if not a.option_strings
            and a.help not in (None, argparse.SUPPRESS)
            and not isinstance(a, argparse._SubParsersAction)
        ]
        if positional:
            out += ["| argument | what it is |", "|---|---|"]
            out += [f"| `{a.metavar or a.dest}` | {_cell(_help(a))} |" for a in positional]
            out.append("")
    return "\n".join(out) + "\n"


def _comments() -> dict[str, dict[str, str]]:
    """{dataclass name: {field: its comment}} from psgd/config/'s source (a comment after the field and the
    comment lines that continue it)."""
    folder = Path(__file__).parent.parent / "config"
    source = "\n".join(path.read_text(encoding="utf-8") for path in sorted(folder.glob("*.py")))
    found: dict[str, dict[str, str]] = {}
    cls, last = None, None
    for line in source.splitlines():
        if line.startswith("class "):
            cls, last = line[6:].split("(")[0].split(":")[0].strip(), None
            found[cls] = {}
            continue
        stripped = line.strip()
        if cls is None or not line.startswith("    ") or line.startswith("        "):
            continue
        if stripped.startswith("#") and last is not None:
            found[cls][last] += " " + stripped.lstrip("#").strip()
            continue
        if ":" in stripped and not stripped.startswith(("def ", "@", "\"", "#", "return")):
            name = stripped.split(":")[0].strip()
            if name.isidentifier():
                tokens = list(tokenize.generate_tokens(io.StringIO(line + "\n").readline))
                comment = next((t.string for t in tokens if t.type == tokenize.COMMENT), "")
                found[cls][name] = comment.lstrip("#").strip()
                last = name
                continue
        last = None if not stripped.startswith("#") else last
    return found


def sections() -> list[tuple[str, type]]:
    """(section, dataclass) of every job-file section with fixed keys."""
    job = JobConfig()
    return [
        (name, type(getattr(job, name))) for name in JobConfig.SECTIONS if dataclasses.is_dataclass(getattr(job, name))
    ]


def _rows(cls: type, values: Any, comments: dict[str, dict[str, str]], skip: Any = ()) -> list[str]:
    """A table of ``cls``'s keys (but those in ``skip``): each key, its value in ``values``, what it may be (the rule
    its field is made with, which refuses any other value) and its comment."""
    out = ["| key | default | may be | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.name not in skip:
            rule = f.metadata.get("rule")
            may = rule.words.removeprefix("must be ").removeprefix("must ") if rule else ""
            out.append(
                f"| `{f.name}` | `{getattr(values, f.name)!r}` | {_cell(may)} | "
                f"{_cell(comments.get(cls.__name__, {}).get(f.name, ''))} |"
            )
    return out + [""]


def _parts(cluster: Any, comments: dict[str, dict[str, str]]) -> list[str]:
    """``[cluster]``'s keys that belong to a part (written flat in the file all the same), a table for each part."""
    out = []
    for part, cls in PARTS.items():
        out += [
            f"### {part.capitalize()}",
            "",
            _cell(f"{cls.__doc__} Written under `[cluster]` like the keys above; in psgd, `ClusterConfig.{part}`."),
            "",
        ]
        out += _rows(cls, getattr(cluster, part), comments)
    return out


def job_file() -> str:
    """Markdown: every key of every section with fixed keys, its default, what it may be and its meaning."""
    comments = _comments()
    out = [
        "# Job-file keys",
        "",
        "Generated from `psgd/config/` each time the documentation is built: every key, "
        "its default, what it may be (any other value is refused) and what it means. `[model]`, `[data]` and "
        "`[optimizer]` take a `name` and that choice's own options (see the how-to pages); every key can also be "
        "set with `--set SECTION.KEY=VALUE`.",
        "",
    ]
    defaults = JobConfig()
    for section, cls in sections():
        out += [f"## `[{section}]`", ""]
        if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):  # not the dataclass's own
            out += [_cell(cls.__doc__), ""]
        out += _rows(cls, getattr(defaults, section), comments, skip=PARTS if section == "cluster" else ())
        if section == "cluster":
            out += _parts(defaults.cluster, comments)
    for section in JobConfig.SECTIONS:
        if not dataclasses.is_dataclass(getattr(defaults, section)):
            out += [f"## `[{section}]`", "", f"Default: `{getattr(defaults, section)!r}`.", ""]
    return "\n".join(out) + "\n"


def python_api() -> str:
    """The reference of psgd's Python API: each public name (``psgd.PUBLIC``) with its signature and docstring."""
    import inspect
    import re

    out = [
        "# The Python API",
        "",
        "Generated from the code's docstrings. Each name is `psgd.NAME`; "
        "[psgd from Python](../howto/python.md) shows them at work.",
        "",
    ]
    for name in psgd.PUBLIC:
        obj = getattr(psgd, name)
        fields: list[str] = []
        if inspect.isclass(obj):
            head = f"class {name}"
            if dataclasses.is_dataclass(obj):
                fields = [f"- `{f.name}`: `{_annotation(f.type)}`" for f in dataclasses.fields(obj)]
        else:
            head = f"{name}(\n" + "".join(f"    {p},\n" for p in _parameters(obj)) + ")"
        doc = inspect.cleandoc(obj.__doc__ or "").replace("``", "`")
        doc = re.sub(r":(?:class|func|mod|meth|attr):`~?([^`]+)`", r"`\1`", doc)
        out += [f"## {name}", "", "```python", head, "```", "", doc, ""]
        if fields:
            out += ["Fields:", "", *fields, ""]
    modules = ", ".join(f"`{m}`" for m in psgd.PUBLIC_MODULES[1:])
    out += [
        "## What is public",
        "",
        "The names above and the modules a network is written with, "
        + modules
        + " (each module's `__all__`), are psgd's public API: they keep their names and their meaning from one "
        "release to the next, and a change to one is announced first, in the [changelog](../changelog.md). "
        "Every other module of psgd is its own and may change without notice.",
        "",
    ]
    return "\n".join(out)


def _parameters(function: Any) -> list[str]:
    """Each parameter of ``function`` as its signature writes it, with ``*`` before the keyword-only ones."""
    import inspect

    out, starred = [], False
    for p in inspect.signature(function).parameters.values():
        if p.kind == p.KEYWORD_ONLY and not starred:
            out.append("*")
        starred = starred or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL, p.VAR_KEYWORD)
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {p.default!r}"
        out.append(text)
    return out


def _annotation(kind: Any) -> str:
    return kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
