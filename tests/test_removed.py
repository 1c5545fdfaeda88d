"""``mixing_lr_scale`` left the training config (its one measurement was inconclusive: RESULTS_HISTORY.md, "Options
removed from the public surface"); YAML configs written before may still carry it, so it answers with one line
naming why: exit 2 from ``train.py`` (in a process of its own, as ``test_every_command.py`` starts it), a ConfigError
from ``build_config``."""
from __future__ import annotations

import os
import sys

import pytest

from collab_vit.training.config import REMOVED_KEYS, build_config

from test_every_command import run
from tinyrun import ROOT

MIXING = REMOVED_KEYS["mixing_lr_scale"][1]


@pytest.mark.parametrize("args", [
    ["--mixing-lr-scale", "100"],
    ["--mixing_lr_scale=1"],
    ["-c", "{config}"],
], ids=["mixing-flag", "mixing-flag-default", "mixing-yaml"])
def test_a_removed_option_is_one_line_exit_2(args, tmp_path):
    """The removed flag or YAML key: exit 2, one stderr line (the removal's), nothing written."""
    config = tmp_path / "mixlr.yaml"
    config.write_text("mixing_lr_scale: 100.0\n")
    out = tmp_path / "out"
    args = [str(config) if a == "{config}" else a for a in args]
    done = run([sys.executable, os.path.join(ROOT, "train.py"), *args, "--output", str(out)], tmp_path)
    lines = done.err.strip().splitlines()
    assert done.code == 2 and len(lines) == 1 and "Traceback" not in done.err, done
    assert MIXING in lines[0]
    assert not out.exists()


def test_a_saved_config_with_the_old_default_still_reads(tmp_path):
    """A run's saved config.yaml holds every key, ``mixing_lr_scale: 1.0`` among them before the key was removed:
    that value (what every run trained with) reads as nothing; any other is refused."""
    config = tmp_path / "config.yaml"
    config.write_text("epochs: 3\nmixing_lr_scale: 1.0\n")
    assert build_config(str(config)).epochs == 3
    config.write_text("epochs: 3\nmixing_lr_scale: 2.0\n")
    with pytest.raises(ValueError, match="mixing_lr_scale was removed"):
        build_config(str(config))
