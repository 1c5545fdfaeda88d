"""Fetch timm's own model test-suite (``tests/test_models.py`` of the installed timm's sdist) to run on our models.

timm ships its tests only in the source distribution, so it is downloaded once with pip (``--no-binary :all:``) and
kept in a cache (``$COLLAB_VIT_CACHE`` or ``~/.cache/collab-vit``); later runs, offline ones too, use the cache.
Our model patterns are added to the two lists that say how timm treats DeiT-like models: ``NON_STD_FILTERS`` (ViTs
have no spatial feature maps, exactly as timm's own ``deit*``) and ``FEAT_INTER_FILTERS`` (modules whose models
support ``forward_intermediates``; ours live in the modules ``collab_vit.models`` and ``collab_vit.models_rope``, read
from the registry too).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Iterable, Optional

import timm

import collab_vit  # noqa: F401  (registers the models whose names the patch lists)


def our_models() -> list[str]:
    """Every name this package registers with timm, read from timm's registry (not a hand list): the names whose
    entry point lives in ``collab_vit``."""
    return sorted(name for name in timm.list_models()
                  if timm.models.model_entrypoint(name).__module__.split(".")[0] == "collab_vit")


SIZES = ("tiny", "small", "base")


def family(name: str) -> str:
    """``name`` with its size and its fixed key dim as wildcards: the names of one family differ only in width and
    depth (DeiT-Ti/S/B, ViT-S/B) and in the key dim the name fixes (``_k{N}``), not in code."""
    return re.sub(r"_k\d+$", "_k*", re.sub(r"_(tiny|small|base)_", "_*_", name))


def representatives(names: Iterable[str]) -> set[str]:
    """The smallest name of each :func:`family` (tiny before small before base, then the smallest fixed key dim)."""
    def size(name: str) -> tuple[int, int]:
        width, key_dim = re.search(r"_(tiny|small|base)_", name), re.search(r"_k(\d+)$", name)
        return SIZES.index(width.group(1)) if width else 0, int(key_dim.group(1)) if key_dim else 0

    smallest: dict[str, str] = {}
    for name in sorted(names, key=lambda n: (size(n), n)):
        smallest.setdefault(family(name), name)
    return set(smallest.values())


def our_modules() -> list[str]:
    """The modules (timm's short names) that hold our entry points."""
    return sorted({timm.models.model_entrypoint(name).__module__.split(".")[-1] for name in our_models()})


SUITE_DIR = Path(__file__).parent / "timm_upstream_suite"
ANCHOR = "NUM_NON_STD = len(NON_STD_FILTERS)"
PATCH = (
    "# collab-vit: treat our models as timm treats its DeiTs (see tests/timm_upstream.py)\n"
    f"NON_STD_FILTERS += {our_models()!r}\n"
    f"FEAT_INTER_FILTERS += {our_modules()!r}\n"
)


def cache_file() -> Path:
    root = Path(os.environ.get("COLLAB_VIT_CACHE") or Path.home() / ".cache" / "collab-vit")
    return root / "timm-tests" / f"timm-{timm.__version__}-test_models.py"


def download_upstream_source() -> str:
    """timm's ``tests/test_models.py`` for the installed version, from its sdist on PyPI (raises when offline)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               "--dest", tmp, f"timm=={timm.__version__}"]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise RuntimeError(f"could not fetch timm {timm.__version__} sdist: {last}")
        (sdist,) = Path(tmp).glob("timm-*.tar.gz")
        with tarfile.open(sdist) as archive:
            member = next(m for m in archive.getmembers() if m.name.endswith("/tests/test_models.py"))
            return archive.extractfile(member).read().decode()


def fetch_suite(dest: Path = SUITE_DIR) -> tuple[Optional[Path], str]:
    """Write timm's patched ``test_models.py`` into ``dest``: ``(path, '')``, or ``(None, reason)`` when it cannot be
    had (offline with no cache). The unpatched source is cached, so the download happens once per timm version."""
    target = dest / f"test_timm_models_{timm.__version__.replace('.', '_')}.py"
    if target.exists() and PATCH + ANCHOR in target.read_text():  # else written by an older patch: rewritten
        return target, ""
    cached = cache_file()
    if not cached.exists():
        try:
            source = download_upstream_source()
        except (RuntimeError, OSError, subprocess.SubprocessError, StopIteration) as error:
            return None, f"{error} (offline, and no cached copy at {cached})"
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(".partial")
        partial.write_text(source)
        partial.replace(cached)
    source = cached.read_text()
    if ANCHOR not in source:
        return None, f"timm {timm.__version__} test_models.py changed: anchor {ANCHOR!r} not found"
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "__init__.py").touch()
    partial = target.with_suffix(".partial")
    partial.write_text(source.replace(ANCHOR, PATCH + ANCHOR, 1))
    partial.replace(target)
    return target, ""


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub (timm's pretrained weights) answers: ``test_model_load_pretrained`` needs it."""
    import socket
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def remove_stale_suites(keep: Optional[Path], dest: Path = SUITE_DIR) -> None:
    """Suites of other timm versions would run against the installed timm: remove them."""
    if dest.exists():
        for path in dest.glob("test_timm_models_*.py"):
            if path != keep:
                path.unlink()
        shutil.rmtree(dest / "__pycache__", ignore_errors=True)
