"""A calibrated ``collab-vit convert`` stopped mid-way (``kill -9`` after its first refined layer) and run again
resumes from its state folder and ends with the weights of an uninterrupted run, bit for bit (one CPU); a changed
command does not resume from another's state; the first line says the cost; the progress is plain lines in a log."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from safetensors.torch import load_file

import warmstart
from test_calibration_cli import exported
from tinyrun import make_image_folder

# the command, killed (SIGKILL: no handler runs) as its second layer's refinement starts, the first one committed
KILLED = """
import os, signal, sys
from collab_vit.conversion.calibration import blockwise
real, started = blockwise.refine_layer, []

def dying(*args, **kwargs):
    if started:
        os.kill(os.getpid(), signal.SIGKILL)
    started.append(1)
    return real(*args, **kwargs)

blockwise.refine_layer = dying
from collab_vit.cli import main
main(sys.argv[1:])
"""


def convert(tmp_path: Path, out: Path, *extra: str, code: str = "") -> warmstart.Done:
    data = tmp_path / "data"
    if not data.exists():
        make_image_folder(data, classes=4, train_per_class=40, val_per_class=1, size=12)
    source = tmp_path / "source_c3_s16.safetensors"
    if not source.exists():
        exported(tmp_path)
    args = ["convert", "--checkpoint", str(source), "--key-dim", "6", "--out", str(out), "--calibration-data-dir",
            str(data), "--calibration-images", "96", *extra]
    command = ["-c", code] if code else [str(Path(sys.executable).parent / "collab-vit")]
    return warmstart.run([sys.executable, *command, *args], tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_killed_conversion_resumes_to_the_uninterrupted_weights(tmp_path) -> None:
    whole = convert(tmp_path, tmp_path / "whole.safetensors")
    assert whole.code == 0, whole.why()
    lines = whole.out.splitlines()
    assert lines[0].startswith("calibrated conversion: 96 images (72 fitted, 24 held out), each layer refined in ")
    assert "GiB in memory" in lines[0] and "GiB on disk beside the output" in lines[0] and "min on this CPU" in lines[0]
    stages = ("token statistics (images): 96/96", "closed-form candidates (layers): 4/4",
              "tokens and sensitivities (images): 72/72", "refine layer 1/2 (its output): ",
              "refine layer 2/2 (its output): ")
    assert all(stage in whole.err for stage in stages), whole.err  # a bar per stage and layer
    assert "\r" not in whole.err  # plain lines, not a bar, where stderr is a file

    out = tmp_path / "resumed.safetensors"
    partial = tmp_path / "resumed.safetensors.partial"
    killed = convert(tmp_path, out, code=KILLED)
    assert killed.code == -9, killed.why()
    assert list(json.loads((partial / "state.json").read_text())["layers"]) == ["0"] and not out.exists()

    other = convert(tmp_path, tmp_path / "other.safetensors", "--seed", "1")  # another command: its own state
    assert other.code == 0 and "resuming" not in other.out, other.why()
    assert partial.exists() and not (tmp_path / "other.safetensors.partial").exists()

    resumed = convert(tmp_path, out)
    assert resumed.code == 0, resumed.why()
    assert "resuming: 1 of 2 layers refined by a stopped run of this command" in resumed.out
    assert not partial.exists()  # a finished conversion's state is removed
    expected, got = load_file(str(tmp_path / "whole.safetensors")), load_file(str(out))
    assert expected.keys() == got.keys() and all(expected[k].equal(got[k]) for k in expected)
    summary = [json.loads(p.with_suffix(".json").read_text())["calibration"] for p in (tmp_path / "whole.safetensors",
                                                                                       out)]
    assert summary[0]["candidates"] == summary[1]["candidates"] and summary[0]["chosen"] == summary[1]["chosen"]


def test_a_changed_command_does_not_resume_from_another_state(tmp_path) -> None:
    """A state folder left by a stopped run with another seed (or any other key) is cleared, not resumed from."""
    out = tmp_path / "k6.safetensors"
    killed = convert(tmp_path, out, code=KILLED)
    assert killed.code == -9, killed.why()
    changed = convert(tmp_path, out, "--seed", "1")
    assert changed.code == 0 and "resuming" not in changed.out, changed.why()
    assert not (tmp_path / "k6.safetensors.partial").exists()
