"""``collab-vit convert`` with calibration images: flags, the file it writes, one-line errors with nothing written."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
import torch

from collab_vit.cli import build_parser, main as cli_main
from collab_vit.weights_io import export_safetensors
from tinyrun import make_image_folder

pytestmark = pytest.mark.usefixtures("one_thread")

KWARGS = dict(img_size=16, patch_size=4, depth=2, embed_dim=24, num_heads=3, num_classes=3)


def exported(tmp_path, in_chans: int = 3, size: int = 16) -> str:
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", in_chans=in_chans, **KWARGS).eval()
    data_config = {"input_size": [in_chans, size, size], "mean": [0.5] * in_chans, "std": [0.25] * in_chans,
                   "crop_pct": 1.0, "interpolation": "bicubic", "crop_mode": "center"}
    path = tmp_path / f"source_c{in_chans}_s{size}.safetensors"
    export_safetensors(model.state_dict(), str(path), "deit_tiny_patch16_224", {**KWARGS, "in_chans": in_chans},
                       {"data_config": data_config})
    return str(path)


def test_help_fits_one_screen_with_its_flags() -> None:
    convert = build_parser()._subparsers._group_actions[0].choices["convert"]
    text = convert.format_help()
    for flag in ("--model", "--checkpoint", "--model-kwargs", "--key-dim", "--out", "--seed", "--device",
                 "--calibration-data-dir", "--calibration-dataset", "--calibration-images",
                 "--effort"):
        assert flag in text
    assert "--method" not in text and "budget" not in text and "thorough" not in text  # removed (RESULTS_HISTORY.md)
    flags = [a for a in convert._actions if a.option_strings and a.dest != "help"]
    assert len(flags) <= 12 and len(text.splitlines()) <= 60


def test_convert_with_calibration_images(tmp_path, capsys) -> None:
    data = make_image_folder(tmp_path / "data", classes=3, train_per_class=4, val_per_class=1)
    out = tmp_path / "k6.safetensors"
    assert cli_main(["convert", "--checkpoint", exported(tmp_path), "--key-dim", "6", "--out", str(out),
                     "--calibration-data-dir", data, "--calibration-images", "10"]) == 0
    sidecar = json.loads(out.with_suffix(".json").read_text())
    calibration = sidecar["calibration"]
    assert calibration["images_fit"] == 8 and calibration["images_held_out"] == 2
    assert calibration["effort"] == "default" and calibration["refine_steps"] == 1  # ceil(8 passes x 8 / 64)
    assert calibration["held_out_kl"] <= calibration["weight_only_kl"] and calibration["prefix_weight"] == 16.0
    assert all(layer["error_tokens"] == "2 held-out calibration images" for layer in sidecar["layers"])
    assert f"kept {calibration['chosen']}" in capsys.readouterr().out


def test_calibration_from_the_training_split_or_a_plain_image_folder(tmp_path) -> None:
    """Calibration never comes from an evaluation split: a root with train/ gives its training images; a folder of
    class folders without one (e.g. only ImageNet's val/ at hand) is used as it is."""
    data = make_image_folder(tmp_path / "data", classes=3, train_per_class=4, val_per_class=2)
    for root, count in ((data, 12), (str(Path(data) / "val"), 6)):
        out = tmp_path / f"k{count}.safetensors"
        assert cli_main(["convert", "--checkpoint", exported(tmp_path), "--key-dim", "6", "--out", str(out),
                         "--calibration-data-dir", root, "--calibration-images", "64", "--effort", "fast"]) == 0
        calibration = json.loads(out.with_suffix(".json").read_text())["calibration"]
        assert calibration["images_fit"] + calibration["images_held_out"] == count


def test_convert_with_a_per_layer_list_and_removed_flags(tmp_path, capsys) -> None:
    data = make_image_folder(tmp_path / "data", classes=3, train_per_class=4, val_per_class=1)
    out = tmp_path / "b.safetensors"
    assert cli_main(["convert", "--checkpoint", exported(tmp_path), "--key-dim", "4,8", "--out", str(out),
                     "--calibration-data-dir", data, "--calibration-images", "10", "--effort", "fast"]) == 0
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["model_kwargs"]["key_dim"] == [4, 8] and sidecar["method"] == "tucker"
    for removed in (["--refine-steps", "3"], ["--calibration-capture", "sequential"], ["--refine-values"]):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["convert", "--checkpoint", exported(tmp_path), "--key-dim", "6", "--out",
                      str(tmp_path / "x.safetensors"), *removed])
        assert exit_info.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()


