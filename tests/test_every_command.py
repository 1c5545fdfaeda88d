"""Every family of the package's table (``collab_vit/conversion/files/families.py``) through every command a user runs
(what a first-time user meets), each in its own process as a user starts it: the installed ``collab-vit convert`` at an
integer key dim below full rank with calibration images stored at another size than the model's input (into a hub
folder), weight-only at a quarter of the q/k dims (a ``.safetensors`` file) and at a per-layer list (a folder); the
folders reloaded by plain timm (``local-dir:``, after ``import collab_vit``) in a fresh process; ``eval.py`` on a
folder; ``train.py`` fine-tuning it for one update; ``collab-vit analyze``. Each exits 0 with no traceback; every
refused design of the table exits 2 with one line and writes nothing. A row added to the table runs through all of it.

The sources are each row's random initialisation at the table's small size (``--checkpoint none``). The commands
run two at a time (one thread each) so that the 2-core machine the suite targets is used fully.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from collab_vit.conversion.files.families import FAMILIES, SMALL, Design, refused_designs
import warmstart
from tinyrun import ROOT, make_image_folder
from warmstart import Done

HALF = SMALL["embed_dim"] // 2  # below full rank (64), even (rotary layers take pairs)
CALIBRATION = 8  # images, stored at 16 px; the models take 32 px
LIST = ",".join(str(HALF // (1 + i % 2)) for i in range(SMALL["depth"]))  # per layer: half, a quarter, ... (even)
COMMANDS = ("convert key dim", "convert file", "convert list", "analyze", "reload", "eval.py", "train.py")


def collab_vit_command() -> str:
    """The installed console script beside this interpreter (what ``pip install`` put on the user's PATH)."""
    script = Path(sys.executable).parent / "collab-vit"
    assert script.exists(), f"no installed collab-vit command beside {sys.executable}"
    return str(script)


ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run(args: list[str], cwd: Path) -> Done:
    """``args`` in a process of its own (``warmstart``: the installed script run as ``__main__``), one thread."""
    done = warmstart.run([sys.executable, *args[1:]] if args[0] == sys.executable else [sys.executable, *args],
                         cwd, {**os.environ, **ENV})
    done.cwd = str(cwd)
    return done


def run_cold(args: list[str], cwd: Path) -> Done:
    """``args`` from a new interpreter, as a shell starts it."""
    began = time.perf_counter()
    proc = subprocess.run(args, cwd=cwd, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    return Done(args, proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - began)


def source_flags(design: Design) -> list[str]:
    return ["--model", design.model, "--checkpoint", "none", "--model-kwargs",
            *(f"{k}={v}" for k, v in design.small_kwargs().items())]


RELOAD = """
import json, sys, timm, torch, collab_vit
out = {}
for folder in sys.argv[1:]:
    model = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    attn = [m for m in model.modules() if type(m).__name__.startswith("Collaborative")]
    with torch.no_grad():
        logits = model(torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)))
    out[folder] = {"classes": sorted({type(m).__name__ for m in attn}),
                   "key_dims": [collab_vit.models.layer_key_dim(m) for m in attn],
                   "finite": bool(torch.isfinite(logits).all()), "shape": list(logits.shape)}
print(json.dumps(out))
"""


def first_stage(design: Design, where: Path, data: str) -> dict[str, list[str]]:
    cli, src = collab_vit_command(), source_flags(design)
    return {
        "convert key dim": [cli, "convert", *src, "--key-dim", str(HALF), "--out", str(where / "k"),
                            "--calibration-data-dir", data, "--calibration-images", str(CALIBRATION)],
        "convert file": [cli, "convert", *src, "--key-dim", str(HALF // 2), "--out", str(where / "t.safetensors")],
        "convert list": [cli, "convert", *src, "--key-dim", LIST, "--out", str(where / "b")],
        "analyze": [cli, "analyze", *src, "--out", str(where / "a")],
    }


def second_stage(where: Path, data: str) -> dict[str, list[str]]:
    python = sys.executable
    return {
        "reload": [python, "-c", RELOAD, str(where / "k"), str(where / "b")],
        "eval.py": [python, os.path.join(ROOT, "eval.py"), "--checkpoint", str(where / "k"), "--data-dir", data,
                    "--split", "val", "-j", "0"],
        "train.py": [python, os.path.join(ROOT, "train.py"), "--model", f"local-dir:{where / 'k'}", "--checkpoint",
                     str(where / "k"), "--img-size", "32", "--num-classes", "3", "--data-dir", data, "--val-split",
                     "val", "--epochs", "1", "--batch-size", "24", "--warmup-epochs", "0", "--num-workers", "0",
                     "--cpu-threads", "1", "--output", str(where / "run")],
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict[str, Done]]:
    """Every row's commands, two processes at a time: the first stage (the conversions, analyze), then what reads
    the conversions (reload, eval.py, train.py); {row: {command: Done}}."""
    tmp = tmp_path_factory.mktemp("every_command")
    data = make_image_folder(tmp / "data", classes=3, train_per_class=8, val_per_class=4, size=16)
    wheres = {f.name: tmp / f"row{i}" for i, f in enumerate(FAMILIES)}
    for where in wheres.values():
        where.mkdir()
    done: dict[str, dict[str, Done]] = {f.name: {} for f in FAMILIES}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for stage in (lambda f: first_stage(f.design, wheres[f.name], data),
                      lambda f: second_stage(wheres[f.name], data)):
            jobs = {(f.name, what): pool.submit(run, args, wheres[f.name])
                    for f in FAMILIES for what, args in stage(f).items()}
            for (name, what), job in jobs.items():
                done[name][what] = job.result()
    return done


CASES = [(f.name, what) for f in FAMILIES for what in COMMANDS]


@pytest.mark.parametrize("family, command", CASES, ids=[f"{f}-{c}".replace(" ", "_") for f, c in CASES])
def test_every_family_through_every_command(results, family: str, command: str) -> None:
    done, row = results[family][command], next(f for f in FAMILIES if f.name == family)
    assert done.code == 0, done.why()
    assert "Traceback" not in done.err, done.why()
    if command.startswith("convert"):
        assert "wrote " in done.out, done.why()
    if command == "convert key dim":  # the calibration images went through the model's transform: all used
        assert "calibration images" in done.out and "error" not in done.err.lower(), done.why()
    if command == "convert file" and row.rotary:  # a bar over the layers, as for standard attention
        assert "rotary re-parametrisation (per frequency)" in done.err and f"{SMALL['depth']}/{SMALL['depth']}" in \
            done.err, done.why()
    if command == "analyze":  # into its --out folder, nothing into the working folder
        assert "suggested key_dim" in done.out, done.why()
        assert ("energy share in 1 shared pair" in done.out) == row.rotary, done.why()
        assert sorted(p.name for p in Path(done.cwd).iterdir() if p.is_file()) == ["t.json", "t.safetensors"]
    if command == "eval.py":
        assert "top-1" in done.out, done.why()
    if command == "train.py":  # one epoch of one update (24 images, batch 24); 3 classes: no top-5 to show
        assert "epoch   0" in done.out and "global batch 24" in done.out and ", 1 epoch\n" in done.out, done.why()
        assert "top-1" in done.out and "top-5" not in done.out, done.why()


@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_reload_gives_the_recorded_key_dims(results, family: str) -> None:
    row = next(f for f in FAMILIES if f.name == family)
    reload = results[family]["reload"]
    assert reload.code == 0, reload.why()
    got = json.loads(reload.out.strip().splitlines()[-1])
    for folder, report in got.items():
        recorded = json.loads((Path(folder) / "conversion.json").read_text())
        assert report["key_dims"] == [layer["key_dim"] for layer in recorded["layers"]], folder
        assert report["finite"] and report["shape"] == [2, SMALL["num_classes"]], folder
        assert all(cls.startswith("Collaborative") for cls in report["classes"]), report["classes"]
        assert ("Rope" in "".join(report["classes"]) or "EvaAttention" in "".join(report["classes"])) == row.rotary
    assert got[next(iter(got))]["key_dims"] == [HALF] * SMALL["depth"]  # the integer key dim asked
    assert list(got.values())[1]["key_dims"] == [int(k) for k in LIST.split(",")]  # the per-layer list asked


@pytest.mark.parametrize("design", refused_designs()[:-1], ids=lambda d: d.label)
def test_every_refused_design_is_one_line(design: Design, tmp_path) -> None:
    """A refused design exits 2 with one line naming why, before anything is written."""
    done = run_cold([collab_vit_command(), "convert", *source_flags(design), "--key-dim", str(HALF), "--out",
                     str(tmp_path / "out")], tmp_path)
    assert done.code == 2, done.why()
    lines = done.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("collab-vit convert: error: cannot convert"), done.why()
    assert ("qk_norm" in lines[0]) == ("qk_norm" in design.label), lines[0]
    assert not (tmp_path / "out").exists()
