"""The docs point at things a clone has: every relative link of README.md and docs/*.md names an
existing file, and no page sends the reader to the project's private spec (``shared/spec``)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")

# Pages being written on another branch. The test fails on an entry that exists: delete it then.
PENDING: set[Path] = set()


def test_relative_links_name_existing_files() -> None:
    broken = [
        f"{page.relative_to(REPO)} → {target}"
        for page in PAGES
        for target in _LINK.findall(page.read_text())
        if "://" not in target
        and not (page.parent / target).exists()
        and (page.parent / target).resolve() not in PENDING
    ]
    assert not broken, broken
    assert not [p for p in PENDING if p.exists()], "remove the pages that now exist from PENDING"


def test_no_page_points_at_the_private_spec() -> None:
    assert [p.name for p in PAGES if "shared/spec" in p.read_text()] == []
