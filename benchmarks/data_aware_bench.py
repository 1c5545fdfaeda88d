"""Cost of the calibrated conversion (the recipe) next to the weight-only one on DeiT-B, on this machine.

    python benchmarks/data_aware_bench.py --end-to-end                     # the default, run end to end: time, memory

    python benchmarks/data_aware_bench.py                                  # DeiT-B, key dim 384, CPU
    python benchmarks/data_aware_bench.py --device cuda                    # the same on a GPU (bfloat16 capture)
    python benchmarks/data_aware_bench.py --device cuda --measure-default  # and the default effort, run and timed
    python benchmarks/data_aware_bench.py --model deit_tiny_patch16_224 --images 8 --key-dim 96 --refine-steps 1

Rows: the weight-only conversion; the recipe at ``effort="fast"`` with ``--images`` calibration images (token capture
in bfloat16 as ``Recipe(amp=True)`` with ``--amp``, the default on CUDA as in ``collab-vit convert``; both fits
measured on the held-out images); then the default effort's parts, timed on one batch: the pass that reads every
layer's tokens and output sensitivities (``blockwise.layer_inputs``, ``Recipe.samples`` classes per image), per image,
one layer's refinement step (batch 64, the last layer), and one block's pass (``blockwise.replay`` of the last
block), per image. From them the default effort's projected total at ``--default-images`` (the command's default):
the fast run's fits and measures, the capture and the sensitivities of that many images, the converted model's
tokens read before each layer's refinement (``blockwise.converted_calls``: the block before it replayed over the
fitting images, plus a checking batch of 64 stopped at the layer: ``(L - 1)`` block passes per image and
``L (L - 1) / 2`` per checking image), the default's steps for every layer, and the memory the cached tokens and
sensitivities take. The parts run in the precision the command uses on the device (bfloat16 where it multiplies bfloat16 natively:
``recipe.bf16_native``); ``--bf16-parts``: the sensitivity pass and the step timed again in the other precision, and
the projection with them. Random
weights and images (the cost does not depend on them). Prints a Markdown table; take the numbers on a quiet machine.
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import timm
import torch

from collab_vit.conversion.calibration.blockwise import (bf16_parts, cache_bytes, enclosing, inputs_at, layer_inputs,
                                                         refine_blocks, replay, resident_bytes)
from collab_vit.conversion.calibration.recipe import DEFAULT_IMAGES, Recipe, bf16_of, refine_steps, split
from collab_vit.conversion.reparam import convert_model, timm_attention_layers


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def parts(source: torch.nn.Module, originals: list, batch: torch.Tensor, layer: torch.nn.Module, refine_steps: int,
          samples: int, bf16: bool) -> tuple[float, float]:
    """Seconds of the sensitivity pass per image (``layer_inputs`` of ``source``'s attention layers ``originals`` on
    ``batch``) and of one refinement step of ``layer`` (copies; 64 images: ``batch`` repeated; minus a zero-step
    run), under ``bf16_parts(bf16)`` as the recipe runs them (a warm-up pass first)."""
    with bf16_parts(bf16):
        layer_inputs(source, originals, batch[:4], 4, samples, 0)
        cache, calls = timed(lambda: layer_inputs(source, originals, batch, batch.shape[0], samples, 0))
        last = calls[-1]
        repeat = 64 // batch.shape[0]
        many = [(last[0].float().repeat(repeat, 1, 1), *last[1:3], last[3].float().repeat(repeat, 1, 1, 1))]
        step, _ = timed(lambda: refine_blocks(originals[-1:], [copy.deepcopy(layer)], many, refine_steps,
                                              progress=False))
        none, _ = timed(lambda: refine_blocks(originals[-1:], [copy.deepcopy(layer)], many, 0, progress=False))
    return cache / batch.shape[0], (step - none) / refine_steps


def tree_resident(pid: int) -> int:
    """``RssAnon + RssShmem`` of process ``pid`` and its descendants, bytes (the page cache of files they map, such as
    the conversion's state files, is not theirs)."""
    total, children = resident_bytes(pid), []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
    except (OSError, ValueError):
        pass
    return total + sum(tree_resident(c) for c in children)


def run_measured(command: list[str], log: Path) -> tuple[float, int, int]:
    """``command`` in a fresh process (output to ``log``): wall seconds, peak resident bytes of its tree (sampled every
    0.2 s) and exit code."""
    peak, start = 0, time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        while process.poll() is None:
            peak = max(peak, tree_resident(process.pid))
            time.sleep(0.2)
    return time.perf_counter() - start, peak, process.returncode


def image_folder(root: Path, count: int, size: int) -> Path:
    """``count`` seeded random RGB images as PNGs in one class folder (any image folder serves: the cost does not
    depend on what the images show)."""
    from PIL import Image

    folder = root / "images" / "noise"
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    for i in range(count):
        pixels = torch.randint(0, 256, (size, size, 3), dtype=torch.uint8, generator=generator)
        Image.fromarray(pixels.numpy()).save(folder / f"{i:05d}.png")
    return root / "images"


def end_to_end(args: argparse.Namespace) -> None:
    """The weight-only and the default calibrated ``collab-vit convert`` of ``--model`` (``--checkpoint none``: its
    architecture; or the model a ``--checkpoint`` file records) timed end to end in fresh processes, one after the
    other, with their peak resident memory; calibrated on ``--data`` (default: seeded noise images)."""
    source = ["--model", args.model, "--checkpoint", "none"] if args.checkpoint is None else \
        ["--checkpoint", args.checkpoint]
    cli = [sys.executable, "-m", "collab_vit.cli", "convert", *source, "--key-dim", str(args.key_dim),
           "--device", args.device]
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        root = Path(tmp)
        data = Path(args.data) if args.data else image_folder(root, args.default_images, 256)
        rows = [("weight-only", run_measured([*cli, "--out", str(root / "w.safetensors")], root / "w.log"))]
        calibrated = [*cli, "--out", str(root / "c.safetensors"), "--calibration-data-dir", str(data),
                      *args.convert_args]
        rows.append((f"calibrated, {' '.join(args.convert_args) or 'the defaults'}",
                     run_measured(calibrated, root / "c.log")))
        first = (root / "c.log").read_text().splitlines()
        if args.workdir:  # the calibrated run's whole log (its progress lines time each part) kept beside
            shutil.copy(root / "c.log", Path(args.workdir) / "calibrated.log")
        print(f"{args.checkpoint or args.model}, key dim {args.key_dim}, calibration images from {args.data or 'noise'}; {platform.machine()}, "
              f"{args.device}, {torch.get_num_threads()} threads, torch {torch.__version__}\n")
        print("| conversion (fresh process, end to end) | wall s | peak RssAnon+RssShmem GiB | x weight-only | exit |\n"
              "|---|---:|---:|---:|---:|")
        for name, (wall, peak, code) in rows:
            print(f"| {name} | {wall:.0f} | {peak / 2**30:.2f} | {wall / rows[0][1][0]:.1f} | {code} |")
        print("\nits first line: " + next((line for line in first if line.startswith("calibrated conversion")), "-"))
        print("its last lines:\n" + "\n".join(first[-4:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--end-to-end", action="store_true",
                   help="time weight-only and the default calibrated `collab-vit convert` in fresh processes with "
                   "their peak memory (--default-images images in a folder of noise PNGs)")
    p.add_argument("--convert-args", nargs="*", default=[], help="more options of the calibrated command")
    p.add_argument("--workdir", default=None, help="where the images and state folder go (default: the temp dir)")
    p.add_argument("--model", default="deit_base_patch16_224")
    p.add_argument("--checkpoint", default=None, help="--end-to-end: a file collab-vit convert reads the model from")
    p.add_argument("--data", default=None, help="--end-to-end: the calibration image folder (default: noise)")
    p.add_argument("--images", type=int, default=256, help="calibration images of the timed fast run")
    p.add_argument("--default-images", type=int, default=DEFAULT_IMAGES, help="images of the projected default")
    p.add_argument("--key-dim", type=int, default=384)
    p.add_argument("--refine-steps", type=int, default=4, help="steps timed for the refinement's cost per step")
    p.add_argument("--device", default="cpu", help="where the forward passes and the refinement run (cpu, cuda)")
    p.add_argument("--measure-default", action="store_true",
                   help="also run the default effort on --default-images images and time it (a GPU job on DeiT-B)")
    p.add_argument("--bf16-parts", action="store_true",
                   help="also time the sensitivity pass and a refinement step in the other precision (bfloat16 "
                   "where the device's rule runs them in float32, and the reverse)")
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                   help="capture the tokens in bfloat16 (default: on CUDA only, as collab-vit convert)")
    args = p.parse_args()
    if args.end_to_end:
        return end_to_end(args)
    device = torch.device(args.device)
    amp = device.type == "cuda" if args.amp is None else args.amp
    torch.manual_seed(0)
    source = timm.create_model(args.model).eval().to(device)
    images = torch.randn(args.images, *source.pretrained_cfg["input_size"], generator=torch.Generator().manual_seed(1))
    recipe = Recipe(amp=amp)
    weight_only, _ = timed(lambda: convert_model(copy.deepcopy(source), args.key_dim, None, "fast", 0,
                                                 False, recipe))
    fast, report = timed(lambda: convert_model(copy.deepcopy(source), args.key_dim, images, "fast", 0,
                                               False, recipe))
    summary = report.summary
    capture = summary["capture_seconds"] / args.images
    originals = [attn for _, attn in timm_attention_layers(source)]
    batch = images[:16]
    model = copy.deepcopy(source)
    convert_model(model, args.key_dim, None, "fast", 0, False, recipe)
    layer = [m for m in model.modules() if type(m).__name__ == "CollaborativeAttention"][-1]
    bf16 = bf16_of(recipe, source)  # the precision of the parts the command runs here
    per_image, per_step = parts(source, originals, batch, layer, args.refine_steps, recipe.samples, bf16)
    block = enclosing(model, layer)
    inputs = inputs_at(model, block, batch, 16)
    reach, _ = timed(lambda: replay(block, inputs, 16))
    reach /= batch.shape[0]
    fit = split(args.default_images, None)
    steps = refine_steps(recipe, "default", fit)
    depth = len(originals)
    blocks = reach * (fit * (depth - 1) + min(recipe.batch_size, fit) * depth * (depth - 1) / 2)
    rest = (fast - summary["capture_seconds"]) + capture * args.default_images + blocks

    def projection(per_image: float, per_step: float) -> float:
        return rest + per_image * fit + steps * depth * per_step

    projected = projection(per_image, per_step)
    tokens = cache_bytes(source, originals, images[:1], fit, recipe.samples, 1)  # the refinement's store (Footprint)
    print(f"{args.model}, key dim {args.key_dim}; {platform.machine()}, {args.device}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}\n")
    print("| conversion | wall s | token capture s | held-out KL weight-only / closed form | x weight-only |\n"
          "|---|---:|---:|---|---:|")
    print(f"| weight-only | {weight_only:.1f} | — | — | 1.00 |")
    kls = " / ".join(f"{summary['candidates'][c]:.3g}" for c in ("weight", "whitened"))
    print(f"| recipe, effort fast, {args.images} images, {'bfloat16' if amp else 'float32'} capture | {fast:.1f} | "
          f"{summary['capture_seconds']:.1f} | {kls} | {fast / weight_only:.2f} |")
    print(f"| recipe, effort default, {args.default_images} images ({steps} steps per layer, "
          f"{'bfloat16' if bf16 else 'float32'} parts), projected | "
          f"{projected:.0f} | {capture * args.default_images:.0f} | | {projected / weight_only:.1f} |")
    if args.measure_default:
        many = torch.randn(args.default_images, *source.pretrained_cfg["input_size"],
                           generator=torch.Generator().manual_seed(2))
        measured, report = timed(lambda: convert_model(copy.deepcopy(source), args.key_dim, many, "default",
                                                       0, False, recipe))
        kept = report.summary["chosen"]
        print(f"| recipe, effort default, {args.default_images} images, measured | {measured:.0f} | "
              f"{report.summary['capture_seconds']:.0f} | kept {kept} | {measured / weight_only:.1f} |")
    print(f"\ncapture {capture:.3f} s per image; tokens and {recipe.samples} sensitivities {per_image:.3f} s per "
          f"image; one layer's refinement step {per_step:.3f} s (batch 64, {args.refine_steps} steps timed); one "
          f"block's pass {reach:.4f} s per image ({blocks:.0f} s for the converted tokens of every layer); the cached "
          f"tokens and sensitivities of {fit} fitting images, and a layer's working tokens: {tokens / 2**30:.1f} GiB")
    if args.bf16_parts:
        other_image, other_step = parts(source, originals, batch, layer, args.refine_steps, recipe.samples, not bf16)
        print(f"\nin {'float32' if bf16 else 'bfloat16'}: tokens and {recipe.samples} sensitivities "
              f"{other_image:.3f} s per image ({per_image / other_image:.2f}x), one layer's refinement step "
              f"{other_step:.3f} s ({per_step / other_step:.2f}x); the default projected with both: "
              f"{projection(other_image, other_step):.0f} s")


if __name__ == "__main__":
    main()
