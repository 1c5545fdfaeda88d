"""``collab-vit convert`` on models without a head (the family table's DINOv2 and RoPE-ViT, ``num_classes=0``), in a
process of its own: the calibrated conversion scores the candidates on the features (``objective.py``: ``1 -
cosine`` to the source's), says so, and keeps the candidate whose features are nearer the source's, where a softmax
over the features (the objective every model had before) cannot tell the candidates apart."""
from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import timm
import torch

import collab_vit
import warmstart
from collab_vit.conversion.calibration import objective
from collab_vit.weights_io import export_safetensors
from tinyrun import make_image_folder

CLI = str(Path(sys.executable).parent / "collab-vit")
# the family table's DINOv2 (layer scale) made tiny, without a head and without a final norm: its features are the
# class token's residual stream, so a common shift of every feature reaches the output
KWARGS = dict(img_size=16, patch_size=4, depth=2, embed_dim=24, num_heads=3, num_classes=0, final_norm=False)
KEY_DIMS = [24, 4]  # the first layer at full rank (exact), the last one compressed


def shifting_source() -> torch.nn.Module:
    """The DINOv2 whose last attention layer writes only along the all-ones direction of the features (its
    projection has equal rows) and whose last MLP writes nothing: any error of that layer shifts every feature by
    the same amount, which a softmax over the features does not see and a cosine does."""
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch14_dinov2", **KWARGS).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.fill_(1.0)  # trained layer scales (timm initialises them at 1e-5)
            if p.dim() == 2 and ("attn" in name or "mlp" in name):
                p.mul_(8)  # attention far from uniform
        last = model.blocks[1]
        w = torch.randn(KWARGS["embed_dim"], generator=torch.Generator().manual_seed(3))
        last.attn.proj.weight.copy_(torch.ones(KWARGS["embed_dim"], 1) * w / KWARGS["embed_dim"] ** 0.5)
        last.attn.proj.bias.zero_()
        last.mlp.fc2.weight.zero_()
        last.mlp.fc2.bias.zero_()
    return model


def test_the_source_hides_the_last_layer_from_a_softmax_over_features() -> None:
    """The premise, in this process: the weight-only conversion moves the features (1 - cosine well above rounding)
    along the all-ones direction only: their softmax stays the source's to float32 rounding."""
    source = shifting_source()
    images = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    converted = collab_vit.reparametrize(copy.deepcopy(source), KEY_DIMS, progress=False)
    with torch.no_grad():
        f0, f = source(images), converted(images)
    shift = (f - f0).mean(1, keepdim=True)
    assert torch.allclose(f - f0, shift.expand_as(f), rtol=0, atol=1e-4 * float(f0.abs().max()))
    assert float(objective.scores(f, f0, "kl").abs().max()) < 1e-6
    assert float(objective.scores(f, f0, "cosine").min()) > 1e-4


def test_convert_calibrates_a_feature_model_on_its_features(tmp_path) -> None:
    """Through the command: the objective printed and recorded (cosine), every candidate scored by it, and the
    calibrated candidate kept over weight-only with a held-out cosine nearer 1. Scored by the softmax of the features
    the candidates differ by rounding only, the guard resolves none and keeps weight-only (its cosine lower)."""
    data = make_image_folder(tmp_path / "data", classes=3, train_per_class=12, val_per_class=1)
    source = tmp_path / "dinov2.safetensors"
    config = {"input_size": [3, 16, 16], "mean": [0.5] * 3, "std": [0.25] * 3, "crop_pct": 1.0,
              "interpolation": "bicubic", "crop_mode": "center"}
    export_safetensors(shifting_source().state_dict(), str(source), "vit_small_patch14_dinov2", KWARGS,
                       {"data_config": config})
    out = tmp_path / "converted.safetensors"
    done = warmstart.run([sys.executable, CLI, "convert", "--checkpoint", str(source), "--key-dim",
                          ",".join(map(str, KEY_DIMS)), "--out", str(out), "--calibration-data-dir", data,
                          "--calibration-images", "36"], tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.code == 0, done.why()
    assert "candidates, 1 - cosine to the source's features (objective: cosine) on 9 held-out images" in done.out
    summary = json.loads(out.with_suffix(".json").read_text())["calibration"]
    assert summary["objective"] == "cosine"
    assert summary["chosen"] != "weight" and summary["guard"]["kept"], summary
    assert summary["held_out_cosine"] > summary["weight_only_cosine"]
    assert abs(summary["held_out_cosine"] - (1 - summary["held_out_kl"])) < 1e-12
    assert f"held-out cosine to the source's features: {summary['held_out_cosine']:.6f}" in done.out


def test_convert_calibrates_a_rotary_feature_model_on_its_features(tmp_path) -> None:
    """The rotary family (RoPE-ViT of the family table, ``num_classes=0``), through the command: its candidates (the
    strongest-pairs selection among them) are scored by the cosine objective, recorded with the held-out cosines,
    and the one kept is never farther from the source's features than weight-only on the held-out images."""
    from collab_vit.conversion.files import families

    design = next(f.design for f in families.FAMILIES if f.name == "RoPE-ViT")
    kwargs = {**design.small_kwargs(), "num_classes": 0}
    torch.manual_seed(0)
    model = timm.create_model(design.model, **kwargs).eval()
    size = kwargs["img_size"]
    data = make_image_folder(tmp_path / "data", classes=3, train_per_class=8, val_per_class=1, size=size)
    source = tmp_path / "rope.safetensors"
    config = {"input_size": [3, size, size], "mean": [0.5] * 3, "std": [0.25] * 3, "crop_pct": 1.0,
              "interpolation": "bicubic", "crop_mode": "center"}
    export_safetensors(model.state_dict(), str(source), design.model, kwargs, {"data_config": config})
    out = tmp_path / "converted.safetensors"
    done = warmstart.run([sys.executable, CLI, "convert", "--checkpoint", str(source), "--key-dim", "8", "--out",
                          str(out), "--calibration-data-dir", data, "--effort", "fast"], tmp_path,
                         {**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.code == 0, done.why()
    assert "1 - cosine to the source's features (objective: cosine) on 6 held-out images" in done.out
    summary = json.loads(out.with_suffix(".json").read_text())["calibration"]
    assert summary["objective"] == "cosine" and set(summary["candidates"]) == {"weight", "whitened", "select"}
    assert summary["held_out_kl"] <= summary["weight_only_kl"]
    assert summary["held_out_cosine"] >= summary["weight_only_cosine"]
    assert "held-out cosine to the source's features: " in done.out
