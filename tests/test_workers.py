"""Data-loader workers default to what the machine gives this process (never more than its CPUs); an explicit
``-j`` / ``num_workers`` is honoured as given."""
from __future__ import annotations

import os
import warnings

import pytest

from collab_vit.training import config, eval_cli

from tinyrun import TINY_KWARGS, TINY_MODEL, make_image_folder


def cpus(monkeypatch: pytest.MonkeyPatch, count: int, affinity: bool = True) -> None:
    """This process may use ``count`` CPUs: through its affinity mask, or (``affinity=False``: an OS without one)
    through ``os.cpu_count``."""
    if affinity:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(count)), raising=False)
    else:
        monkeypatch.delattr(os, "sched_getaffinity", raising=False)
        monkeypatch.setattr(os, "cpu_count", lambda: count)


@pytest.mark.parametrize("affinity", [True, False], ids=["affinity", "cpu_count"])
def test_defaults_follow_the_cpus_and_explicit_values_stay(monkeypatch: pytest.MonkeyPatch, affinity: bool) -> None:
    cpus(monkeypatch, 2, affinity)
    assert eval_cli.parse_args(["--data-dir", "d"]).workers == 2
    assert eval_cli.parse_args(["--data-dir", "d", "-j", "3"]).workers == 3
    assert config.build_config(None).num_workers == 2
    assert config.parse_train_args(["-j", "3"]).num_workers == 3
    assert "(default: 2)" in " ".join(config.build_parser().format_help().split())
    cpus(monkeypatch, 64, affinity)  # a large machine: the old defaults
    assert eval_cli.parse_args(["--data-dir", "d"]).workers == 4
    assert config.build_config(None).num_workers == 8


def test_eval_starts_no_more_workers_than_cpus(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """eval.py as the README shows it (no ``-j``) on a 2-CPU affinity: torch does not warn of too many workers."""
    data = make_image_folder(tmp_path / "data", classes=3, train_per_class=1, val_per_class=2)
    cpus(monkeypatch, 2)
    kwargs = [f"{k}={v}" for k, v in TINY_KWARGS.items()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert eval_cli.main(["--model", TINY_MODEL, "--model-kwargs", *kwargs, "--num-classes", "3", "--img-size",
                              "32", "--data-dir", data, "-b", "2", "--cpu-threads", "1"]) == 0
    assert not [str(w.message) for w in caught if "worker processes" in str(w.message)]
