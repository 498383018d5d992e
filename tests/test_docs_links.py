"""Every relative link of the README and docs/ names a file inside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE = re.compile(r"(`+).+?\1", re.S)
_INLINE = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)


def relative_links(text: str) -> list[str]:
    """The link targets of a markdown page that are paths (no scheme, not only an anchor),
    outside code blocks and code spans."""
    text = _CODE.sub("", _FENCE.sub("", text))
    targets = _INLINE.findall(text) + _REFERENCE.findall(text)
    return [t for t in targets
            if t and not t.startswith("#") and not re.match(r"^[a-zA-Z][\w+.-]*:", t)]


def test_the_link_finder() -> None:
    text = ("[a](docs/a.md) [b](../x.md#part) ![c](img/c.png \"title\") [d](#anchor) "
            "[e](https://example.com/f.md) [f](mailto:x@y) `[g](code.md)`\n"
            "```\n[h](fenced.md)\n```\n[i]: ref.md\n")
    assert relative_links(text) == ["docs/a.md", "../x.md#part", "img/c.png", "ref.md"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve_inside_the_repository(page: Path) -> None:
    broken = []
    for target in relative_links(page.read_text(encoding="utf-8")):
        path = (page.parent / target.partition("#")[0]).resolve()
        if not path.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
        elif not path.exists():
            broken.append(f"{target} (missing)")
    assert broken == [], f"{page.relative_to(ROOT)}: broken links: {broken}"
