"""Every link between the documents holds: each relative link of README.md, docs/*.md, RESULTS.md and
RESULTS_HISTORY.md names a file of the repository, each ``FILE.md#anchor`` (or ``#anchor``) a heading of that file by
GitHub's anchor rules, and each section named in words (``RESULTS.md (b), "At a fixed compute"``, in the documents and
in the package's docstrings and comments) begins a heading of the file it names."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
DOCUMENTS = ("README.md", "RESULTS.md", "RESULTS_HISTORY.md", *(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
NAMED = re.compile(r"(RESULTS(?:_HISTORY)?\.md)(?: \([abc]\))?,? \"(\w[^\"]*)\"")  # not README's `row "..."`


def headings(path: Path) -> list[str]:
    """The file's headings as written, outside code blocks."""
    found, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.append(line.lstrip("#").strip())
    return found


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, markup and punctuation dropped (hyphens and underscores kept), each
    space a hyphen."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of the file, repeated headings suffixed -1, -2, ... as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(path):
        a = anchor(heading)
        out.add(a if a not in seen else f"{a}-{seen[a]}")
        seen[a] = seen.get(a, 0) + 1
    return out


def broken_links(source: Path) -> list[str]:
    name = source.name
    wrong = []
    for m in LINK.finditer(source.read_text()):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, fragment = target.partition("#")
        path = (source.parent / file).resolve() if file else source
        if not path.exists():
            wrong.append(f"{name}: {target}: no such file")
        elif fragment and path.suffix == ".md" and fragment not in anchors(path):
            wrong.append(f"{name}: {target}: no such heading in {path.name}")
    return wrong


def test_every_relative_link_and_anchor_resolves() -> None:
    checked = [m for name in DOCUMENTS for m in LINK.findall((ROOT / name).read_text())]
    assert len(checked) > 50 and sum("#" in m for m in checked) > 10
    assert [w for name in DOCUMENTS for w in broken_links(ROOT / name)] == []


def named_sections(text: str, name: str) -> list[str]:
    """Each ``RESULTS.md (b), "X"`` of ``text`` whose X begins no heading of the file it names."""
    flat = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)
    titles = {f: [h.lower() for h in headings(ROOT / f)] for f in ("RESULTS.md", "RESULTS_HISTORY.md")}
    return [f"{name}: {m.group(0)}" for m in NAMED.finditer(flat)
            if not any(h.startswith(m.group(2).lower()) for h in titles[m.group(1)])]


def test_every_section_named_in_words_is_a_heading_there() -> None:
    texts = {name: (ROOT / name).read_text() for name in DOCUMENTS}
    texts.update({str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "collab_vit").rglob("*.py"))})
    assert [w for name, text in texts.items() for w in named_sections(text, name)] == []


def test_the_anchors_follow_githubs_rules_and_a_missing_one_is_caught(tmp_path: Path) -> None:
    assert anchor("At a fixed compute: the default") == "at-a-fixed-compute-the-default"
    assert anchor("(b) Post hoc, weights only") == "b-post-hoc-weights-only"
    assert anchor("A learning rate for the mixing — `mixing_lr_scale` (measured)") == \
        "a-learning-rate-for-the-mixing--mixing_lr_scale-measured"
    doc = tmp_path / "doc.md"
    doc.write_text("# Top\n\n```bash\n# not a heading\n```\n\n## Top\n\n[a](#top-1) [b](#not-a-heading) [c](gone.md)\n")
    assert anchors(doc) == {"top", "top-1"}
    assert broken_links(doc) == ["doc.md: #not-a-heading: no such heading in doc.md", "doc.md: gone.md: no such file"]
    assert named_sections('RESULTS.md (b), "Constants by leave-one-source-out on top-1"', "d") != []
    assert named_sections('RESULTS.md (b), "At a fixed\n  compute"', "d") == []
