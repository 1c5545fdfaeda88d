"""What a user trying the commands for the first time met, each in a process of its own
(``warmstart``): no network, random weights, a checkpoint of another architecture, fewer calibration images than
asked, a class count below 5; the help, the README and docs/post_hoc.md against the package's table of families."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import timm
from safetensors.torch import load_file, save_file

import warmstart
from collab_vit.cli import build_parser
from collab_vit.conversion.files import families
from tinyrun import ROOT, make_image_folder

CLI = str(Path(sys.executable).parent / "collab-vit")
OFFLINE = {"HF_ENDPOINT": "http://127.0.0.1:9", "OMP_NUM_THREADS": "1"}  # a hub that refuses every connection
DEIT = families.FAMILIES[0].design  # deit_tiny_patch16_224 at the small size
SMALL_FLAGS = ["--model-kwargs", *(f"{k}={v}" for k, v in DEIT.small_kwargs().items())]


def convert(tmp_path: Path, *flags: str) -> warmstart.Done:
    return warmstart.run([sys.executable, CLI, "convert", *flags], tmp_path, {**os.environ, **OFFLINE})


def one_line(done: warmstart.Done) -> str:
    lines = done.err.strip().splitlines()
    assert done.code == 2 and len(lines) == 1 and "Traceback" not in done.err, done.why()
    return lines[0]


def test_offline_hub_is_one_line_at_once_naming_checkpoint(tmp_path) -> None:
    """No --checkpoint and no hub: one line naming --checkpoint, without the hub library's five retries (started
    cold: the hub's address is read as the hub library is imported)."""
    proc = subprocess.run([CLI, "convert", "--model", "deit_tiny_patch16_224", "--key-dim", "96", "--out",
                           str(tmp_path / "o")], cwd=tmp_path, env={**os.environ, **OFFLINE}, capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)
    done = warmstart.Done(proc.args, proc.returncode, proc.stdout, proc.stderr)
    line = one_line(done)
    assert "--checkpoint FILE" in line and "--checkpoint none" in line and "127.0.0.1 unreachable" in line, line
    assert "Retrying" not in done.err and not (tmp_path / "o").exists()


def test_checkpoint_none_converts_the_seeded_random_initialisation(tmp_path) -> None:
    """``--checkpoint none``: the architecture's initialisation, the same for the same --seed, recorded as such."""
    outs = []
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        done = convert(tmp_path, "--model", DEIT.model, "--checkpoint", "none", *SMALL_FLAGS, "--key-dim", "32",
                       "--seed", seed, "--out", str(tmp_path / name))
        assert done.code == 0, done.why()
        outs.append(load_file(str(tmp_path / name / "model.safetensors")))
    assert outs[0].keys() == outs[1].keys() and all((outs[0][k] == outs[1][k]).all() for k in outs[0])
    assert any(not (outs[0][k] == outs[2][k]).all() for k in outs[0])
    assert "random initialisation (--checkpoint none)" in (tmp_path / "a" / "config.json").read_text()


def test_a_checkpoint_of_another_architecture_names_its_keys(tmp_path) -> None:
    """A DeiT file converted without its --model-kwargs: the first missing / unexpected keys and shape mismatches,
    on one line (it printed torch's header and nothing after its colon)."""
    save_file(DEIT.create().state_dict(), str(tmp_path / "small.safetensors"))
    done = convert(tmp_path, "--model", DEIT.model, "--checkpoint", str(tmp_path / "small.safetensors"), "--key-dim",
                   "96", "--out", str(tmp_path / "o"))
    line = one_line(done)
    assert re.search(r"shape mismatch: \S+ \(.*\) in file vs \(.*\) in model", line), line
    assert "missing: blocks.2." in line and "do not fit the model" in line, line
    assert not (tmp_path / "o").exists()


def test_fewer_calibration_images_than_asked_is_said(tmp_path) -> None:
    data = make_image_folder(tmp_path / "data", classes=2, train_per_class=5, val_per_class=1, size=20)
    done = convert(tmp_path, "--model", DEIT.model, "--checkpoint", "none", *SMALL_FLAGS, "--key-dim", "32",
                   "--calibration-data-dir", data, "--calibration-images", "256", "--effort", "fast",
                   "--out", str(tmp_path / "o"))
    assert done.code == 0, done.why()
    assert f"note: --calibration-images 256 asked, {data} holds 10: using 10" in done.out.splitlines(), done.out


def section(text: str, heading: str) -> str:
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def test_help_readme_and_docs_agree_with_the_table() -> None:
    """``convert --help`` / ``analyze --help`` list the table's families and refuse no rotary model; the README's
    convert section names every family and says ``import collab_vit`` before its ``local-dir:`` reload;
    docs/post_hoc.md holds the table as the package writes it."""
    parser = build_parser()
    helps = {name: parser._subparsers._group_actions[0].choices[name].format_help() for name in ("convert", "analyze")}
    short = families.family_names_short()
    assert short[:3] == ["DeiT", "ViT", "BEiT"] and "RoPE-ViT" in short and "DINOv3" in short
    for text in helps.values():
        flat = " ".join(text.split())
        assert all(name in flat for name in short), flat
        assert "rope, ..." not in flat and "mixed rope" in flat
    readme = section(Path(ROOT, "README.md").read_text(), "## Convert a trained model")
    flat = " ".join(readme.split())
    for family in families.FAMILIES:
        assert family.name.split(",")[0].replace(" distilled", "") in flat, family.name
    assert re.search(r"import collab_vit` first, then `timm\.create_model\(\"local-dir:FOLDER\"", flat), flat
    doc = Path(ROOT, "docs", "post_hoc.md").read_text()
    block = doc.split(f"<!-- {families.MARKER}:start -->\n", 1)[1].split(f"\n<!-- {families.MARKER}:end -->")[0]
    assert block == families.markdown()
    assert "## Which models convert" in doc and doc.index(families.MARKER) > doc.index("## Which models convert")


def test_the_table_s_attention_classes_and_rope_are_timm_s() -> None:
    """Each row's attention class and rotary flag are what timm builds (on meta: no weights)."""
    from collab_vit.conversion.weights.rotary import is_rotary
    from collab_vit.conversion.weights.support import check_model

    for family in families.FAMILIES:
        model = timm.create_model(family.design.model, device="meta", **family.design.small_kwargs())
        layers = check_model(model).layers
        assert {type(attn).__name__ for _, attn in layers} == {family.attention}, family.name
        assert {is_rotary(attn, model) for _, attn in layers} == {family.rotary}, family.name
