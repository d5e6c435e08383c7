"""The documentation (properdocs.yml, docs/, README.md): the site builds strictly (a broken link or a missing page
fails it), its generated reference names every flag of every command and every job-file key, every shell example
uses commands and flags that exist, and the examples marked as runnable on one CPU machine run."""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from psgd.cli import reference
from psgd.config import ClusterConfig

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: put on the line before a ```bash block whose every command runs on one CPU machine in a few seconds
RUNNABLE = "<!-- runnable: one CPU machine -->"
TOOLS = dict(reference.TOOLS)  # the command-line tools, and the module each runs


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once strictly: what the build said, and its folder."""
    folder = tmp_path_factory.mktemp("site") / "site"
    done = subprocess.run(
        [sys.executable, "-m", "properdocs", "build", "--strict", "--site-dir", str(folder)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout + done.stderr, folder


@pytest.mark.slow
def test_the_site_builds_strictly(site):
    said, folder = site  # a build says what it did, and no banner (a theme's end of life, say)
    assert "end of life" not in said.lower() and "│" not in said, said
    for page in (
        "index.html",
        "reference/commands/index.html",
        "reference/keys/index.html",
        "benchmarks/RESULTS/index.html",
        "benchmarks/results/simulate/efficiency.png",
        "changelog/index.html",
    ):
        assert (folder / page).exists(), page


@pytest.mark.slow
def test_code_is_highlighted_offline(site):
    """Every code block is highlighted by Pygments when the site is built, and colored by a stylesheet of the site's
    own: the theme's highlighter comes from a CDN, which the build turns off, and the tokens had no colors."""
    _, folder = site
    page = (folder / "howto" / "your-model" / "index.html").read_text(encoding="utf-8")
    assert re.search(
        r'<div class="highlight"><pre>(<span></span>)?<code>\s*<span class="c1">#[^<]*</span>\s*'
        r'<span class="kn">import</span>',
        page,
    ), "your-model's first block is not highlighted"
    sheets = [
        re.search(r'href="([^"]+)"', link).group(1)
        for link in re.findall(r"<link\b[^>]*>", page)
        if 'rel="stylesheet"' in link
    ]
    rules = "".join(
        (folder / "howto" / "your-model" / href).resolve().read_text(encoding="utf-8")
        for href in sheets
        if not re.match(r"(\w+:)?//", href)
    )
    for token in ("kn", "c1", "s2", "nb"):  # a keyword, a comment, a string, a builtin: each its color
        assert re.search(rf"\.highlight \.{token} \{{[^}}]*color: #[0-9A-Fa-f]{{3,6}}", rules), token
    for html in sorted(folder.rglob("*.html")):  # nothing of a page comes from another host
        fetched = re.findall(
            r'<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)="((?:\w+:)?//[^"]*)"', html.read_text(encoding="utf-8")
        )
        assert fetched == [], f"{html.relative_to(folder)}: {fetched}"


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## `([^`]+)`$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_the_reference_names_every_flag_of_every_command():
    pages = _sections(reference.commands())
    for name, parser in reference.parsers():
        assert name in pages, f"{name} has no section"
        missing = [f for f in reference.flags(parser, hidden=False) if f"`{f}" not in pages[name]]
        assert missing == [], f"{name}: {missing}"
    helped = subprocess.run(
        [sys.executable, "-m", "psgd.cli.main", "launch", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    flags = set(re.findall(r"^  (?:-\w[ \w.,]*?, )?(--[a-z][a-z0-9-]*)", helped, flags=re.M))  # its option lines
    assert len(flags) > 20 and [f for f in sorted(flags) if f"`{f}" not in pages["psgd launch"]] == []


def test_the_reference_names_every_job_file_key_with_its_meaning():
    pages = _sections(reference.job_file())
    for section, cls in reference.sections():  # [cluster]: every key a job file writes there, its parts' included
        keys = ClusterConfig().keys() if cls is ClusterConfig else [f.name for f in dataclasses.fields(cls)]
        for key in keys:
            row = re.search(rf"^\| `{key}` \| .* \| (.*) \|$", pages[f"[{section}]"], flags=re.M)
            assert row and row.group(1).strip(), f"[{section}] {key}: no row, or no meaning"


def examples() -> list[tuple[str, bool, list[str]]]:
    """(where, runnable, argv) of every psgd command in the pages' bash blocks: continuation lines joined,
    comments, variable assignments and sudo dropped, commands split at && ; and |."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in re.finditer(r"(?:^([^\n]*)\n)?^[ \t]*```bash\n(.*?)^[ \t]*```", text, flags=re.M | re.S):
            runnable = (match.group(1) or "").strip() == RUNNABLE
            block = re.sub(r"\\\n\s*", " ", match.group(2))
            for number, line in enumerate(block.splitlines()):
                try:
                    tokens = shlex.split(line, comments=True)
                except ValueError:
                    continue
                command: list[str] = []
                for token in tokens + [";"]:
                    if token in ("&&", ";", "|", "||", "&"):
                        while command and (re.match(r"^\w+=", command[0]) or command[0] == "sudo"):
                            command.pop(0)
                        if command and command[0] in TOOLS:
                            found.append((f"{page.relative_to(ROOT)}: {line.strip()}", runnable, command))
                        command = []
                    else:
                        command.append(token.rstrip(";"))
    return found


def _parser(argv: list[str]):
    """The parser of the longest (sub)command ``argv`` starts with, and the arguments after it."""
    parsers = dict(reference.parsers())
    words = [argv[0]]
    for token in argv[1:]:
        if token.startswith("-") or " ".join(words + [token]) not in parsers:
            break
        words.append(token)
    return " ".join(words), parsers[" ".join(words)], argv[len(words) :]


def test_every_example_uses_flags_that_exist():
    commands = examples()
    assert len(commands) > 30
    wrong = []
    for where, _, argv in commands:
        name, parser, rest = _parser(argv)
        known = set(reference.flags(parser))
        for token in rest:
            if token == "--":
                break
            if token.startswith("-") and not re.fullmatch(r"-\d.*", token) and token.split("=")[0] not in known:
                wrong.append(f"{where}: {name} has no {token.split('=')[0]}")
    assert wrong == [], "\n".join(wrong)


#: the characters of a code block's line that the theme shows without scrolling at 1280 px (its theme.css): the
#: content column is 800 px wide, less 52 px of padding either side and the block's own 12 px, and a character of
#: its 12 px monospace font takes about 7.2 px: 93, less a margin
FITS = 90


def test_getting_starteds_commands_fit_without_scrolling():
    """At 1280 px the install-and-run line of Getting started (README's, which the page includes) ran past the
    theme's column, and its ``&& psgd launch`` hid behind a scrollbar."""
    page = (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in re.findall(r'^--8<-- "README\.md:([\w-]+)"$', page, flags=re.M):  # what the page includes
        page += readme.split(f"[start:{name}]")[1].split(f"[end:{name}]")[0]
    lines = [
        line for block in re.findall(r"^```bash\n(.*?)^```", page, flags=re.M | re.S) for line in block.splitlines()
    ]
    assert len(lines) >= 3 and [line for line in lines if len(line) > FITS] == []


def test_every_page_installs_psgd_the_same_way():
    """Editable from its folder, the extras added to it: a page that installed "." after one that installed "-e ."
    swapped the install under the other (the README's, the docs', the lab's and the GPU page's lines each did)."""
    lines = [
        (page.relative_to(ROOT), line)
        for page in [*PAGES, ROOT / ".ci" / "run"]
        for line in page.read_text().splitlines()
        if re.search(r"pip install\b.*\s['\"]?\.(\[|['\"\s]|$)", line)
    ]
    assert len(lines) >= 6
    assert [(where, line) for where, line in lines if not re.search(r"\s-e\s+['\"]?\.", line)] == []
    extras = __import__("tomllib").loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["all"] == ["psgd[bench,docs,mnist,mpi]"]


def _shape(line: str) -> str:
    """A line of output with its numbers and run folders masked: what a page's sample of it must keep."""
    return re.sub(r"\d+(\.\d+)?", "N", re.sub(r"runs/[\w-]+", "RUN", line))


@pytest.mark.slow
def test_the_runnable_examples_run(tmp_path):
    """Each runs; and the final line a page shows as its sample output is the one its commands print (numbers and
    the run folder aside): getting-started's had drifted from what psgd launch prints."""
    runnable = [(where, argv) for where, runs, argv in examples() if runs]
    assert len(runnable) >= 3
    printed: dict[str, set[str]] = {}
    for where, argv in runnable:
        done = subprocess.run(
            [sys.executable, "-m", TOOLS[argv[0]], *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=240
        )
        assert done.returncode == 0, f"{where}: exit {done.returncode}\n{done.stderr[-2000:]}"
        printed.setdefault(where.split(": ")[0], set()).update(map(_shape, done.stdout.splitlines()))
    samples = 0
    for page, lines in printed.items():
        blocks = re.findall(r"^```text\n(.*?)^```", (ROOT / page).read_text(encoding="utf-8"), flags=re.M | re.S)
        for sample in [line for block in blocks for line in block.splitlines() if line.startswith("final ")]:
            samples += 1
            assert _shape(sample) in lines, f"{page} shows {sample!r}; its commands print {sorted(lines)}"
    assert samples >= 1
