"""The docs cannot point nowhere: every relative Markdown link in README.md, docs/**/*.md and the
logs of bench/reference/ resolves to a file (and a ``#anchor`` to a heading of it), and every
repository path quoted in backticks
(``tests/...``, ``src/...``, ``bench/...``, ``examples/...``, ``docs/...``, ``scripts/...``) exists.
The README stays a front page (≤ 10,000 characters, no figure its linked page does not state), each
docs page opens with a first screen (≤ 15 lines before its first ``##``), and docs/status.md and the
README's support matrix are the rendering of ``scripts/status.py``'s one table. docs/ stays within
200,000 characters besides its generated reference tables (a smoke alarm for docs as a guide)."""

import functools
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LOGS = sorted((ROOT / "bench" / "reference").glob("*.md"))  # the dated logs the pages link to
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


@pytest.mark.parametrize("page", PAGES + LOGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_paths_resolve(page):
    assert _problems(page) == []


def test_the_checker_finds_a_broken_link(tmp_path):
    """Negative control."""
    page = tmp_path / "p.md"
    page.write_text("# Title\n[ok](#title) [gone](missing.md) [bad](#nope) `tests/no_such_test.py`\n")
    assert len(_problems(page)) == 3


README_MAX_CHARS = 10_000
FIRST_SCREEN_LINES = 15
DIMENSIONS = ("PP", "DP", "FSDP2", "CP", "TP", "EP")


def test_readme_is_a_front_page():
    """The README stays what a newcomer needs in the first ten minutes; the manual is in docs/. A fresh
    machine runs its first two commands, so they stay first; the pitch names every dimension."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme) <= README_MAX_CHARS, (
        f"README.md is {len(readme)} characters (bound {README_MAX_CHARS})"
    )
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split("#")[0].strip() for line in first_block] == [
        "bash scripts/quickstart.sh",
        "bash scripts/test.sh",
    ]
    pitch = readme.split("\n## ", 1)[0]
    assert all(f"({dim})" in pitch for dim in DIMENSIONS), pitch
    assert "docs/README.md" in readme and "docs/status.md" in readme


def _first_screen(text: str) -> list[str]:
    """The page's lines before its first ``##`` heading (outside code fences), trailing blanks dropped."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            break
        out.append(line)
    while out and not out[-1].strip():
        out.pop()
    return out


@pytest.mark.parametrize("page", PAGES[1:], ids=lambda p: str(p.relative_to(ROOT)))
def test_each_docs_page_opens_with_a_first_screen(page):
    """What the page is for, its one command or snippet and its key fact fit on one screen."""
    screen = _first_screen(page.read_text())
    assert len(screen) <= FIRST_SCREEN_LINES, (
        f"{page.name}: {len(screen)} lines before the first '## ' heading (bound {FIRST_SCREEN_LINES})"
    )
    assert screen and screen[0].startswith("# "), f"{page.name} opens without its title"


def test_the_first_screen_stops_at_the_first_heading_outside_code():
    """Negative control: a ``## `` inside a code fence is no heading; a long opening fails the bound."""
    text = "# T\n```bash\n## not a heading\n```\n" + "x\n" * 20 + "## H\nbody\n"
    assert len(_first_screen(text)) == 24


DOCS_MAX_CHARS = 200_000
GENERATED_MARKER = re.compile(r"^<!-- generated by .+: do not edit -->$", re.M)


def _docs_size(docs: Path) -> tuple[int, list[Path], list[Path]]:
    """docs/'s Markdown a reader reads, in characters as ``wc -c`` counts them (UTF-8 bytes), the
    generated files left out of it, and the files under ``reference/`` that lack the marker. Generated
    files live in ``reference/`` and say so in their opening lines (``<!-- generated by ...: do not
    edit -->``); a page anywhere else counts, even when a script renders it (docs/status.md's rows are
    written by hand in scripts/status.py)."""
    total, generated, unmarked = 0, [], []
    for page in sorted(docs.rglob("*.md")):
        if "reference" in page.relative_to(docs).parts[:-1]:
            marked = GENERATED_MARKER.search("\n".join(page.read_text().splitlines()[:5]))
            (generated if marked else unmarked).append(page)
        else:
            total += len(page.read_bytes())
    return total, generated, unmarked


def test_docs_stay_a_guide_not_a_notebook():
    """A smoke alarm for the concept "docs are a user's guide" (issue 60), not a proof of it: docs/
    stays within 200,000 characters besides generated reference tables. Size is what grows when pages
    turn into lab notebooks (dated run logs, test inventories, the same explanation on three pages);
    a page can be a poor guide well under the bound. When this fails, move dated measurements to
    bench/reference/ (the page keeps the current figure, its date and a link), cut what another page
    already says, and let only generated tables live in docs/reference/, marked as such."""
    total, generated, unmarked = _docs_size(ROOT / "docs")
    assert unmarked == [], f"docs/reference/ holds only generated files, marked: {unmarked}"
    assert generated, "docs/reference/ lost its generated tables (Axolotl's keys)"
    assert total <= DOCS_MAX_CHARS, (
        f"docs/ is {total:,} characters besides generated files (bound {DOCS_MAX_CHARS:,}): "
        "a guide, not a notebook — move run logs to bench/reference/, cut what is restated"
    )


def test_the_docs_size_counts_hand_written_pages_and_flags_an_unmarked_reference(tmp_path):
    """Negative control: a hand-written page counts even if rendered by a script (it says "generated"
    outside reference/); a marked reference table does not; an unmarked file in reference/ is flagged."""
    (tmp_path / "reference").mkdir()
    (tmp_path / "guide.md").write_text("# G\n×\n")  # 7 bytes as wc -c counts them (× is two)
    (tmp_path / "status.md").write_text("# S\n<!-- generated by `x`: do not edit -->\n")  # 43
    (tmp_path / "reference" / "keys.md").write_text(
        "# K\n<!-- generated by `y` from z: do not edit -->\n" + "k" * 500
    )
    (tmp_path / "reference" / "notes.md").write_text("# Notes written by hand\n")
    total, generated, unmarked = _docs_size(tmp_path)
    assert total == 7 + 43
    assert [p.name for p in generated] == ["keys.md"] and [p.name for p in unmarked] == ["notes.md"]


# A figure: a date, a number in scientific notation, or a number (1,024 / 0.56 / 92) standing alone:
# not part of a name such as FSDP2, Qwen3, Phi-3 or 0.56M.
FIGURE = re.compile(r"(?<![\w.,-])(\d{4}-\d{2}-\d{2}|\d+(?:\.\d+)?e-\d+|\d+(?:[.,]\d+)*)(?![\w.,]*\w)")


def _figures(text: str) -> set[str]:
    return set(FIGURE.findall(text))


def _prose_blocks(markdown: str) -> list[str]:
    """Paragraphs and table rows outside code fences, without HTML comments and inline code."""
    text = re.sub(r"```.*?```", "\n\n", markdown, flags=re.S)
    text = re.sub(r"^<!--.*?-->\n|<!--.*?-->", "", text, flags=re.M)
    text = re.sub(r"`[^`]*`", "", text)
    blocks = []
    for para in re.split(r"\n\s*\n", text):
        rows = para.splitlines()
        blocks += rows if rows and rows[0].startswith("|") else ["\n".join(rows)]
    return blocks


def _unbacked_figures(readme: Path) -> list[str]:
    """Each figure of a README paragraph or table row must appear in a docs page that block links."""
    bad = []
    for block in _prose_blocks(readme.read_text()):
        links = [t.partition("#")[0] for t in LINK.findall(block) if not re.match(r"[a-z]+:", t)]
        prose = LINK.sub(lambda m: m.group(0).split("](")[0], block)
        figures = _figures(prose)
        if not figures:
            continue
        backed = set()
        for target in links:
            page = (readme.parent / target).resolve() if target else readme
            if page.suffix == ".md" and page.exists():
                backed |= _figures(page.read_text())
        bad += [f"{f!r} in: {block[:80]!r}" for f in sorted(figures - backed)]
    return bad


def test_no_readme_figure_without_the_page_that_states_it():
    """The README's numbers are the docs' numbers: a figure the linked page does not state (or a block
    with figures and no link) is a contradiction waiting to happen (it was: 144/198 vs 182/198)."""
    assert _unbacked_figures(ROOT / "README.md") == []


def test_the_figure_check_finds_a_contradiction(tmp_path):
    """Negative control: a README figure its page does not state, and one with no page, both fail."""
    (tmp_path / "page.md").write_text("# P\n182 of 198 examples, measured 2026-12-01.\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# R\n\n144 of 198 accepted ([page](page.md)).\n\n| row | 182 of 198 | [page](page.md) |\n\n"
        "Trains in 1.5 minutes.\n\nFSDP2 on Qwen3 and Phi-3, `--gpus 64`, 2026-12-01 ([page](page.md)).\n"
    )
    assert sorted(b.split(" in:")[0] for b in _unbacked_figures(readme)) == ["'1.5'", "'144'"]


@functools.cache
def _status_module():
    """scripts/status.py (not a package module: it renders the repository's own docs)."""
    spec = importlib.util.spec_from_file_location("ndparallel_status_table", ROOT / "scripts" / "status.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_status_page_and_support_matrix_are_generated_from_the_table():
    status = _status_module()
    assert (ROOT / "docs" / "status.md").read_text() == status.status_page(), (
        "docs/status.md is stale: python scripts/status.py"
    )
    assert status.current_block((ROOT / "README.md").read_text()) == status.support_matrix(), (
        "the README's support matrix is stale: python scripts/status.py"
    )


def test_each_status_figure_is_in_its_page_or_tests():
    """A figure of docs/status.md's row appears in that row's docs page or test files (the
    README's figures are checked against pages the same way)."""
    status = _status_module()
    bad = []
    for row in (row for rows in status.AREAS.values() for row in rows):
        figures = _figures(re.sub(r"`[^`]*`", "", f"{row.feature} {row.state} {row.gpu} {row.result}"))
        backed = _figures((ROOT / "docs" / row.page.partition("#")[0]).read_text())
        for pattern in row.tests:
            for path in ROOT.glob(pattern):
                backed |= _figures(path.read_text())
        bad += [f"{row.feature[:40]}: {f}" for f in sorted(figures - backed)]
    assert bad == []


def test_each_status_row_names_existing_tests_and_a_page():
    status = _status_module()
    rows = [row for rows in status.AREAS.values() for row in rows]
    gpus_measured = re.search(
        r"^## GPU results so far \((.*)\)$", (ROOT / "docs/benchmarks.md").read_text(), re.M
    )
    assert gpus_measured, "docs/benchmarks.md lost its dated GPU results section"
    for row in rows:
        assert any(t.startswith("tests/") for t in row.tests), row.feature
        for test in row.tests:
            assert any(ROOT.glob(test)), f"{row.feature[:40]}: {test} does not exist"
        page, _, anchor = row.page.partition("#")
        assert (ROOT / "docs" / page).exists(), row.page
        assert not anchor or anchor in _anchors(ROOT / "docs" / page), row.page
        assert bool(row.front) == bool(row.result), row.feature
        # A GPU cell either says nothing ran or names a GPU the dated results name.
        named = re.findall(r"\b([A-Z]{1,2}\d{2,3})\b", row.gpu)
        assert row.gpu in ("—", status.NOT_RUN) or "not" in row.gpu or named, row.gpu
        assert all(gpu in gpus_measured.group(1) for gpu in named), row.gpu


def test_the_families_first_screen_counts_the_matrix():
    """docs/families.md's opening numbers are the matrix's (which tests/test_family_matrix.py keeps
    current), so the README's family row, checked against this page, cannot drift from the tests."""
    text = (ROOT / "docs" / "families.md").read_text()
    matrix = text.split("<!-- family-matrix:start -->\n", 1)[1].split("<!-- family-matrix:end -->", 1)[0]
    rows = [[c.strip() for c in row.strip("|").split("|")[1:]] for row in matrix.splitlines()[2:]]
    cells = [c for row in rows for c in row]
    ok = sum(c == "= 1 process" for c in cells)
    screen = " ".join(_first_screen(text))
    assert f"{len(rows)} families × {len(rows[0])} layouts = {len(cells)} cells" in screen, screen
    assert f"of which {ok} train" in screen, screen
    assert f"{len(cells) - ok} are refused before launch" in screen
