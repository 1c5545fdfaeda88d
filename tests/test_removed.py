"""What left the public surface in issue 54 (no measurement kept it) answers with one line naming what replaced it:
exit 2 on the command line (``collab-vit``, ``train.py``, each in a process of its own: ``warmstart``, as
``test_every_command.py`` starts them), a TypeError / ValueError / ImportError in Python. What replaced each still
runs."""
from __future__ import annotations

import os
import sys

import pytest
import timm
import torch

import collab_vit
from collab_vit.conversion.weights.dims import REMOVED
from collab_vit.training.config import REMOVED_KEYS, build_config

from test_every_command import collab_vit_command, run
from tinyrun import ROOT

SOURCE = ["--model", "deit_tiny_patch16_224", "--checkpoint", "none", "--model-kwargs", "img_size=32", "patch_size=8",
          "depth=1", "embed_dim=48", "num_heads=3"]
MIXING = REMOVED_KEYS["mixing_lr_scale"][1]


@pytest.mark.parametrize("args, message", [
    (["convert", *SOURCE, "--key-dim", "budget=0.25"], REMOVED["budget"]),
    (["convert", *SOURCE, "--key-dim", "0.95"], REMOVED["threshold"]),
    (["convert", *SOURCE, "--key-dim", "8", "--method", "cp"], REMOVED["method"]),
    (["convert", *SOURCE, "--key-dim", "8", "--method", "tucker"], REMOVED["method"]),
    (["convert", *SOURCE, "--key-dim", "8", "--effort", "thorough"], REMOVED["thorough"]),
    (["train.py", "--mixing-lr-scale", "100"], MIXING),
    (["train.py", "--mixing_lr_scale=1"], MIXING),
    (["train.py", "-c", "{config}"], MIXING),
], ids=["budget", "threshold", "method-cp", "method-tucker", "thorough", "mixing-flag", "mixing-flag-default",
        "mixing-yaml"])
def test_a_removed_option_is_one_line_exit_2(args, message, tmp_path):
    """Each removed flag, value or YAML key: exit 2, one stderr line (the removal's), nothing written."""
    config = tmp_path / "mixlr.yaml"
    config.write_text("mixing_lr_scale: 100.0\n")
    out = tmp_path / "out"
    args = [str(config) if a == "{config}" else a for a in args]
    if args[0] == "train.py":
        command = [sys.executable, os.path.join(ROOT, "train.py"), *args[1:], "--output", str(out)]
    else:
        command = [collab_vit_command(), *args, "--out", str(out / "m.safetensors")]
    done = run(command, tmp_path)
    lines = done.err.strip().splitlines()
    assert done.code == 2 and len(lines) == 1 and "Traceback" not in done.err, done
    assert message in lines[0]
    assert not out.exists()


def test_a_saved_config_with_the_old_default_still_reads(tmp_path):
    """A run's saved config.yaml holds every key, ``mixing_lr_scale: 1.0`` among them before issue 54: that value
    (what every run trained with) reads as nothing; any other is refused."""
    config = tmp_path / "config.yaml"
    config.write_text("epochs: 3\nmixing_lr_scale: 1.0\n")
    assert build_config(str(config)).epochs == 3
    config.write_text("epochs: 3\nmixing_lr_scale: 2.0\n")
    with pytest.raises(ValueError, match="mixing_lr_scale was removed"):
        build_config(str(config))


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("deit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, embed_dim=48, num_heads=3,
                             num_classes=3).eval()


@pytest.mark.parametrize("call, error, message", [
    (lambda m: collab_vit.reparametrize(m, 8, method="cp"), TypeError, REMOVED["method"]),
    (lambda m: collab_vit.reparametrize(m, "budget=0.25"), ValueError, REMOVED["budget"]),
    (lambda m: collab_vit.reparametrize(m, 0.95), ValueError, REMOVED["threshold"]),
    (lambda m: collab_vit.reparametrize(m, 8, calibration=torch.randn(4, 3, 32, 32), effort="thorough"), ValueError,
     REMOVED["thorough"]),
    (lambda m: collab_vit.reparametrize_attention(m.blocks[0].attn, 8, method="parafac"), TypeError,
     REMOVED["method"]),
    (lambda m: collab_vit.reparametrize_attention(m.blocks[0].attn, 0.9), ValueError, REMOVED["threshold"]),
    (lambda m: collab_vit.reparametrize(m, 8, bogus=1), TypeError, "unexpected keyword arguments ['bogus']"),
    (lambda m: timm.create_model("collab_deit_tiny_patch16_224", conversion_method="cp"), ValueError,
     REMOVED["method"]),
], ids=["method", "budget", "threshold", "thorough", "attention-method", "attention-threshold", "unknown",
        "model-kwarg-method"])
def test_a_removed_argument_names_its_replacement(call, error, message):
    """Removed before any weight changes: the model is as it was."""
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error) as caught:
        call(model)
    assert message in str(caught.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", ["Budget", "reparametrize_layers"])
def test_a_removed_name_says_what_replaced_it(name):
    with pytest.raises(ImportError, match=REMOVED[name][:30]):
        exec(f"from collab_vit import {name}")
    with pytest.raises(ImportError, match=REMOVED[name][:30]):
        getattr(collab_vit.conversion, name)
    assert not hasattr(collab_vit, "no_such_name")


def test_what_replaced_them_runs():
    """``--key-dim K`` / ``key_dim=K`` and the per-layer list, Tucker, effort fast: one line each, still converting."""
    model, report = collab_vit.reparametrize(tiny(), [8], effort="fast", progress=False, return_report=True)
    assert [r.key_dim for r in report] == [8] and type(model.blocks[0].attn).__name__ == "CollaborativeAttention"
