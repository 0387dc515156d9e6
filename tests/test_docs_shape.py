"""The docs keep the shape a newcomer can read: a short README, a design of the system as it is,
benchmarks that hold the latest figures, one decision per record, and no link to a file or a
heading that is not there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RECORDS = sorted((DOCS / "decisions").glob("[0-9][0-9][0-9][0-9]-*.md"))
LINKED_FROM = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

#: The most lines each page may have.
LIMITS = {"README.md": 120, "docs/design.md": 400, "docs/benchmarks.md": 300}
RECORD_LIMIT = 150
RECORD_SECTIONS = ("Context", "Decision", "Consequences")

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _prose(path: Path) -> str:
    """The page less its code blocks and code spans, where a bracket is no link."""
    return CODE_SPAN.sub("", FENCE.sub("", path.read_text()))


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces
    as hyphens, a repeated one numbered."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


@pytest.mark.parametrize("page", sorted(LIMITS))
def test_each_page_keeps_to_its_length(page):
    assert _lines(ROOT / page) <= LIMITS[page]


def test_there_are_decision_records():
    assert len(RECORDS) >= 2
    numbers = [path.name[:4] for path in RECORDS]
    assert len(set(numbers)) == len(numbers), "two records share a number"


@pytest.mark.parametrize("record", RECORDS, ids=[path.name for path in RECORDS])
def test_each_decision_record_is_short_and_has_its_sections(record):
    text = record.read_text()
    sections = re.findall(r"^## (.+?)\s*$", text, re.MULTILINE)

    assert _lines(record) <= RECORD_LIMIT
    assert text.startswith(f"# {record.name[:4]}: "), "a record opens with its number"
    for section in RECORD_SECTIONS:
        assert section in sections, f"no '## {section}'"
    assert [name for name in sections if name in RECORD_SECTIONS] == list(RECORD_SECTIONS)


@pytest.mark.parametrize(
    "page", LINKED_FROM, ids=[str(path.relative_to(ROOT)) for path in LINKED_FROM]
)
def test_every_relative_link_points_at_something_there(page):
    broken = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no such heading in {linked.name}")
    assert broken == []
