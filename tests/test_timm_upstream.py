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


def test_tests_that_run_a_model_take_one_name_per_family(monkeypatch):
    """The configuration tests run on every name; the tests that run the model on the smallest name of each family
    (no name of the family has fewer parameters), the rebuild-from-record and generic entries included; every name
    with COLLAB_VIT_UPSTREAM_ALL=1."""
    import timm

    from conftest import upstream_wanted
    from timm_upstream import family, our_models, representatives

    names = our_models()
    chosen = representatives(names)
    assert sorted(family(n) for n in chosen) == sorted({family(n) for n in names}) and len(chosen) < len(names)
    assert {"collab_vit_converted", "collab_vit_generic", "collab_deit_tiny_patch16_224_k48"} <= chosen

    def params(name):
        return sum(p.numel() for p in timm.create_model(name, device="meta").parameters())

    for name in chosen:
        assert all(params(other) >= params(name) for other in names if family(other) == family(name)), name
    monkeypatch.delenv("COLLAB_VIT_UPSTREAM_ALL", raising=False)
    assert all(upstream_wanted("test_model_default_cfgs_non_std", n) for n in names)
    assert [n for n in names if upstream_wanted("test_model_backward", n)] == sorted(chosen)
    assert not upstream_wanted("test_model_forward", "deit_base_patch16_224")  # timm's own stay timm's
    monkeypatch.setenv("COLLAB_VIT_UPSTREAM_ALL", "1")
    assert all(upstream_wanted("test_model_backward", n) for n in names)