def test_rgb_calibration_images_feed_a_one_channel_model_as_grayscale(tmp_path, capsys) -> None:
    """Calibration images are converted to the model's channels as timm's train.py and validate.py convert them
    (``L`` for one channel, ``RGB`` for three): RGB PNGs calibrate a one-channel model exactly as the same images
    stored in grayscale do."""
    from PIL import Image
    from safetensors.torch import load_file

    rgb = make_image_folder(tmp_path / "rgb", classes=2, train_per_class=4, val_per_class=1)
    gray = tmp_path / "gray"
    for path in sorted(Path(rgb).rglob("*.png")):
        target = gray / path.relative_to(rgb)
        target.parent.mkdir(parents=True, exist_ok=True)
        Image.open(path).convert("L").save(target)
    source = exported(tmp_path, in_chans=1)
    outs = [tmp_path / "from_rgb.safetensors", tmp_path / "from_gray.safetensors"]
    for data, out in zip((rgb, str(gray)), outs):
        assert cli_main(["convert", "--checkpoint", source, "--key-dim", "6", "--out", str(out),
                         "--calibration-data-dir", data, "--effort", "fast"]) == 0
    assert capsys.readouterr().out.count("held-out KL") == 2  # calibrated, both
    a, b = (load_file(out) for out in outs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("case, message", [
    ("size", "calibration images are 20x20 px, the model takes 16x16"),
    ("empty", "no images"),
    ("count", "--calibration-images must be a positive integer, got 0"),
    ("no dir", "needs --calibration-data-dir"),
])
def test_bad_calibration_input_is_one_line_and_writes_nothing(tmp_path, capsys, case: str, message: str) -> None:
    data = make_image_folder(tmp_path / "data", classes=2, train_per_class=2, val_per_class=1)
    source = exported(tmp_path, size=20 if case == "size" else 16)
    flags = ["--calibration-data-dir", data]
    if case == "empty":
        (tmp_path / "empty" / "train").mkdir(parents=True)
        flags = ["--calibration-data-dir", str(tmp_path / "empty")]
    elif case == "count":
        flags += ["--calibration-images", "0"]
    elif case == "no dir":
        flags = ["--calibration-dataset", "torch/fashion_mnist"]
    out = tmp_path / "bad.safetensors"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["convert", "--checkpoint", source, "--key-dim", "6", "--out", str(out), *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not out.with_suffix(".json").exists()


def test_analyze_with_calibration_uses_the_whitened_spectrum(tmp_path, capsys) -> None:
    data = make_image_folder(tmp_path / "data", classes=2, train_per_class=3, val_per_class=1)
    source = exported(tmp_path)
    capsys.readouterr()
    assert cli_main(["analyze", "--checkpoint", source, "--out", str(tmp_path / "w"),
                     "--calibration-data-dir", data, "--calibration-images", "5"]) == 0
    assert "spectrum of the bilinear forms: whitened by 5 calibration images" in capsys.readouterr().out
    assert cli_main(["analyze", "--checkpoint", source, "--out", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "spectrum of the bilinear forms: weights" in out and "suggested key_dim" in out and "budget" not in out


def test_the_command_holds_out_a_quarter_up_to_256_and_guards_at_the_frozen_confidence(tmp_path) -> None:
    """The frozen defaults (RESULTS.md (b), "The constants") reach the user through the installed ``collab-vit convert``
    in a process of its own (``warmstart``): of 1040 calibration images (a quarter would be 260) 256 are held out, and
    the guard's verdicts are at the package's confidence."""
    import os
    import sys

    import warmstart
    from collab_vit.conversion.calibration.recipe import MAX_HOLDOUT, Recipe

    data = make_image_folder(tmp_path / "data", classes=4, train_per_class=260, val_per_class=1, size=12)
    out = tmp_path / "k6.safetensors"
    cli = str(Path(sys.executable).parent / "collab-vit")
    done = warmstart.run([sys.executable, cli, "convert", "--checkpoint", exported(tmp_path), "--key-dim", "6",
                          "--out", str(out), "--calibration-data-dir", data, "--calibration-images", "1040",
                          "--effort", "fast"], tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.code == 0 and "Traceback" not in done.err, done.why()
    calibration = json.loads(out.with_suffix(".json").read_text())["calibration"]
    assert calibration["images_held_out"] == MAX_HOLDOUT == 256 and calibration["images_fit"] == 1040 - 256
    assert {v["confidence"] for v in calibration["verdicts"].values()} == {Recipe().confidence}
