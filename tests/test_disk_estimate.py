"""Every byte a calibrated ``collab-vit convert`` writes is counted before its first image, and a full disk is one
line, never a signal.

The disk estimate (``blockwise.Footprint``: the held-out tokens, the refinement's files, the committed layers, the
state, the lock and the output) against the most the output's folder held at once (``diskmeter``), for the standard
and the rotary family at two image counts; on a small tmpfs (mounted here; skipped, saying so, where mounting is not
allowed) the refusal's advice is followed and runs to the end, and a disk that fills after the check (the check told
there is room) is a one-line error at the creation of a state file, exit 2, with the state folder removed or kept as
the line says; the same with the full disk injected at ``posix_fallocate`` (anywhere). The store's files are
reserved, not sparse (``state.reserve``, also where the file system has no fallocate)."""
from __future__ import annotations

import errno
import json
import os
import re
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

import warmstart
from collab_vit.conversion.calibration import state
from collab_vit.conversion.files.families import SMALL
from diskmeter import METERED
from faultfs import listing, small_tmpfs
from tinyrun import make_image_folder

MODELS = {"standard": "deit_tiny_patch16_224", "rotary": "vit_small_patch16_rope_224"}
IMAGES = 120  # in the data folder

# the command with ENOSPC at every posix_fallocate once FAIL_AFTER layers are committed, or with the free disk
# reported as a terabyte (ROOMY): the disk fills after the check
FULL = """
import errno, os, sys
from collab_vit.conversion.calibration import state
commits, real_commit, real_fallocate = [0], state.Store.commit, os.posix_fallocate

def commit(self, *args):
    real_commit(self, *args)
    commits[0] += 1

def fallocate(fd, offset, length):
    if "FAIL_AFTER" in os.environ and commits[0] >= int(os.environ["FAIL_AFTER"]):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real_fallocate(fd, offset, length)

state.Store.commit, os.posix_fallocate = commit, fallocate
if "ROOMY" in os.environ:
    state.disk_free = lambda: 2 ** 40
from collab_vit.cli import main
main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("disk")
    make_image_folder(folder / "data", classes=4, train_per_class=IMAGES // 4, val_per_class=1, size=16)
    return folder


def command(cwd: Path, family: str, out: Path, images: int, code: str = "", **env: str) -> warmstart.Done:
    """``collab-vit convert`` of ``family``'s model at the families' small size (random weights) with ``images``
    calibration images, into ``out`` (``code``: run as ``python -c code``)."""
    args = ["convert", "--model", MODELS[family], "--checkpoint", "none", "--model-kwargs",
            *(f"{k}={v}" for k, v in SMALL.items()), "--key-dim", "16", "--out", str(out),
            "--calibration-data-dir", str(cwd / "data"), "--calibration-images", str(images)]
    script = ["-c", code] if code else [str(Path(sys.executable).parent / "collab-vit")]
    return warmstart.run([sys.executable, *script, *args], cwd, {**os.environ, "OMP_NUM_THREADS": "1", **env})


def one_line(done: warmstart.Done) -> str:
    """The one line of stderr besides the progress lines (``desc: n/total, ...``)."""
    lines = [line for line in done.err.splitlines() if line.strip() and not re.match(r"^[^:]+: \d+/\d+, ", line)]
    assert len(lines) == 1 and "Traceback" not in done.err, done.why()
    return lines[0]


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("images", [40, IMAGES])
def test_the_estimate_is_what_the_conversion_writes(data, family, images) -> None:
    """The estimate checked before the first image against the most the output's folder held at once: never
    below, within 5 %."""
    folder = data / f"{family}-{images}"
    folder.mkdir()
    meter = folder.with_suffix(".json")
    done = command(data, family, folder / "k.safetensors", images, METERED, METER_OUT=str(meter))
    assert done.code == 0, done.why()
    seen = json.loads(meter.read_text())
    assert seen["peak"] <= seen["estimate"] <= 1.05 * seen["peak"], seen
    assert seen["peak"] > 1 << 20  # the state's files were measured, not just the output


@pytest.mark.parametrize("family", list(MODELS))
def test_the_refusals_advice_runs_to_the_end_on_that_disk(data, family) -> None:
    """On a 2 MiB tmpfs, 120 images are refused before any work naming the most that fit; that count converts."""
    with small_tmpfs(data / f"fs-{family}", "2m") as fs:
        out = fs / "k.safetensors"
        refused = command(data, family, out, IMAGES)
        line = one_line(refused)
        assert refused.code == 1 and "MiB is free there: use at most" in line, refused.why()
        assert listing(fs) == {}
        most = int(re.search(r"\(--calibration-images (\d+)\)", line)[1])
        assert 2 <= most < IMAGES
        done = command(data, family, out, most)
        assert done.code == 0, done.why()
        assert sorted(os.listdir(fs)) == ["k.json", "k.safetensors"]
        assert json.loads(out.with_suffix(".json").read_text())["calibration"]["refine_images"] > 0


def test_a_disk_that_fills_after_the_check_is_one_line(data) -> None:
    """A 1 MiB tmpfs reported as a terabyte: the first state file that does not fit is refused as it is created
    (``posix_fallocate``), not a SIGBUS later; the line says what stays, and it does."""
    with small_tmpfs(data / "fs-full", "1m") as fs:
        out = fs / "k.safetensors"
        done = command(data, "standard", out, IMAGES, FULL, ROOMY="1")
        line = one_line(done)
        assert done.code == 2, done.why()
        assert re.match(rf"collab-vit convert: error: no space left on device creating {fs}/k.safetensors.partial/"
                        r"[a-z0-9-]+\.bin: the disk beside the output filled after the check before the first image; ",
                        line), line
        left = sorted(os.listdir(fs))
        if line.endswith("is removed: free space there and run the command again"):
            assert left == []
        else:
            assert left == ["k.safetensors.partial"] and "refined layer(s) stay in" in line


@pytest.mark.parametrize("after", [0, 1])
def test_a_full_disk_at_a_state_files_creation_keeps_what_resumes(data, after) -> None:
    """ENOSPC injected at ``posix_fallocate`` before any layer is committed (the state folder is removed) or after
    the first (it stays, and the same command resumes from it to the uninterrupted weights)."""
    folder = data / f"injected-{after}"
    folder.mkdir()
    out = folder / "k.safetensors"
    done = command(data, "standard", out, 96, FULL, FAIL_AFTER=str(after))
    line = one_line(done)
    partial = folder / "k.safetensors.partial"
    assert done.code == 2 and line.startswith(f"collab-vit convert: error: no space left on device creating {partial}/")
    if not after:
        assert line.endswith(f"{partial} is removed: free space there and run the command again"), line
        assert os.listdir(folder) == []
        return
    assert line.endswith(f"the 1 refined layer(s) stay in {partial}: free space there and run the same command again "
                         f"to resume"), line
    assert sorted(os.listdir(partial)) == ["layer-000.safetensors", "lock", "state.json"]
    resumed = command(data, "standard", out, 96)
    assert resumed.code == 0 and "resuming: 1 of 2 layers" in resumed.out, resumed.why()
    whole = command(data, "standard", folder / "whole.safetensors", 96)
    assert whole.code == 0, whole.why()
    expected, got = load_file(str(folder / "whole.safetensors")), load_file(str(out))
    assert expected.keys() == got.keys() and all(expected[k].equal(got[k]) for k in expected)


@pytest.mark.parametrize("why", [errno.EOPNOTSUPP, errno.EINVAL])
def test_files_are_reserved_where_the_file_system_has_no_fallocate(tmp_path, monkeypatch, why) -> None:
    """Without fallocate the file's bytes are written (zeros): its blocks are allocated, not a sparse hole."""
    def no_fallocate(fd: int, offset: int, length: int) -> None:
        raise OSError(why, os.strerror(why))

    monkeypatch.setattr(os, "posix_fallocate", no_fallocate)
    path = tmp_path / "x.bin"
    state.reserve(path, 3 * 2**20 + 5)
    info = path.stat()
    assert info.st_size == 3 * 2**20 + 5 and info.st_blocks * 512 >= info.st_size
    assert path.read_bytes() == bytes(info.st_size)
