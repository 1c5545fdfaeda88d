"""Do two commits convert the family table's cases to the same bits? Reads two revisions, writes nothing in the
repository, prints one line per case and exits 1 on any difference (2 on bad input).

Each revision is unpacked (``git archive``; ``WORKTREE``: the working tree's tracked and untracked, not ignored,
files) into a temporary folder, and one process per revision, with ``PYTHONPATH`` at that folder and one thread,
runs ``collab-vit convert`` (its ``main``) on every case: each design and variant of
``collab_vit/conversion/files/families.py`` (this checkout's table) at the table's small size, with seeded weights
drawn at a unit-gain scale (timm's small initial weights give every calibrated candidate the same zero held-out
KL, so the recipe's choice would not be exercised), converted weight-only at a quarter of the key dim and, at half,
calibrated on seeded random images at ``--effort fast`` and ``default``. The written state dicts are compared tensor
by tensor (names, dtypes, shapes and bytes), with the record (``model_name``, ``model_kwargs``) they carry.

    python scripts/bit_identity.py                       # main's merge-base against HEAD
    python scripts/bit_identity.py --before main~5 --after main --modes weight
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
WORKTREE = "WORKTREE"  # --before / --after: the working tree as it is, uncommitted changes included
MODES = {"weight": 4, "fast": 2, "default": 2}  # mode: the key dim's divisor of the width (a quarter, a half)
IMAGES = 16  # calibration images (32 px, seeded noise around a colour per class)
SEED = 0

CHILD = r"""
import json, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
tree, jobs = Path(sys.argv[1]).resolve(), json.loads(Path(sys.argv[2]).read_text())
import collab_vit
assert Path(collab_vit.__file__).resolve().is_relative_to(tree), f"{collab_vit.__file__} is not under {tree}"
from collab_vit.cli import main
done = {}
for name, argv in jobs.items():
    began = time.perf_counter()
    try:
        code = main(argv) or 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    done[name] = {"code": code, "seconds": time.perf_counter() - began}
    print(json.dumps({name: done[name]}), flush=True)
