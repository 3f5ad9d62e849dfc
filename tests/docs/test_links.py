"""Every relative link in README.md and docs/**/*.md resolves, and no page is longer than a reader can take in.

A link `[text](path#anchor)` must name an existing file (relative to the page) and, with an anchor, a heading of
that file (GitHub's anchors: lower case, punctuation dropped, spaces as hyphens, `-1`, `-2` for repeats). A path
written as text (`docs/TRAINING.md`) must exist too. Links inside code (fenced blocks, `inline code`) are text.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
MAX_LINES = {"README.md": 250}  # relative to the repository root; every other page: DOC_MAX_LINES
DOC_MAX_LINES = 300

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
DOC_PATH = re.compile(r"(?<![\w/.])docs/[\w./-]+?\.md\b")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown page."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", text).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """The links of `page` that name no file, or no heading of it; text paths `docs/...` are taken from `root`."""
    text = page.read_text(encoding="utf-8")
    problems = []
    for target in LINK.findall(prose(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            problems.append(f"{target}: no such file")
        elif anchor and where.is_file() and where.suffix == ".md" \
                and anchor not in anchors(where.read_text(encoding="utf-8")):
            problems.append(f"{target}: no such heading in {where.relative_to(root)}")
    for path in DOC_PATH.findall(text):
        if not (root / path).is_file():
            problems.append(f"{path}: named in the text, no such file")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_resolves(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_page_is_too_long(page):
    name = page.relative_to(ROOT).as_posix()
    lines = page.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES.get(name, DOC_MAX_LINES), f"{name}: {lines} lines; split it or cut it"


def test_a_broken_link_or_anchor_is_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A title: `x` here\n\n## Twice\n\n## Twice\n", encoding="utf-8")
    page = tmp_path / "docs" / "b.md"
    page.write_text("[ok](a.md#a-title-x-here) [ok](a.md#twice-1) [ok](#twice) [web](https://example.org/x) "
                    "[no file](c.md) [no heading](a.md#nothing) `[code](d.md)` docs/a.md docs/gone.md\n"
                    "```\n[fenced](e.md)\n```\n## Twice\n", encoding="utf-8")
    assert anchors((tmp_path / "docs" / "a.md").read_text()) == {"a-title-x-here", "twice", "twice-1"}
    assert broken_links(page, tmp_path) == ["c.md: no such file", "a.md#nothing: no such heading in docs/a.md",
                                            "docs/gone.md: named in the text, no such file"]


def test_every_page_is_checked():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/RESULTS.md", "docs/ARCHITECTURE.md", "docs/results/quality.md"} <= names
