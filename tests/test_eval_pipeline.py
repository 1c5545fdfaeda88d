"""A conversion is evaluated as its source: the pipeline (crop, interpolation, mean/std, size) travels with it, eval.py
uses identical transforms on the source and on its conversions and records the pipeline; the ``.fb_in1k`` variants
(the paper's grid names too) convert timm's DeiT weights on load and carry timm's cfg of those weights."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
import torch
from timm.models import get_pretrained_cfg

import collab_vit
from collab_vit.conversion.files.commands import convert_to_file
from collab_vit.models import COLLAB_MODELS
from collab_vit.training import eval_cli
from collab_vit.weights_io import EVAL_KEYS

from tinyrun import make_image_folder

SMALL = dict(img_size=32, patch_size=8, depth=2)  # DeiT-Ti width (192, 3 heads), 2 blocks, 17 tokens

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def deit_file(tmp_path_factory) -> str:
    """A 'pretrained' small DeiT-Ti with 3 classes, written as DeiT's own .pth layout (no hub here)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("weights") / "deit_tiny.pth"
    torch.save({"model": timm.create_model("deit_tiny_patch16_224", num_classes=3, **SMALL).state_dict()}, path)
    return str(path)


def from_file(name: str, source: str, **kwargs) -> torch.nn.Module:
    overlay = dict(file=source, num_classes=3)  # the file's head (timm drops one unlike its cfg's 1000 classes)
    return timm.create_model(name, pretrained=True, num_classes=3, pretrained_cfg_overlay=overlay, **SMALL, **kwargs)


def timm_deit_pipeline() -> dict:
    cfg = get_pretrained_cfg("deit_tiny_patch16_224.fb_in1k").to_dict()
    return {k: cfg[k] for k in EVAL_KEYS}


def test_fb_in1k_variants_carry_timms_cfg_of_the_weights() -> None:
    for name in COLLAB_MODELS:
        size = name.split("_")[2]
        ours, source = (get_pretrained_cfg(n).to_dict() for n in (f"{name}.fb_in1k", f"deit_{size}_patch16_224.fb_in1k"))
        assert {k: ours[k] for k in EVAL_KEYS} == {k: source[k] for k in EVAL_KEYS}, name
        assert ours["hf_hub_id"] == source["hf_hub_id"] and ours["crop_pct"] == 0.9
        assert timm.create_model(name, device="meta").pretrained_cfg["crop_pct"] == 0.875  # from scratch: DeiT's


def test_grid_name_converts_on_load_like_the_keyword(deit_file: str, tmp_path: Path, monkeypatch) -> None:
    """``collab_deit_tiny_patch16_224_k96`` with ``pretrained=True`` is ``collab_deit_tiny_patch16_224`` with
    ``key_dim=96`` (it used to raise "No pretrained weights exist")."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    by_name = from_file("collab_deit_tiny_patch16_224_k96", deit_file).eval()
    by_keyword = from_file("collab_deit_tiny_patch16_224", deit_file, key_dim=96).eval()
    assert [b.attn.key_dim for b in by_name.blocks] == [96, 96]
    a, b = by_name.state_dict(), by_keyword.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert by_name.pretrained_cfg["crop_pct"] == by_keyword.pretrained_cfg["crop_pct"] == 0.9


def evaluated(tmp_path: Path, data: str, monkeypatch, *flags: str) -> tuple[dict, str]:
    """eval.py's results and the transform its loader applied."""
    seen = []
    original = eval_cli.build_eval_loader
    monkeypatch.setattr(eval_cli, "build_eval_loader",
                        lambda dataset, *a, **k: seen.append(original(dataset, *a, **k)) or seen[-1])
    out = tmp_path / f"results_{len(list(tmp_path.glob('results_*')))}.json"
    assert eval_cli.main([*flags, "--data-dir", data, "--workers", "0", "--batch-size", "4", "--cpu-threads", "1",
                          "--device", "cpu", "--output", str(out)]) == 0
    return json.loads(out.read_text()), str(seen[0].dataset.transform)


def test_source_and_conversions_get_identical_transforms(deit_file: str, tmp_path: Path, monkeypatch) -> None:
    """timm DeiT weights (.pth), the same converted in memory and saved as a folder, converted by ``collab-vit
    convert`` into a file, and converted on load by eval.py: one pipeline, timm's cfg of the source weights, recorded
    in the results."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    data = make_image_folder(tmp_path / "data", classes=3, train_per_class=1, val_per_class=2, size=48)
    source = collab_vit.reparametrize(from_file("deit_tiny_patch16_224", deit_file), key_dim=96, progress=False)
    collab_vit.save_pretrained(source, str(tmp_path / "folder"))
    convert_to_file("deit_tiny_patch16_224", 96, tmp_path / "file.safetensors", checkpoint=deit_file,
                    model_kwargs=dict(num_classes=3, **SMALL))
    runs = [evaluated(tmp_path, data, monkeypatch, "--model", "deit_tiny_patch16_224", "--checkpoint", deit_file,
                      "--model-kwargs", "img_size=32", "patch_size=8", "depth=2"),
            evaluated(tmp_path, data, monkeypatch, "--checkpoint", str(tmp_path / "folder")),
            evaluated(tmp_path, data, monkeypatch, "--checkpoint", str(tmp_path / "file.safetensors")),
            evaluated(tmp_path, data, monkeypatch, "--model", "collab_deit_tiny_patch16_224", "--checkpoint", deit_file,
                      "--model-kwargs", "key_dim=96", "img_size=32", "patch_size=8", "depth=2")]  # converted on load
    (first, transform), *others = runs
    expected = {**timm_deit_pipeline(), "input_size": [3, 32, 32]}
    assert {k: list(v) if isinstance(v, tuple) else v for k, v in expected.items()} == first["data_config"]
    for results, other_transform in others:
        assert results["data_config"] == first["data_config"] and other_transform == transform
    assert "Resize(size=35" in transform  # 32 / 0.9, bicubic: timm's DeiT evaluation, not DeiT's 0.875 (36)
    assert runs[1][0]["model"] == runs[2][0]["model"] == runs[3][0]["model"] == "collab_deit_tiny_patch16_224"


def test_data_config_from_another_checkpoint(deit_file: str, tmp_path: Path, monkeypatch) -> None:
    """``--data-config-from`` (the post-hoc table's fine-tuned row): the weights of one checkpoint, the pipeline of
    another; one that records none is a one-line error."""
    data = make_image_folder(tmp_path / "data", classes=3, train_per_class=1, val_per_class=2, size=48)
    model = collab_vit.reparametrize(from_file("deit_tiny_patch16_224", deit_file), progress=False)
    collab_vit.save_pretrained(model, str(tmp_path / "source"))
    collab_vit.save_pretrained(model, str(tmp_path / "other"), data_config=dict(crop_pct=0.5))
    results, transform = evaluated(tmp_path, data, monkeypatch, "--checkpoint", str(tmp_path / "other"),
                                   "--data-config-from", str(tmp_path / "source"))
    assert results["data_config"]["crop_pct"] == 0.9 and "Resize(size=35" in transform
    assert eval_cli.main(["--checkpoint", str(tmp_path / "other"), "--data-dir", data,
                          "--data-config-from", deit_file]) == 2
