"""RESULTS.md for a reader: its first screen (scope, one table of claims, the pre-registered results, what to use and
what is not supported) fits 60 lines, and every number the README's results section quotes stands in the row of
that table it cites (issue 54, items 3 and 5)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?!\.?\d)")  # 4 in "D/4" or "4x"; not 5 of "e5", not 0.1 of "0.13"
CITE = re.compile(r'RESULTS\.md row "([^"]+)"')


def first_screen() -> str:
    """RESULTS.md up to its first section."""
    return (ROOT / "RESULTS.md").read_text().partition("\n## ")[0]


def claim_rows(screen: str) -> dict[str, str]:
    """The first table's rows by claim: the first cell up to its colon."""
    rows = [line for line in screen.splitlines() if line.startswith("| ") and not line.startswith("| claim |")]
    return {row.split("|")[1].strip().split(":")[0]: row for row in rows}


def results_section() -> str:
    text = (ROOT / "README.md").read_text()
    return text.partition("\n## Results so far")[2].partition("\n## ")[0]


def untraced(section: str, rows: dict[str, str]) -> list[str]:
    """What in ``section`` is not traced: an item quoting numbers that cites no row (or one RESULTS.md lacks), and
    each number not in the row its item cites."""
    wrong = []
    for item in re.split(r"\n\s*\n|\n(?=\* )", section):
        numbers = NUMBER.findall(re.sub(r"\]\([^)]*\)", "]", CITE.sub("", item)))  # not the link targets
        cited = CITE.findall(item)
        if not numbers:
            continue
        if len(cited) != 1 or cited[0] not in rows:
            wrong.append(f"cites {cited or 'no row'}: {' '.join(item.split())[:80]}")
            continue
        wrong += [f"{number} not in row {cited[0]!r}" for number in numbers
                  if not re.search(rf"(?<![\w.]){re.escape(number)}(?!\.?\d)", rows[cited[0]])]
    return wrong


def test_first_screen_fits_and_says_what_a_reader_needs() -> None:
    screen = first_screen()
    assert len(screen.splitlines()) <= 60, len(screen.splitlines())
    flat = " ".join(screen.split())
    for needed in ("Fashion-MNIST", "2-core", "Nothing at ImageNet scale and no GPU", "| claim | verdict |",
                   "Pre-registered, as they came", "What to use", "What the measurements do not support",
                   "RESULTS_HISTORY.md"):
        assert needed in flat, needed
    rows = claim_rows(screen)
    assert {"from scratch", "post hoc", "redundancy", "calibrated conversion", "rotary",
            "DeiT-B conversion cost"} <= set(rows), sorted(rows)
    assert all(len(row.strip("|").split(" | ")) == 4 for row in rows.values())  # claim, verdict, number, section


def test_every_readme_result_number_is_in_the_row_it_cites() -> None:
    rows = claim_rows(first_screen())
    section = results_section()
    assert len(CITE.findall(section)) >= 4
    assert untraced(section, rows) == []


def test_the_trace_catches_a_number_its_row_lacks_and_an_item_that_cites_none() -> None:
    rows = claim_rows(first_screen())
    section = results_section()
    planted = section.replace("-0.13 ± 0.22 against weight-only", "never more than 0.08 below weight-only", 1)
    assert planted != section and untraced(planted, rows) == ["0.08 not in row 'calibrated conversion'"]
    uncited = section + "\n* **A claim**: 1.5 points, from nowhere.\n"
    assert len(untraced(uncited, rows)) == 1


def test_the_history_holds_each_removed_option_with_its_commit() -> None:
    """What left the public surface keeps its numbers and the commit that produced them."""
    history = (ROOT / "RESULTS_HISTORY.md").read_text()
    table = history.partition("## Options removed from the public surface")[2].partition("\n## ")[0]
    for option in ("budget=F", "--key-dim 0.95", "--effort thorough", "--method cp", "--mixing-lr-scale"):
        row = next((line for line in table.splitlines() if option in line), "")
        assert re.search(r"`[0-9a-f]{7}`", row) and NUMBER.search(row.split(" | ")[2]), option
