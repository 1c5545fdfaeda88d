"""The README and docs/ stay true: the model table is the one the code computes, and every relative link resolves."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from collab_vit.cli import format_table, model_table

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "RESULTS.md", ROOT / "RESULTS_HISTORY.md"]
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


def test_readme_states_no_test_counts_or_dates() -> None:
    """Counts and dated results age with the next commit: they live in docs/testing.md, with their date."""
    aging = re.findall(r"\b\d+ (?:passed|skipped|failed|deselected)\b|\b20\d\d-\d\d-\d\d\b", prose(README))
    assert aging == [], "move these to docs/testing.md (with their date)"


def test_readme_quickstart_is_the_config() -> None:
    """The quickstart's model, epochs and parameter count as the README states them are configs/quickstart.yaml's;
    its top-1 ("about N %, give or take a point or two") covers every run docs/testing.md records."""
    import timm

    from collab_vit.training.config import build_config

    text = " ".join(README.read_text().split())
    found = re.search(r"`(\w+)` \(embed (\d+), depth (\d+), (\d+) heads, patch (\d+), \*\*key dim (\d+)\*\*, "
                      r"([\d.]+) M parameters\) for (\d+) epochs with `configs/quickstart.yaml`", text)
    assert found, "README lost the quickstart's description"
    cfg = build_config(str(ROOT / "configs" / "quickstart.yaml"))
    kwargs = cfg.model_kwargs
    assert found.groups()[:6] == (cfg.model, *map(str, (kwargs["embed_dim"], kwargs["depth"], kwargs["num_heads"],
                                                        kwargs["patch_size"], kwargs["key_dim"])))
    assert int(found.group(8)) == cfg.epochs
    model = timm.create_model(cfg.model, num_classes=cfg.num_classes, img_size=cfg.img_size, device="meta", **kwargs)
    assert found.group(7) == f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}"
    top1 = float(re.search(r"about \*\*([\d.]+) % top-1\*\*.*?give or take a point or two", text).group(1))
    testing = (ROOT / "docs" / "testing.md").read_text().partition("### Quickstart")[2].partition("###")[0]
    runs = [float(row.split("|")[3]) for row in testing.splitlines() if re.match(r"\| seed .*\| [\d.]+ \|", row)]
    assert runs and all(abs(run - top1) <= 2 for run in runs), (top1, runs)


def test_readme_floors_are_pyprojects() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    floors = dict(re.findall(r'"(torch|torchvision|timm)>=([\d.]+)"', pyproject))
    python = re.search(r'requires-python = ">=([\d.]+)"', pyproject).group(1)
    assert (f"Python >= {python}; torch >= {floors['torch']} with torchvision >= {floors['torchvision']}; timm >= "
            f"{floors['timm']} (`pyproject.toml`'s floors") in " ".join(README.read_text().split())


def test_readme_figures_from_results_are_in_results() -> None:
    """Each measured figure the README quotes from RESULTS.md (its paragraphs and bullets that cite it, and the
    results section) is one RESULTS.md states: re-measured there, the README must follow."""
    results = (ROOT / "RESULTS.md").read_text()
    text = prose(README)
    section = text.partition("## Results so far")[2].partition("\n## ")[0]
    items = [item for item in re.split(r"\n\s*\n|\n(?=\* )", text) if "RESULTS.md" in item] + [section]
    quoted = {n for item in items for n in re.findall(r"(?<![\w.=])\d+\.\d+(?![\w.])", item)}
    assert len(quoted) >= 10 and sorted(n for n in quoted if n not in results) == []


def test_post_hoc_refusals_are_what_convert_prints(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """docs/post_hoc.md's "Which models convert": each ``$ collab-vit convert ...`` prints the line shown under it
    (the quickstart's export stood in for by one of its architecture: the refusal reads no weights); exit 2, no
    output written."""
    import shlex

    import timm

    from collab_vit.cli import main as cli_main
    from collab_vit.training.config import build_config
    from collab_vit.weights_io import export_safetensors

    cfg = build_config(str(ROOT / "configs" / "quickstart.yaml"))
    kwargs = {**cfg.model_kwargs, "num_classes": cfg.num_classes, "img_size": cfg.img_size}
    export = tmp_path / "model.safetensors"
    export_safetensors(timm.create_model(cfg.model, **kwargs).state_dict(), str(export), cfg.model, kwargs, {})
    section = (ROOT / "docs" / "post_hoc.md").read_text().partition("## Which models convert")[2].partition("\n## ")[0]
    shown = re.findall(r"^\$ collab-vit (.*)\n(collab-vit convert: error: .*)$", section, re.M)
    assert len(shown) == 4
    for command, line in shown:
        args = [str(export) if "quickstart-" in a else str(tmp_path / a) if a in ("r", "q", "k24.safetensors")
                else a for a in shlex.split(command)]
        with pytest.raises(SystemExit) as exit:
            cli_main(args)
        assert exit.value.code == 2 and capsys.readouterr().err.strip() == line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_testing_run_log_is_a_table_newest_first() -> None:
    """docs/testing.md's run log: one row per run (date, commit, CPU, passed, minutes), the newest first."""
    log = (ROOT / "docs" / "testing.md").read_text().partition("### Run log\n")[2].partition("\n#")[0]
    assert "| date (UTC) | commit | CPU (2 cores) | passed | minutes |" in log
    dates = [row.split("|")[1].strip()[:10] for row in log.splitlines() if re.match(r"\| 20\d\d-\d\d-\d\d", row)]
    assert len(dates) >= 10 and dates == sorted(dates, reverse=True)
