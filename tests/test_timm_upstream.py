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


def test_upstream_suite_runs_every_registered_name():
    """The names timm's suite runs on come from timm's registry: every entry point of ``collab_vit`` (a new one is
    tested as soon as it is registered), the rebuild-from-record entry and the generic one included."""
    import timm

    from collab_vit.models import OWN_MODELS
    from collab_vit.models_rope import ROPE_MODELS
    from conftest import OUR_MODELS
    from timm_upstream import our_models

    assert OUR_MODELS == set(our_models()) == set(OWN_MODELS) | set(ROPE_MODELS)
    assert {"collab_vit_converted", "collab_vit_generic"} <= OUR_MODELS
    assert repr(our_models()) in PATCH
    assert not any(name in OUR_MODELS for name in timm.list_models("deit*"))  # timm's own stay timm's


def test_every_registered_name_builds_with_its_defaults():
    """timm's contract (``timm.list_models()`` sweeps, ``benchmark.py --model-list``): each registered name builds
    with no argument, here on the meta device (no memory); the suite above runs it for real."""
    import timm

    from timm_upstream import our_models

    for name in our_models():
        model = timm.create_model(name, device="meta")
        assert model.num_classes == 1000 and model.pretrained_cfg["architecture"] == name, name
