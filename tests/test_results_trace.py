"""One number per fact. RESULTS.md's first screen (scope, one table of claims, the pre-registered results, what to use
and what is not supported) fits 60 lines; every number the README's results section quotes stands in the row of
that table it cites, and the section has an item for every row; and the numbers that the README, docs/, RESULTS.md
and the package's docstrings and comments give about the recipe's cost and constants (the images and passes of each
effort, ``--effort full``'s compute against the default's, the sources the constants were chosen on, the default's
verdict) are the code's constants or are computed from the RESULTS.md table they come from. No issue numbers
anywhere in them: a reader of the repository cannot look one up."""
from __future__ import annotations

import re
import sys
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


def test_the_readme_has_an_item_for_every_claim_row() -> None:
    """"One line per claim": every row of the claims table, the default's own verdict included."""
    assert sorted(set(rows_cited(results_section()))) == sorted(claim_rows(first_screen()))


def test_the_trace_catches_a_number_its_row_lacks_and_an_item_that_cites_none() -> None:
    rows = claim_rows(first_screen())
    section = results_section()
    planted = section.replace("-0.13 ± 0.22 against weight-only", "never more than 0.08 below weight-only", 1)
    assert planted != section and untraced(planted, rows) == ["0.08 not in row 'calibrated conversion'"]
    uncited = section + "\n* **A claim**: 1.5 points, from nowhere.\n"
    assert len(untraced(uncited, rows)) == 1


def rows_cited(section: str) -> list[str]:
    return CITE.findall(section)


def test_the_history_holds_each_removed_option_with_its_commit() -> None:
    """What left the public surface keeps its numbers and the commit that produced them."""
    history = (ROOT / "RESULTS_HISTORY.md").read_text()
    table = history.partition("## Options removed from the public surface")[2].partition("\n## ")[0]
    for option in ("budget=F", "--key-dim 0.95", "--effort thorough", "--method cp", "--mixing-lr-scale"):
        row = next((line for line in table.splitlines() if option in line), "")
        assert re.search(r"`[0-9a-f]{7}`", row) and NUMBER.search(row.split(" | ")[2]), option


# --- the recipe's numbers wherever they are written ---------------------------------------------------------------

WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
         "seventeen").split()


def documents() -> dict[str, str]:
    """What a reader reads about the recipe: README, docs/, RESULTS.md and every module of the package (docstrings,
    comments, help texts), by path relative to the repository."""
    paths = [ROOT / "README.md", ROOT / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "collab_vit").rglob("*.py"))]
    return {str(p.relative_to(ROOT)): p.read_text() for p in paths}


def where(path: str, text: str, at: int) -> str:
    return f"{path}:{text.count(chr(10), 0, at) + 1}"


def flat(text: str) -> str:
    """Lines joined (a comment's ``#``s and a help text's quotes dropped) so that a phrase wrapped over lines reads as
    one; offsets stay those of ``text``."""
    return re.sub(r'["\']?\n\s*(?:#\s*|["\']\s*)?', lambda m: " " * len(m.group(0)), text)


def recipe_constants() -> tuple[dict[str, int], dict[str, int]]:
    from collab_vit.conversion.calibration.recipe import IMAGES, PASSES

    return dict(IMAGES), dict(PASSES)


