"""ProperDocs hooks (properdocs.yml ``hooks:``): the pages generated from the code at each build, so that they cannot
drift (every command's flags, every job-file key and the Python API, from :mod:`psgd.cli.reference`), and
benchmarks/RESULTS.md with the plots it shows and CHANGELOG.md, from where they live in the repository; and the
colors of highlighted code."""

from __future__ import annotations

import re
from pathlib import Path

from properdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent


def on_files(files, config):
    from psgd.cli import reference

    for uri, text in (
        ("reference/commands.md", reference.commands()),
        ("reference/keys.md", reference.job_file()),
        ("reference/python.md", reference.python_api()),
    ):
        files.append(File.generated(config, uri, content=text))
    changes = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    files.append(File.generated(config, "changelog.md", content=changes))
    files.append(File.generated(config, "css/pygments.css", content=highlighting()))
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    files.append(File.generated(config, "benchmarks/RESULTS.md", content=results))
    for image in sorted(set(re.findall(r"\]\((results/[^)]+\.png)\)", results))):
        files.append(File.generated(config, f"benchmarks/{image}", abs_src_path=str(ROOT / "benchmarks" / image)))
    return files


def highlighting() -> str:
    """The colors of the tokens Pygments marks in every code block as the site is built (pymdownx.highlight): the
    theme's own highlighter comes from a CDN, which properdocs.yml turns off."""
    from pygments.formatters import HtmlFormatter

    rules = HtmlFormatter(style="default").get_style_defs(".highlight").splitlines()
    return "".join(f"{rule}\n" for rule in rules if rule.startswith(".highlight"))  # not the theme's pre and lines
