"""``scripts/venv.sh``, the one ``.venv/`` of ``scripts/quickstart.sh`` and ``scripts/test.sh``: it installs only
when pyproject.toml or the extras asked for changed, so a second run of either script installs (and uninstalls)
nothing. Run with a stand-in ``.venv/bin/python`` that logs every pip call: no network, nothing installed."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "${{1:-}}" = -m ] && [ "${{2:-}}" = pip ]; then  # an install: logged, and its entry point appears
    echo "${{*:3}}" >> {log}
    : > .venv/bin/collab-vit
    exit 0
fi
PYTHONPATH={site} exec {python} "$@"
"""
METADATA = 'Metadata-Version: 2.1\nName: collab-vit\nVersion: 0.2.0\nRequires-Dist: torch>=2.9\n' \
           'Requires-Dist: pytest>=8; extra == "test"\nRequires-Dist: onnx>=1.18; extra == "onnx"\n'


def repository(tmp_path: Path) -> Path:
    """A copy of pyproject.toml and scripts/venv.sh, a stand-in python in .venv/ and the installed package's
    metadata (what the stand-in's Python finds)."""
    repo, site = tmp_path / "repo", tmp_path / "site"
    (repo / "scripts").mkdir(parents=True)
    (repo / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", repo)
    shutil.copy(ROOT / "scripts" / "venv.sh", repo / "scripts")
    (site / "collab_vit-0.2.0.dist-info").mkdir(parents=True)
    (site / "collab_vit-0.2.0.dist-info" / "METADATA").write_text(METADATA)
    fake = repo / ".venv" / "bin" / "python"
    fake.write_text(FAKE_PYTHON.format(log=tmp_path / "pip.log", site=site, python=sys.executable))
    fake.chmod(0o755)
    (tmp_path / "pip.log").touch()
    return repo


def installs(repo: Path, *extras: str) -> list[str]:
    """The pip calls one ``venv_install EXTRAS`` made, as the scripts call it (``set -euo pipefail``)."""
    log = repo.parent / "pip.log"
    before = log.read_text().splitlines()
    subprocess.run(["bash", "-c", 'set -euo pipefail; source scripts/venv.sh; venv_install "$@"', "_", *extras],
                   cwd=repo, check=True, timeout=60)
    return log.read_text().splitlines()[len(before):]


def test_second_runs_install_nothing(tmp_path: Path) -> None:
    repo = repository(tmp_path)
    pip = "install --quiet --disable-pip-version-check"
    assert installs(repo) == [f"{pip} -e ."]  # the quickstart, first
    assert installs(repo) == []  # again: nothing
    assert installs(repo, "test") == [f"{pip} pytest>=8"]  # the tests: their extra's requirements, not the package
    assert installs(repo, "test") == [] and installs(repo) == []
    assert (repo / ".venv" / "collab-vit.stamp").read_text().splitlines()[1] == "test"
    with open(repo / "pyproject.toml", "a") as f:
        f.write("# changed\n")
    assert installs(repo) == [f"{pip} -e .[test]"]  # another pyproject.toml: the package, every extra so far
    assert installs(repo, "test") == [] and installs(repo) == []
    (repo / ".venv" / "bin" / "collab-vit").unlink()  # the package removed by hand
    assert installs(repo) == [f"{pip} -e .[test]"]


def test_both_scripts_install_through_it() -> None:
    for script, call in (("quickstart.sh", "venv_install\n"), ("test.sh", "venv_install test\n")):
        text = (ROOT / "scripts" / script).read_text()
        assert "source scripts/venv.sh\n" in text and call in text and "pip install" not in text, script
