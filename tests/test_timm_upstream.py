"""timm's own model suite is part of this suite; when it cannot be had (offline, no cache), say so once, clearly."""
import pytest

from conftest import UPSTREAM
from timm_upstream import ANCHOR, PATCH


def test_timm_upstream_suite_is_present():
    if UPSTREAM["path"] is None:
        pytest.skip(f"timm upstream model suite not run: {UPSTREAM['reason']}")
    text = UPSTREAM["path"].read_text()
    assert PATCH + ANCHOR in text  # our models are treated as timm treats its DeiTs


def test_fetch_is_cached_and_offline_safe(tmp_path, monkeypatch):
    """No network and no cache: a reason, no exception; with the cache: the suite, without any download."""
    import timm_upstream

    monkeypatch.setenv("COLLAB_VIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip cannot reach any index: as offline
    path, reason = timm_upstream.fetch_suite(tmp_path / "suite")
    assert path is None and "offline, and no cached copy" in reason
    assert not (tmp_path / "suite").exists()

    cached = timm_upstream.cache_file()
    cached.parent.mkdir(parents=True)
    cached.write_text("import os\n" + ANCHOR + "\n")
    monkeypatch.setattr(timm_upstream, "download_upstream_source", lambda: pytest.fail("downloaded despite cache"))
    path, reason = timm_upstream.fetch_suite(tmp_path / "suite")
    assert reason == "" and PATCH + ANCHOR in path.read_text()
