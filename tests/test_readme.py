"""The README and docs/ stay true: the model table is the one the code computes, and every relative link resolves."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from collab_vit.cli import format_table, model_table

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_readme_model_table_matches_code() -> None:
    text = README.read_text()
    block = re.search(r"<!-- model-table:start -->\n(.*?)\n<!-- model-table:end -->", text, re.S)
    assert block, "README lost its model-table markers"
    assert block.group(1) == format_table(model_table()), "README table is stale: run `collab-vit models`"


def prose(page: Path) -> str:
    """The page without its fenced code blocks (a ``[i](j)`` in code is not a link)."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of the page's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.*)$", prose(page), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page)) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # not http:, mailto:


def test_anchor_rule_follows_github() -> None:
    page = ROOT / "docs" / "training.md"
    assert {"training-deits-recipe", "slurm-clusters", "fashion-mnist-real-data-on-a-cpu"} <= anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    links = relative_links(page)
    if page == README:
        assert len(links) >= 6, "README links the docs"
    for target in links:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: link {target} points to no file"
        if anchor and file.suffix == ".md":
            assert anchor in anchors(file), f"{page.name}: link {target}: no heading with that anchor"


def test_every_doc_is_linked_from_the_readme() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in relative_links(README)}
    assert {p.resolve() for p in PAGES[1:]} <= linked