Path(sys.argv[3]).write_text(json.dumps(done))
"""


@dataclass(frozen=True)
class Case:
    """One conversion: a design of the table (its label and timm model), a mode (``MODES``) and its key dim."""

    label: str
    model: str
    mode: str
    key_dim: int

    @property
    def name(self) -> str:
        return f"{self.mode:8} {self.label} [{self.model}]"

    def argv(self, source: Path, images: Path, out: Path) -> list[str]:
        flags = ["convert", "--checkpoint", str(source), "--key-dim", str(self.key_dim), "--out", str(out),
                 "--seed", str(SEED), "--device", "cpu"]
        if self.mode == "weight":
            return flags
        return flags + ["--calibration-data-dir", str(images), "--calibration-images", str(IMAGES),
                        "--effort", self.mode]


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def resolve(rev: str) -> str:
    """The commit ``rev`` names (``WORKTREE`` as it is); a bad name is a ValueError."""
    if rev == WORKTREE:
        return rev
    try:
        return git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        raise ValueError(f"not a commit: {rev}") from None


def unpack(rev: str, where: Path) -> Path:
    """The files of ``rev`` under ``where``."""
    where.mkdir(parents=True)
    if rev == WORKTREE:
        for name in git("ls-files", "-co", "--exclude-standard", "-z").split("\0"):
            if name and (ROOT / name).is_file():
                (where / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, where / name)
        return where
    data = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(where, filter="data")
    return where


def cases(modes: list[str], only: Optional[str]) -> list[Case]:
    """Every design and variant of the table (this checkout's) in each mode, or those whose model or label holds
    ``only``."""
    from collab_vit.conversion.files.families import FAMILIES, SMALL

    width = SMALL["embed_dim"]
    designs = [d for f in FAMILIES for d in (f.design, *f.variants)]
    picked = [d for d in designs if only is None or only in d.model or only in d.label]
    return [Case(d.label, d.model, mode, width // MODES[mode]) for d in picked for mode in modes]


def sources(picked: list[Case], where: Path) -> dict[str, Path]:
    """Each design's seeded weights at a unit-gain scale, as a file that records its model (read the same way by
    every revision)."""
    import torch
    from safetensors.torch import save_file

    from collab_vit.conversion.files.families import FAMILIES

    designs = {d.label: d for f in FAMILIES for d in (f.design, *f.variants)}
    files: dict[str, Path] = {}
    for case in picked:
        if case.label in files:
            continue
        design = designs[case.label]
        torch.manual_seed(SEED)
        model = design.create()
        generator = torch.Generator().manual_seed(SEED)
        state = {}
        for key, value in model.state_dict().items():
            if value.is_floating_point() and value.dim() >= 2 and "pos_embed" not in key:
                fan_in = value[0].numel()
                value = torch.randn(value.shape, generator=generator) / fan_in ** 0.5
            state[key] = value.contiguous()
        files[case.label] = where / f"source{len(files)}.safetensors"
        save_file(state, str(files[case.label]), metadata={"model_name": design.model,
                                                      "model_kwargs": json.dumps(design.small_kwargs())})
    return files


def image_folder(where: Path) -> Path:
    """``IMAGES`` seeded 32 px PNGs in two classes (an ImageFolder)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(SEED)
    for i in range(IMAGES):
        folder = where / "train" / f"class_{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        base = np.array([160.0, 60.0, 60.0] if i % 2 else [60.0, 60.0, 160.0])
        pixels = np.clip(base + rng.normal(0, 50, (32, 32, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.png")
    return where


def convert_all(tree: Path, jobs: dict[str, list[str]], log: Path) -> dict[str, dict]:
    """Run every job's ``collab-vit convert`` in one process on ``tree``'s code; {case: {code, seconds}}."""
    job_file, done_file = log.with_suffix(".jobs.json"), log.with_suffix(".done.json")
    job_file.write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "-c", CHILD, str(tree), str(job_file), str(done_file)], cwd=log.parent,
                              env=env, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not done_file.exists():
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"the conversions of {tree.name} stopped (exit {proc.returncode}); its log ends:\n{tail}")
    return json.loads(done_file.read_text())


def tensors(path: Path) -> tuple[dict, dict[str, str]]:
    """A written file's tensors and its record (model_name, model_kwargs)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        return {k: f.get_tensor(k) for k in f.keys()}, {k: meta.get(k, "") for k in ("model_name", "model_kwargs")}


def differences(a: Path, b: Path, limit: int = 4) -> list[str]:
    """What differs between two written files: record, names, dtypes, shapes, bytes (with the largest change)."""
    import torch

    (ta, ma), (tb, mb) = tensors(a), tensors(b)
    found = [f"{k}: {ma[k]} vs {mb[k]}" for k in ma if ma[k] != mb[k]]
    found += [f"only before: {k}" for k in sorted(set(ta) - set(tb))]
    found += [f"only after: {k}" for k in sorted(set(tb) - set(ta))]
    for key in sorted(set(ta) & set(tb)):
        x, y = ta[key], tb[key]
        if (x.dtype, x.shape) != (y.dtype, y.shape):
            found.append(f"{key}: {x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)}")
        elif not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            most = (x.double() - y.double()).abs().max().item() if x.is_floating_point() else float("nan")
            found.append(f"{key}: {int((x != y).sum())} of {x.numel()} differ (at most {most:.3g})")
    return found[:limit] + ([f"... {len(found) - limit} more"] if len(found) > limit else [])


def verdict(case: Case, runs: list[dict], outs: list[Path]) -> Optional[list[str]]:
    """None when the case agrees (same bits, or the same refusal), else what differs."""
    codes = [r.get(case.name, {}).get("code", "not run") for r in runs]
    if codes[0] != codes[1]:
        return [f"exit {codes[0]} before, {codes[1]} after"]
    if codes[0] != 0:
        return None
    return differences(*outs) or None


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=None, help="revision (default: the merge-base of main and HEAD)")
    parser.add_argument("--after", default="HEAD", help=f"revision, or {WORKTREE} (default: HEAD)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)} (default: all)")
    parser.add_argument("--only", default=None, help="the cases whose timm model or label holds this text")
    parser.add_argument("--keep", type=Path, default=None, help="keep the trees, sources and outputs in this folder")
    return parser.parse_args(argv)


def compare(before: str, after: str, picked: list[Case], work: Path) -> int:
    """Convert ``picked`` at both revisions under ``work``, print a line per case; the number of differing cases."""
    srcs, images = sources(picked, work), image_folder(work / "images")
    runs, outs = [], {}
    for side, rev in (("before", before), ("after", after)):
        tree = unpack(rev, work / side / "tree")
        jobs = {}
        for i, case in enumerate(picked):
            outs.setdefault(case.name, []).append(work / side / f"case{i}.safetensors")
            jobs[case.name] = case.argv(srcs[case.label], images, outs[case.name][-1])
        began = time.perf_counter()
        runs.append(convert_all(tree, jobs, work / side / "convert.log"))
        print(f"{side}: {rev[:12]} converted {len(jobs)} cases in {time.perf_counter() - began:.0f} s", flush=True)
    failed = 0
    for case in picked:
        why = verdict(case, runs, outs[case.name])
        code = runs[1].get(case.name, {}).get("code")
        state = "identical" if code == 0 else f"refused by both (exit {code})"
        print(f"{'DIFFERS' if why else 'same':8} {case.name}" + (f": {'; '.join(why)}" if why
                                                                               else f" ({state})"))
        failed += bool(why)
    return failed


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    modes = args.modes.split(",")
    try:
        if set(modes) - set(MODES):
            raise ValueError(f"--modes: {', '.join(sorted(set(modes) - set(MODES)))} not among {', '.join(MODES)}")
        before = resolve(args.before or git("merge-base", "main", "HEAD"))
        after = resolve(args.after)
        picked = cases(modes, args.only)
        if not picked:
            raise ValueError(f"--only {args.only}: no design of the table matches")
    except (ValueError, subprocess.CalledProcessError) as error:
        print(f"bit_identity.py: error: {error}", file=sys.stderr)
        return 2
    print(f"before {before[:12]}, after {after[:12]}: {len(picked)} cases ({', '.join(modes)})", flush=True)
    work = args.keep or Path(tempfile.mkdtemp(prefix="bit_identity_"))
    if args.keep is not None:
        if args.keep.exists() and any(args.keep.iterdir()):
            print(f"bit_identity.py: error: --keep {args.keep}: not empty", file=sys.stderr)
            return 2
        args.keep.mkdir(parents=True, exist_ok=True)
    try:
        failed = compare(before, after, picked, work)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{'DIFFERENT' if failed else 'BIT-IDENTICAL'}: {len(picked) - failed} of {len(picked)} cases agree")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
