"""The docs cannot point nowhere: every relative Markdown link in README.md and docs/*.md resolves
to a file (and a ``#anchor`` to a heading of it), and every repository path quoted in backticks
(``tests/...``, ``src/...``, ``bench/...``, ``examples/...``, ``docs/...``, ``scripts/...``) exists."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
QUOTED_PATH = re.compile(r"`((?:src|tests|bench|docs|examples|scripts)/[\w./-]+)`")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return out


def _problems(page: Path) -> list[str]:
    text = page.read_text()
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"link {target!r}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"link {target!r}: no heading #{anchor}")
    for quoted in QUOTED_PATH.findall(text):
        path = quoted.rstrip(".")
        if path.startswith("bench/results"):  # benchmark outputs: written by a run, not in the tree
            continue
        if not any(ROOT.glob(path)) and not (ROOT / path).exists():
            bad.append(f"path `{quoted}` does not exist")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_paths_resolve(page):
    assert _problems(page) == []


def test_the_checker_finds_a_broken_link(tmp_path):
    """Negative control."""
    page = tmp_path / "p.md"
    page.write_text("# Title\n[ok](#title) [gone](missing.md) [bad](#nope) `tests/no_such_test.py`\n")
    assert len(_problems(page)) == 3


def test_readme_is_a_front_page():
    """The README stays what a newcomer needs in the first ten minutes; the manual is in docs/."""
    readme = (ROOT / "README.md").read_text()
    assert readme.count("\n") <= 200
    assert "docs/README.md" in readme
