"""The docs stay a map: ARCHITECTURE.md within its size, and every relative link in README.md and docs/ resolves
(a moved section or a renamed page breaks a test, not a reader)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MAX_ARCHITECTURE_LINES = 250
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    found = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return found


def test_architecture_is_a_map_not_a_log():
    lines = (ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines()
    assert len(lines) <= MAX_ARCHITECTURE_LINES, f"docs/ARCHITECTURE.md has {len(lines)} lines"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here (no network)
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        missing_anchor = bool(anchor) and dest.suffix == ".md" and dest.exists() and anchor not in _anchors(dest)
        if not dest.exists() or missing_anchor:
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"
