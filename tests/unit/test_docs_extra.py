"""The docs extra installs what the site's build imports: every third-party module docs/hooks.py imports, and
every Markdown extension, theme and plugin properdocs.yml names, comes with pyproject.toml's ``docs`` extra (its
requirements and theirs).  ``pip install -e ".[docs]" && properdocs build --strict`` on a fresh clone failed
on docs/hooks.py's ``import pygments``, which the dev extra brought in only through pytest."""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]


def docs_extra() -> set[str]:
    """The distributions ``pip install -e ".[docs]"`` installs: the extra's requirements and all of theirs (as
    installed here), extras of theirs left out as pip leaves them."""
    wanted = [
        Requirement(r)
        for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["docs"]
    ]
    found: set[str] = set()
    while wanted:
        req = wanted.pop()
        name = canonicalize_name(req.name)
        if name in found or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        found.add(name)
        wanted += [Requirement(r) for r in metadata.requires(req.name) or ()]
    return found


def hooks_imports() -> set[str]:
    """The top-level modules docs/hooks.py imports, at any depth, other than Python's own and psgd."""
    tree = ast.parse((REPO / "docs" / "hooks.py").read_text(encoding="utf-8"))
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
    return {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"psgd", "__future__"}


def site_needs() -> dict[str, str]:
    """What properdocs.yml names, by what provides it: a module, or a theme's or plugin's entry point."""
    site = yaml.safe_load((REPO / "properdocs.yml").read_text(encoding="utf-8"))
    needs = {
        "theme " + site["theme"]["name"]: "properdocs.themes",
        **{f"plugin {p}": "properdocs.plugins" for p in site.get("plugins", ())},
    }
    for entry in site["markdown_extensions"]:
        name, options = next(iter(entry.items())) if isinstance(entry, dict) else (entry, None)
        needs[f"extension {name}"] = name.split(".")[0] if "." in name else "markdown"  # Markdown's own: bare names
        if (options or {}).get("use_pygments"):
            needs[f"extension {name} (use_pygments)"] = "pygments"
    return needs


def providers(need: str) -> set[str]:
    """The distributions that provide the top-level module ``need``."""
    return {canonicalize_name(d) for d in metadata.packages_distributions().get(need, ())}


def test_every_module_the_hooks_import_comes_with_the_docs_extra():
    installed = docs_extra()
    missing = {m: sorted(providers(m)) for m in hooks_imports() if not providers(m) & installed}
    assert missing == {}, f"docs/hooks.py imports these, which the docs extra does not install: {missing}"


def test_every_extension_theme_and_plugin_comes_with_the_docs_extra():
    installed = docs_extra()
    missing = []
    for what, need in site_needs().items():
        if need.startswith("properdocs."):
            given = {
                canonicalize_name(e.dist.name) for e in metadata.entry_points(group=need) if e.name == what.split()[1]
            }
        else:
            given = providers(need)
        if not given & installed:
            missing.append(f"{what}: {need} ({', '.join(sorted(given)) or 'not installed'})")
    assert missing == [], f"properdocs.yml needs these, which the docs extra does not install: {missing}"


def test_the_closure_sees_an_import_the_extra_lacks():
    assert {"properdocs", "markdown", "pymdown-extensions"} <= docs_extra()
    assert "pytest" not in docs_extra() and providers("_pytest") == {"pytest"}
