"""``collab-vit convert`` at its edges, run as a user runs it (a new process, stderr to a file), on the standard
(DeiT) and the rotary (RoPE-ViT) family: an ``--out`` folder that is missing or read-only is one line before any
work; every bad flag value is one line; the weight-only progress in a log is plain lines; the report's per-layer
output errors are measured on the images the guard holds out; the cost line comes before the calibration images are
decoded, and they are held as uint8 pixels (their memory measured in a fresh process; that they convert bit for bit
as the float images do, in this one)."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import timm
import torch
from safetensors.torch import load_file

import warmstart
from resident import REPORT, WATCH
from collab_vit.cli import calibration_loader
from collab_vit.conversion.calibration.capture import calibration_images
from collab_vit.conversion.calibration.guard import held_out_split
from collab_vit.conversion.calibration.recipe import split
from collab_vit.conversion.files.families import SMALL
from collab_vit.conversion.reparam import probe_input_size, timm_attention_layers
from collab_vit.conversion.weights.fit import output_error
from collab_vit.conversion.weights.rotary import layer_calls
from collab_vit.weights_io import read_weights
from faultfs import listing
from tinyrun import make_image_folder

CLI = str(Path(sys.executable).parent / "collab-vit")
FAMILIES = {"standard": "deit_tiny_patch16_224", "rotary": "vit_small_patch16_rope_224"}
IMAGES = 16  # calibration images: 12 fitted, 4 held out


def source_flags(family: str) -> list[str]:
    """A tiny random-weight source of ``family`` (``--checkpoint none``, seeded by ``--seed``, 0 here)."""
    return ["--model", FAMILIES[family], "--checkpoint", "none", "--model-kwargs",
            *(f"{k}={v}" for k, v in SMALL.items())]


def run(cwd: Path, *args: str) -> warmstart.Done:
    return warmstart.run([sys.executable, CLI, *args], cwd, {**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return Path(make_image_folder(tmp_path_factory.mktemp("edges") / "data", classes=2, train_per_class=IMAGES // 2,
                                  val_per_class=1, size=40))


def convert_args(family: str, out: Path, data: Path, calibrated: bool, *extra: str) -> list[str]:
    images = ["--calibration-data-dir", str(data), "--calibration-images", str(IMAGES), "--effort", "fast"]
    return ["convert", *source_flags(family), "--key-dim", "8", "--out", str(out), *(images if calibrated else []),
            *extra]


def refused(done: warmstart.Done, message: str) -> str:
    """The one stderr line of a refusal (exit 2, no traceback, nothing on stdout: no cost line, no report)."""
    lines = done.err.strip().splitlines()
    assert done.code == 2 and len(lines) == 1 and "Traceback" not in done.err and not done.out, done.why()
    assert lines[0].startswith("collab-vit ") and message in lines[0], lines[0]
    return lines[0]


@contextlib.contextmanager
def unwritable(folder: Path) -> Iterator[Path]:
    """``folder``, empty and unwritable for this process: mode 555 for a user; for root, whom mode bits do not stop,
    a read-only tmpfs mounted there (skipped, saying so, where mounting is impossible)."""
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield folder
        finally:
            folder.chmod(0o755)
        return
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True,
                          text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a read-only tmpfs as root here ({done.stderr.strip()})")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@pytest.mark.parametrize("calibrated", [False, True], ids=["weight-only", "calibrated"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_out_in_a_missing_folder_is_refused_before_any_work(family, calibrated, data, tmp_path) -> None:
    """A mistyped folder is not created: one line naming it, exit 2, before the model is built or an image read
    (the nonexistent checkpoint would be named if the model were read first), nothing written."""
    out = tmp_path / "typo" / "model.safetensors"
    done = run(tmp_path, *convert_args(family, out, data, calibrated), "--checkpoint", str(tmp_path / "nothing.pth"))
    line = refused(done, f"--out {out}: its folder {tmp_path / 'typo'} does not exist (create it first")
    assert "checkpoint" not in line and not (tmp_path / "typo").exists()


def test_analyze_out_in_a_missing_folder_is_refused_the_same_way(data, tmp_path) -> None:
    out = tmp_path / "typo" / "spectrum"
    done = run(tmp_path, "analyze", *source_flags("standard"), "--out", str(out), "--calibration-data-dir", str(data))
    refused(done, f"collab-vit analyze: error: --out {out}: its folder {tmp_path / 'typo'} does not exist")
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize("calibrated", [False, True], ids=["weight-only", "calibrated"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_out_in_a_read_only_folder_is_refused_before_any_work(family, calibrated, data, tmp_path) -> None:
    """The same line and exit code for both recipes, before any conversion runs (no progress line, no cost line);
    nothing is written there (no output, no ``.partial`` state, no probe file)."""
    with unwritable(tmp_path / "ro") as folder:
        out = folder / "model.safetensors"
        done = run(tmp_path, *convert_args(family, out, data, calibrated))
        line = refused(done, f"--out {out}: cannot write into {folder} (")
        assert ("Read-only file system" if os.geteuid() == 0 else "Permission denied") in line
        assert listing(folder) == {}


@pytest.mark.parametrize("command, message", [
    (["convert", "--calibration-images", "abc"], "--calibration-images must be a positive integer, got 'abc'"),
    (["convert", "--calibration-images", "2.5"], "--calibration-images must be a positive integer, got '2.5'"),
    (["convert", "--calibration-images", "0"], "--calibration-images must be a positive integer, got 0"),
    (["convert", "--seed", "x"], "--seed must be an integer, got 'x'"),
    (["analyze", "--seed", "1.5"], "--seed must be an integer, got '1.5'"),
    (["analyze", "--calibration-images", "many"], "--calibration-images must be a positive integer, got 'many'"),
    (["analyze", "--threshold", "high"], "--threshold must be in (0, 1], got 'high'"),
    (["analyze", "--threshold", "1.5"], "--threshold must be in (0, 1], got 1.5"),
    (["convert"], "the following arguments are required: --key-dim"),
    (["prepare-data", "mnist"], "argument dataset: invalid choice: 'mnist'"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_every_bad_value_is_one_line(command, message, tmp_path) -> None:
    """argparse's own refusals (a value that does not parse, a missing flag, a choice) read as the package's other
    checks: one line, no usage block, exit 2, nothing written."""
    name, *flags = command
    base = {"convert": ["--model", "deit_tiny_patch16_224", "--key-dim", "8", "--out", str(tmp_path / "m")],
            "analyze": ["--model", "deit_tiny_patch16_224", "--out", str(tmp_path / "a")], "prepare-data": []}[name]
    if name == "convert" and not flags:
        base = base[:2] + base[4:]
    before = listing(tmp_path)
    line = refused(run(tmp_path, name, *base, *flags), message)
    assert line.startswith(f"collab-vit {name}: error: {message}"), line
    assert listing(tmp_path) == before


@pytest.mark.parametrize("family", list(FAMILIES))
def test_weight_only_progress_in_a_log_is_plain_lines(family, tmp_path) -> None:
    """stderr to a file: the weight-only conversion's progress as the calibrated one's, plain lines, no ``\\r``."""
    done = run(tmp_path, *convert_args(family, tmp_path / "m.safetensors", tmp_path, False))
    assert done.code == 0, done.why()
    what = "rotary re-parametrisation (per frequency)" if family == "rotary" else "tucker re-parametrisation"
    assert f"{what}: 2/2, " in done.err and "\r" not in done.err and "%|" not in done.err, done.err


def converted(out: Path) -> torch.nn.Module:
    """The converted model as timm rebuilds it from the command's file."""
    import collab_vit  # noqa: F401 (registers the collaborative models)

    _, meta = read_weights(str(out))
    model = timm.create_model(meta["model_name"], **meta["model_kwargs"]).eval()
    model.load_state_dict(load_file(str(out)))
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_reports_output_errors_are_measured_on_the_held_out_images(family, data, tmp_path) -> None:
    """Each layer's reported attention-output error is the converted layer's on the source's calls on the images the
    guard held out (the seeded split's tail), not on the calibration images the caller gave last.

    The reference runs the same float32 forward passes on the CPU in another batch composition, which moves the
    tokens by a few float32 ulps (1e-6 relative): the errors agree far inside 1e-4; on the caller's last images they
    differ beyond it (checked, so the comparison can tell the two apart)."""
    out = tmp_path / "m.safetensors"
    done = run(tmp_path, *convert_args(family, out, data, True))
    assert done.code == 0, done.why()
    reported = [layer["output_error"] for layer in json.loads(out.with_suffix(".json").read_text())["layers"]]
    torch.manual_seed(0)  # --checkpoint none's weights, as the command built them
    source = timm.create_model(FAMILIES[family], **SMALL).eval()
    images = calibration_images(calibration_loader("", str(data), "train", IMAGES, source), probe_input_size(source))
    fit = split(IMAGES, None)
    layers = timm_attention_layers(source)
    model = converted(out)

    def errors(held: torch.Tensor) -> list[float]:
        with torch.no_grad():
            return [output_error(block.attn, attn, call)
                    for block, (_, attn), call in zip(model.blocks, layers, layer_calls(source, layers, held))]

    held_out, caller_last = errors(images[held_out_split(IMAGES, 0)[fit:]]), errors(images[fit:])
    assert reported == pytest.approx(held_out, rel=1e-4)
    assert caller_last != pytest.approx(held_out, rel=1e-3)


