"""``scripts/bit_identity.py``, the check that a change keeps the converted weights bit for bit: one family converted
at the same commit twice agrees on every case, and the comparison names a tensor whose bits differ."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bit_identity  # noqa: E402


def test_one_family_at_the_same_commit_twice_is_bit_identical() -> None:
    """DeiT weight-only and calibrated (fast), each side in its own process on its own unpacked tree."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bit_identity.py"), "--before", "HEAD", "--after",
                           "HEAD", "--only", "deit_tiny_patch16_224", "--modes", "weight,fast"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("same")]
    assert len(lines) == 2 and all("(identical)" in line for line in lines), proc.stdout
    assert "BIT-IDENTICAL: 2 of 2 cases agree" in proc.stdout


def test_a_flipped_bit_and_a_missing_tensor_are_named(tmp_path: Path) -> None:
    a = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.zeros(3)}
    b = {"w": a["w"].clone()}
    b["w"].view(torch.int32)[1, 2] ^= 1  # the last bit of one float
    meta = {"model_name": "m", "model_kwargs": "{}"}
    save_file(a, str(tmp_path / "a.safetensors"), metadata=meta)
    save_file(b, str(tmp_path / "b.safetensors"), metadata=meta)
    found = bit_identity.differences(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert found[0] == "only before: b" and found[1].startswith("w: 1 of 6 differ"), found
    assert bit_identity.differences(tmp_path / "a.safetensors", tmp_path / "a.safetensors") == []


def test_a_bad_revision_is_one_line_and_exit_2() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bit_identity.py"), "--before", "no-such-rev"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == "bit_identity.py: error: not a commit: no-such-rev"
