"""What reserving the state folder's blocks and locking it cost on DeiT-B's store (``state.reserve``, ``state.hold``).

``python benchmarks/state_reserve_bench.py --workdir DIR [--images 768] [--repeats 3]`` creates, in ``DIR``, the files
a calibrated conversion of DeiT-B at the defaults creates in ``<out>.partial/`` (sizes from ``blockwise.token_bytes``
on DeiT-B's architecture, the recipe's split and samples; in the store's order: the held-out tokens, the first layer's
tokens and every layer's sensitivities, then per layer the refinement's ``WORKING`` files, recreated layer by layer),
once sparse as before (``truncate``) and once reserved (``state.reserve``: ``posix_fallocate``), removing them after
each pass, and times both; then one sensitivities-sized file filled through a mapping, sparse against reserved (the
write cost the reservation may move); then one such file with zeros written (a file system without fallocate); then
the lock (``hold`` and its release: ``beside``). Prints a Markdown table and lines.
"""
from __future__ import annotations

import argparse
import errno
import os
import shutil
import sys
import time
from pathlib import Path

import timm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from collab_vit.conversion.calibration import blockwise, state  # noqa: E402
from collab_vit.conversion.calibration.recipe import SAMPLES, split  # noqa: E402


def store_files(images: int) -> list[tuple[str, int]]:
    """The (name, bytes) of each file the store of DeiT-B's default conversion creates, in order."""
    model = timm.create_model("deit_base_patch16_224").eval()
    layers = [block.attn for block in model.blocks]
    tokens = blockwise.token_bytes(model, layers, torch.randn(1, 3, 224, 224))
    fit = split(images, None)
    files = [(f"held-{i}", (images - fit) * t) for i, t in enumerate(tokens)]
    files += [("tokens-0", fit * tokens[0])] + [(f"sensitivities-{i}", fit * SAMPLES * t) for i, t in enumerate(tokens)]
    working = ("targets", "carried-0", "carried-1", "tokens")
    for layer in range(len(layers)):  # each layer's refinement recreates its working files (``converted_calls``)
        files += [(name, fit * max(tokens)) for name in working[:1 if layer == 0 else 4]]
    return files


def create(folder: Path, files: list[tuple[str, int]], reserve: bool) -> float:
    """Seconds to create ``files`` in ``folder`` as the store does (a file of the same name replaced)."""
    start = time.perf_counter()
    for name, size in files:
        path = folder / f"{name}.bin"
        path.unlink(missing_ok=True)
        if reserve:
            state.reserve(path, size)
        else:
            with open(path, "wb") as f:
                f.truncate(size)
    seconds = time.perf_counter() - start
    for path in folder.iterdir():
        path.unlink()
    return seconds


def fill(folder: Path, size: int, reserve: bool) -> float:
    """Seconds to create one file of ``size`` bytes and write all of it through a mapping (then flushed)."""
    path = folder / "filled.bin"
    start = time.perf_counter()
    if reserve:
        state.reserve(path, size)
    else:
        with open(path, "wb") as f:
            f.truncate(size)
    t = state.mapped(path, (size // 4,), torch.float32)
    for chunk in t.split(2 ** 24):
        chunk.fill_(1.0)
    del t
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--images", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    folder = args.workdir / "bench.partial"
    folder.mkdir(parents=True, exist_ok=True)
    files = store_files(args.images)
    layers = sum(name.startswith("held-") for name, _ in files)
    peak = sum(size for _, size in files[:2 * layers + 1]) + blockwise.WORKING * files[-1][1]  # as Footprint counts
    print(f"{len(files)} files created, {sum(s for _, s in files) / 2**30:.1f} GiB in all, "
          f"{peak / 2**30:.1f} GiB at once at most; free there {shutil.disk_usage(folder).free / 2**30:.0f} GiB")
    print("\n| what | sparse (truncate) s | reserved (posix_fallocate) s |\n|---|---:|---:|")
    for label, run in (("create the store's files", lambda r: create(folder, files, r)),
                       (f"create and fill one {files[13][1] / 2**30:.2f} GiB file (mapped)",
                        lambda r: fill(folder, files[13][1], r))):
        times = {r: [run(r) for _ in range(args.repeats)] for r in (False, True)}
        print(f"| {label} | " + " | ".join(f"{min(times[r]):.3f} (of {args.repeats}, max {max(times[r]):.3f})"
                                             for r in (False, True)) + " |")
    def no_fallocate(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    real, os.posix_fallocate = os.posix_fallocate, no_fallocate  # a file system without fallocate: zeros written
    try:
        zeros = [create(folder, files[13:14], True) for _ in range(args.repeats)]
    finally:
        os.posix_fallocate = real
    print(f"\nwithout fallocate (zeros written), one {files[13][1] / 2**30:.2f} GiB file: {min(zeros):.3f} s (of "
          f"{args.repeats}, max {max(zeros):.3f}); the store's files at that rate: "
          f"{min(zeros) * sum(s for _, s in files) / files[13][1]:.0f} s")
    out = args.workdir / "k.safetensors"
    start = time.perf_counter()
    for _ in range(100):
        with state.beside(out):
            state.hold()
    print(f"\nlock taken and released (with its folder): {(time.perf_counter() - start) / 100 * 1e3:.2f} ms each")
    shutil.rmtree(folder, ignore_errors=True)
    print(f"\ntorch {torch.__version__}, {os.cpu_count()} cpus")


if __name__ == "__main__":
    main()
