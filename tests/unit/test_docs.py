"""The documentation a newcomer enters: a short README, and no relative link in the README,
CONTRIBUTING.md, BENCHMARKS.md or docs/ that points at a file that is not there (a moved or renamed page)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 160

# [text](target) and [text](target "title"), images too; reference-style definitions: [id]: target
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def doc_files() -> list[Path]:
    return [REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").rglob("*.md"))]


def relative_links(text: str) -> list[str]:
    """Every link target of a Markdown text that is a path (no scheme, no bare anchor), code left out."""
    prose = CODE_SPAN.sub("", FENCE.sub("", text))
    targets = INLINE_LINK.findall(prose) + REFERENCE_DEF.findall(prose)
    return [t for t in targets if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", t) and not t.startswith(("#", "//"))]


def test_the_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move the rest into docs/"


def test_the_docs_exist() -> None:
    assert (REPO / "mkdocs.yml").is_file() and (REPO / "docs" / "index.md").is_file()
    assert len(doc_files()) > 3


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_points_at_a_file(path: Path) -> None:
    missing = []
    for target in relative_links(path.read_text()):
        file_part = target.split("#", 1)[0].split("?", 1)[0]
        if not file_part:
            continue
        resolved = (REPO / file_part.lstrip("/")) if file_part.startswith("/") else (path.parent / file_part)
        if not resolved.exists():
            missing.append(target)
    assert not missing, f"{path.relative_to(REPO)}: links to files that do not exist: {missing}"


def test_the_link_finder_finds_links() -> None:
    """The check above would pass on a finder that finds nothing: it must see these, and not code."""
    text = 'See [a](docs/a.md#x), ![img](img.png "t"), [ext](https://x.org/y.md), [top](#here)\n[r]: ref.md\n`[no](code.md)`\n```\n[no](fenced.md)\n```\n'
    assert relative_links(text) == ["docs/a.md#x", "img.png", "ref.md"]
