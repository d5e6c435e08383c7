"""The documentation reads in short sentences: no sentence of a page's prose (code, tables and headings aside) runs
past 40 words.  The pages had sentences of up to 88 words, with asides nested in asides."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
LONGEST = 40


def sentences(text: str) -> list[str]:
    """The prose sentences of a Markdown page: fenced code, tables, headings and indented blocks left out, each
    backquoted span and each link counted as one word."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    lines = [line for line in text.splitlines() if not line.startswith(("|", "#", "    ", "<!--"))]
    prose = re.sub(r"`[^`]*`", "X", " ".join(lines))
    prose = re.sub(r"\[([^\]]*)\]\([^)]*\)", "X", prose)
    return [s for s in re.split(r"(?<=[.!?:;])\s+|\s+-\s+|\s+\d+\.\s+", prose) if len(s.split()) > 2]


@pytest.mark.parametrize("page", sorted(DOCS.rglob("*.md")), ids=lambda p: str(p.relative_to(DOCS)))
def test_no_sentence_of_a_page_runs_past_forty_words(page):
    long = [s for s in sentences(page.read_text(encoding="utf-8")) if len(s.split()) > LONGEST]
    assert long == [], f"{len(long)} sentence(s) over {LONGEST} words, the first: {long[:1]}"


def test_the_count_sees_a_long_sentence_and_leaves_code_and_tables_alone():
    long = " ".join(["word"] * 45) + "."
    assert sentences(long) == [long]
    assert sentences(f"```\n{long}\n```\n| {long} |\n# {long}\n") == []
    assert [len(s.split()) for s in sentences("One two three. Four five six; seven eight nine.")] == [3, 3, 3]