# the command, with every image file's opening marked on stdout (as the cost line is printed there)
MARKED = """
import sys
from PIL import Image
from collab_vit.cli import main

real = Image.open

def marked(*args, **kwargs):
    print("decoding an image", flush=True)
    return real(*args, **kwargs)

Image.open = marked
main(sys.argv[1:])
"""


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_cost_line_comes_before_the_images_are_decoded(family, data, tmp_path) -> None:
    """The line with images, memory, disk and minutes is printed after the files are counted and the first
    ``capture.PEEK`` decoded (to size them and time one forward pass), before the others are read."""
    from collab_vit.conversion.calibration.capture import PEEK

    args = convert_args(family, tmp_path / "m.safetensors", data, True)
    done = warmstart.run([sys.executable, "-c", MARKED, *args], tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.code == 0, done.why()
    lines = done.out.splitlines()
    cost = next(i for i, line in enumerate(lines) if line.startswith("calibrated conversion: "))
    assert lines[:cost] == ["decoding an image"] * PEEK, lines[:cost + 1]
    assert lines[cost + 1:].count("decoding an image") == IMAGES, done.out
    assert lines[cost].startswith(f"calibrated conversion: {IMAGES} images (12 fitted, 4 held out)")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_pixels_convert_as_the_normalised_images_do_bit_for_bit(family, data) -> None:
    """The command's uint8 pixels, normalised where they enter the model (``capture.Normalise``), give the weights,
    the candidates' held-out KL and the report of the float images the evaluation transform gives (``ToTensor`` and
    ``Normalize``), bit for bit: the same float32 operations on the same values. Refined (``+blocks``), so every
    pass over the images is compared; the model is put back without the normaliser."""
    from collab_vit.cli import calibration_pixels
    from collab_vit.conversion.calibration.recipe import Recipe
    from collab_vit.conversion.reparam import convert_model

    torch.manual_seed(0)
    source = timm.create_model(FAMILIES[family], **SMALL).eval()
    results = []
    for read in (calibration_loader, calibration_pixels):
        model = timm.create_model(FAMILIES[family], **SMALL).eval()
        model.load_state_dict(source.state_dict())
        report = convert_model(model, 8, read("", str(data), "train", IMAGES, model), "default", 0, False,
                               Recipe(candidates=("whitened+blocks",), refine_steps=3, batch_size=4))
        results.append((model.state_dict(), report.summary["candidates"], [r.output_error for r in report]))
    (floats, kl, errors), (pixels, kl_pixels, errors_pixels) = results
    assert floats.keys() == pixels.keys() and all(torch.equal(floats[k], pixels[k]) for k in floats)
    assert kl == kl_pixels and errors == errors_pixels


PEAK = """
import sys
from collab_vit.conversion.calibration import recipe
from collab_vit.cli import main

recipe.PASSES["default"] = 1  # the memory does not depend on the steps
""" + WATCH + """
try:
    main(sys.argv[1:])
finally:
""" + "".join(f"    {line}\n" for line in REPORT.strip().splitlines())
SIDE = 96  # px: the model's input, the pixels each image is held as


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the resident memory from Linux's /proc")
def test_the_calibrated_command_holds_its_images_as_pixels(tmp_path_factory) -> None:
    """The peak resident memory (``RssAnon + RssShmem``, sampled every 2 ms in a fresh process whose freed blocks go
    back to the system) of ``collab-vit convert`` with 800 calibration images is above the one with 200 by less than
    one float32 copy of the 600 more images: the images are held as uint8 pixels (the caller's and ``capture``'s
    seeded order: two copies of a quarter of float32's bytes, half that bound), where the float images took twice
    the bound (tokens and sensitivities live in the store's files, whose page cache is not the process's)."""
    root = tmp_path_factory.mktemp("pixels")
    folder = make_image_folder(root / "data", classes=4, train_per_class=200, val_per_class=1, size=SIDE)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    kwargs = {**SMALL, "img_size": SIDE, "patch_size": 16}
    peaks = []
    for n in (200, 800):
        args = ["convert", "--model", FAMILIES["standard"], "--checkpoint", "none", "--model-kwargs",
                *(f"{k}={v}" for k, v in kwargs.items()), "--key-dim", "8", "--out", str(root / f"m{n}.safetensors"),
                "--calibration-data-dir", folder, "--calibration-images", str(n)]
        done = subprocess.run([sys.executable, "-c", PEAK, *args], capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        peaks.append(int(done.stdout.split()[-1]))
    float_copy = 600 * 3 * SIDE * SIDE * 4
    assert peaks[1] - peaks[0] < float_copy, (peaks, float_copy)
