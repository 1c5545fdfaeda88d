"""Fetch timm's own model test-suite (``tests/test_models.py`` of the installed timm's sdist) to run on our models.

timm ships its tests only in the source distribution, so we download it with pip (``--no-binary :all:``), take
``tests/test_models.py`` and add our model patterns to the two lists that say how timm treats DeiT-like models:
``NON_STD_FILTERS`` (ViTs have no spatial feature maps, exactly as timm's own ``deit*``) and ``FEAT_INTER_FILTERS``
(modules whose models support ``forward_intermediates``; ours live in the module ``collab_vit.models``).
"""
from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import timm

SUITE_DIR = Path(__file__).parent / "timm_upstream_suite"
ANCHOR = "NUM_NON_STD = len(NON_STD_FILTERS)"
PATCH = (
    "# collab-vit: treat our models as timm treats its DeiTs (see tests/timm_upstream.py)\n"
    "NON_STD_FILTERS += ['collab_deit_*', 'concat_deit_*']\n"
    "FEAT_INTER_FILTERS += ['models']\n"
)


def fetch_suite(dest: Path = SUITE_DIR) -> Path:
    """Write timm's patched ``test_models.py`` for the installed timm version into ``dest``; return its path."""
    target = dest / f"test_timm_models_{timm.__version__.replace('.', '_')}.py"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               "--dest", tmp, f"timm=={timm.__version__}"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"could not fetch timm {timm.__version__} sdist: {result.stderr.strip()[-500:]}")
        (sdist,) = Path(tmp).glob("timm-*.tar.gz")
        with tarfile.open(sdist) as archive:
            member = next(m for m in archive.getmembers() if m.name.endswith("/tests/test_models.py"))
            source = archive.extractfile(member).read().decode()
    if ANCHOR not in source:
        raise RuntimeError(f"timm {timm.__version__} test_models.py changed: anchor {ANCHOR!r} not found")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "__init__.py").touch()
    partial = target.with_suffix(".partial")
    partial.write_text(source.replace(ANCHOR, PATCH + ANCHOR, 1))
    partial.replace(target)
    return target
