"""Test-suite set-up: register our models, fetch timm's model tests, and run those on our models only."""
from __future__ import annotations

import os
import signal

import pytest
import torch

import collab_vit  # noqa: F401  (registers the models with timm before any test module is collected)
from timm_upstream import SUITE_DIR, fetch_suite, hub_reachable, our_models, remove_stale_suites, representatives

OUR_MODELS = set(our_models())  # every name the package registers, from timm's registry
# timm's tests that check a name's configuration run on every name; those that run the model (forward, backward, fx,
# torchscript, intermediates: seconds to a minute per name on 2 cores) on the smallest name of each family
# (``timm_upstream.representatives``: the names of a family differ only in width, depth and fixed key dim).
# COLLAB_VIT_UPSTREAM_ALL=1 runs every test on every name (docs/testing.md gives the command and its last result).
PER_NAME_TESTS = {"test_model_default_cfgs", "test_model_default_cfgs_non_std", "test_model_load_pretrained"}
REPRESENTATIVES = representatives(OUR_MODELS)
# Needs timm's pretrained weights from the Hugging Face hub; skipped (with this reason) when the hub is unreachable.
NETWORK_TESTS = {"test_model_load_pretrained": "downloads pretrained weights from the Hugging Face hub"}
# timm's own note: "no marker, slow (prunes every model at every feature index)". At 224 px it takes 30-45 s per
# model on 2 cores, so the suite runs it on the smallest DeiT: the collaborative and concatenate DeiTs are one class
# (``CollabVisionTransformer``, whose pruning this checks; both attentions run in the forward tests on each family);
# COLLAB_VIT_UPSTREAM_ALL=1 runs it on every model (docs/testing.md gives the command and its last result).
SLOW_TESTS = {"test_prune_intermediate_layers_contract": {"collab_deit_tiny_patch16_224_k48"}}
UPSTREAM: dict = {"path": None, "reason": ""}


@pytest.fixture(scope="module")
def one_thread():
    """Small matrices on a busy 2-core machine: OpenMP threads cost more than they save."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_configure(config: pytest.Config) -> None:
    # A shell starting the suite in the background (``cmd &`` without job control, nohup) ignores SIGINT in it and in
    # every process it starts, so the Ctrl-C tests would send a signal nobody receives: give the suite, and through
    # it the processes the tests start, the handler a terminal's foreground process has.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for marker in ("base", "forward", "backward", "cfg", "cfg_nonstd", "torchscript", "features", "fxforward",
                   "fxbackward"):
        config.addinivalue_line("markers", f"{marker}: timm model-test marker")
    UPSTREAM["path"], UPSTREAM["reason"] = fetch_suite()
    remove_stale_suites(UPSTREAM["path"])


def pytest_report_header(config: pytest.Config) -> str:
    if UPSTREAM["path"] is None:
        return f"timm upstream model suite: SKIPPED - {UPSTREAM['reason']}"
    return f"timm upstream model suite: {UPSTREAM['path'].name} (all its tests, on our models)"


def upstream_wanted(test: str, model: object) -> bool:
    """Whether timm's ``test`` runs on ``model``: one of our names, on every name for the configuration tests, on the
    family's smallest name for the others (``SLOW_TESTS``: on the names listed), on every name with
    COLLAB_VIT_UPSTREAM_ALL=1."""
    if model not in OUR_MODELS:
        return False
    subset = SLOW_TESTS.get(test, None if test in PER_NAME_TESTS else REPRESENTATIVES)
    return subset is None or model in subset or bool(os.environ.get("COLLAB_VIT_UPSTREAM_ALL"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep every timm test parametrised by one of our models, as timm runs its suite on a developer's machine (not
    only its CI markers), those that run the model on one name per family; the network-bound ones skip, with the
    reason, when the hub is unreachable."""
    kept, dropped = [], []
    online = None
    for item in items:
        if SUITE_DIR not in item.path.parents:
            kept.append(item)
            continue
        params = getattr(item, "callspec", None)
        model = params.params.get("model_name") if params else None
        base_model = model.split(".")[0] if isinstance(model, str) else None
        if not upstream_wanted(item.originalname, base_model):
            dropped.append(item)
            continue
        if item.originalname in NETWORK_TESTS:
            online = hub_reachable() if online is None else online
            if not online:
                item.add_marker(pytest.mark.skip(reason=f"offline: {NETWORK_TESTS[item.originalname]}"))
        kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