def full_over_default() -> tuple[float, float, float]:
    """``--effort full``'s DeiT-B seconds, the default's and their ratio, bfloat16 parts, priced from the parts
    measured end to end on DeiT-B (``experiments/fixed_compute.py``, RESULTS.md (b), "At a fixed compute") at the
    recipe's own images and passes."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from fixed_compute import seconds

    images, passes = recipe_constants()
    full, default = seconds(images["full"], passes["full"], True), seconds(images["default"], passes["default"], True)
    return full, default, full / default


RATIO = re.compile(r"about (\d+(?:\.\d+)?) ?(?:x|times) the default's compute")


def wrong_ratios(docs: dict[str, str], ratio: float) -> list[str]:
    """Every "about N times the default's compute" (``--effort full``'s) whose N is not ``ratio`` rounded, and every
    "about N x" of a sentence on ``full`` that does not say against what."""
    wrong = []
    for path, text in docs.items():
        one = flat(text)
        wrong += [f"{where(path, text, m.start())}: {m.group(0)} (the code: about {round(ratio)})"
                  for m in RATIO.finditer(one) if float(m.group(1)) != round(ratio)]
        for m in re.finditer(r"about (\d+) ?(?:x|times)(?! the default's compute)(?! `?--effort full`?'s)", one):
            clause = re.split(r"[.;|]\s", one[max(0, m.start() - 120):m.start()])[-1]
            if re.search(r"\bfull\b", clause):
                wrong.append(f"{where(path, text, m.start())}: {m.group(0)} of `full`, against what?")
    return wrong


def test_full_effort_compute_is_one_figure_from_the_code() -> None:
    full, default, ratio = full_over_default()
    results = flat((ROOT / "RESULTS.md").read_text())
    assert f"gives it {full:.0f} s against the default's {default:.0f}" in results, (full, default)
    assert wrong_ratios(documents(), ratio) == []


def images_passes_wrong(docs: dict[str, str]) -> list[str]:
    """Each effort's images and passes, written as a pair ("768 images and 8 passes", "16 passes over 2048 images")
    or after the effort's name ("the default's 768 images", "full: 16 passes"), against ``recipe.IMAGES`` and
    ``recipe.PASSES`` (RESULTS.md's grids write other recipes as "640 x 8")."""
    images, passes = recipe_constants()
    pairs = {(images[e], passes[e]) for e in passes}
    wrong = []
    for path, text in docs.items():
        one = flat(text)
        for m in re.finditer(r"(\d+) (?:unlabelled )?images(?:,| and) (\d+) passes|(\d+) passes over (\d+) images", one):
            n, p = (int(m.group(1)), int(m.group(2))) if m.group(1) else (int(m.group(4)), int(m.group(3)))
            if (n, p) not in pairs:
                wrong.append(f"{where(path, text, m.start())}: {m.group(0)} (the code: {sorted(pairs)})")
        if path == "RESULTS.md":  # the measured record: other images and passes are other recipes
            continue
        for m in re.finditer(r"(\d+)\s+(?:unlabelled |calibration )?(images|passes)\b", one):
            clause = re.split(r"[.;|]\s", one[max(0, m.start() - 60):m.start()])[-1]
            named = re.findall(r"\b(default|full)\b(?! before)", clause)  # "the default before": the old one
            if not named:
                continue
            effort = named[-1]
            expected = (images if m.group(2) == "images" else passes)[effort]
            if int(m.group(1)) != expected:
                wrong.append(f"{where(path, text, m.start())}: {m.group(0)} of `{effort}` (the code: {expected})")
    return wrong


def test_each_efforts_images_and_passes_are_the_codes() -> None:
    assert images_passes_wrong(documents()) == []


def loso_sources() -> int:
    """How many sources RESULTS.md (b)'s constants were chosen on: the one left out and "the other N"."""
    constants = (ROOT / "RESULTS.md").read_text().partition("### The constants")[2].partition("\n### ")[0]
    other = re.search(r"did best on\s+the other (\w+)", constants)
    assert other, "RESULTS.md (b), 'The constants': no 'did best on the other N'"
    return WORDS.index(other.group(1)) + 1


def test_the_sources_each_constant_was_chosen_on() -> None:
    """"Leave-one-source-out on N sources" (the held-out split, the guard, the refinement's lr and passes) is
    RESULTS.md (b)'s count."""
    n = loso_sources()
    wrong = [f"{where(path, text, m.start())}: {m.group(0)} (RESULTS.md (b), 'The constants': {WORDS[n]})"
             for path, text in documents().items()
             for m in re.finditer(rf"leave-one-source-out on ({'|'.join(WORDS)}|\d+)(?: trained| Fashion-MNIST)? sources",
                                     flat(text))
             if m.group(1) not in (WORDS[n], str(n))]
    assert wrong == []


def fixed_compute_verdict() -> tuple[int, int]:
    """From RESULTS.md (b)'s fixed-compute table: the sources on which the default is more than 0.1 below 2048 x 16
    at D/16, and the sources compared."""
    section = (ROOT / "RESULTS.md").read_text().partition("### At a fixed compute")[2].partition("\n## ")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if re.match(r"\| e\d+-s\d+ \|", line)]
    sources = {row[0] for row in rows}
    missed = {row[0] for row in rows if row[1].startswith("4") and float(row[-1].split()[0]) < -0.1}
    return len(missed), len(sources)


def test_the_defaults_verdict_is_its_tables_count() -> None:
    missed, sources = fixed_compute_verdict()
    assert (missed, sources) == (6, 8)  # the table as measured; a new row moves the words below with it
    phrase = f"{WORDS[missed]} of the {WORDS[sources]} sources"
    row = claim_rows(first_screen())["the calibrated default at a fixed compute"]
    assert f"missed at D/16 on {phrase}" in row
    assert phrase in " ".join(results_section().split())


ISSUE = re.compile(r"\bissues? ?#?\d+", re.IGNORECASE)


def test_no_issue_numbers() -> None:
    """README, docs/, RESULTS.md and the package name a RESULTS.md section or the behaviour, never an issue (which a
    reader of the repository cannot look up); RESULTS_HISTORY.md, the path taken, keeps them."""
    found = [f"{where(path, text, m.start())}: {m.group(0)}" for path, text in documents().items()
             for m in ISSUE.finditer(text)]
    assert found == []


def test_the_checks_catch_what_they_guard_against() -> None:
    """Today's wrong numbers, planted back, are each found."""
    full, default, ratio = full_over_default()
    assert round(ratio) == 4 and wrong_ratios({"d": "full: about 6x the default's compute"}, ratio) == [
        "d:1: about 6x the default's compute (the code: about 4)"]
    assert wrong_ratios({"d": "`full`: 16 passes over 2048 images (about 5x)"}, ratio) != []
    assert images_passes_wrong({"RESULTS.md": "the default before, whose 640 images and 8 passes"}) != []
    assert images_passes_wrong({"r.py": '``"default"`` (every layer alone, 16\n    passes over the fitting images)'})
    assert images_passes_wrong({"d": "the default's 768 images and 8 passes; `full`: 2048 images"}) == []
    assert ISSUE.search("(issues 40 and 54: the leave-one-source-out choice)")
    assert not ISSUE.search("the issues it fixed")
