"""Test-suite set-up: register our models, fetch timm's model tests, and run those on our models only."""
from __future__ import annotations

import pytest
import torch

import collab_vit  # noqa: F401  (registers the models with timm before any test module is collected)
from collab_vit.models import COLLAB_MODELS, CONCAT_MODELS

from timm_upstream import SUITE_DIR, fetch_suite

OUR_MODELS = set(COLLAB_MODELS + CONCAT_MODELS)
# timm's CI selects its model tests by these markers; unmarked tests (e.g. the slow pruning contract) it skips too.
TIMM_CI_MARKERS = {"base", "forward", "backward", "cfg", "cfg_nonstd", "torchscript", "features", "fxforward",
                   "fxbackward"}


@pytest.fixture(scope="module")
def one_thread():
    """Small matrices on a busy 2-core machine: OpenMP threads cost more than they save."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_configure(config: pytest.Config) -> None:
    for marker in sorted(TIMM_CI_MARKERS):
        config.addinivalue_line("markers", f"{marker}: timm model-test marker")
    fetch_suite()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep timm's own tests only where timm's CI would run them and they are parametrised by one of our models."""
    kept, dropped = [], []
    for item in items:
        if SUITE_DIR not in item.path.parents:
            kept.append(item)
            continue
        params = getattr(item, "callspec", None)
        model = params.params.get("model_name") if params else None
        in_timm_ci = any(mark.name in TIMM_CI_MARKERS for mark in item.iter_markers())
        (kept if model in OUR_MODELS and in_timm_ci else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
