"""Cost of the calibrated conversion (the recipe) next to the weight-only one on DeiT-B, on this machine.

    python benchmarks/data_aware_bench.py                                  # DeiT-B, 256 images, key dim 384, CPU
    python benchmarks/data_aware_bench.py --device cuda                    # the same on a GPU (bfloat16 capture)
    python benchmarks/data_aware_bench.py --model deit_tiny_patch16_224 --images 8 --key-dim 96 --refine-steps 1

Rows: the weight-only conversion; the recipe at ``effort="fast"`` (token capture in bfloat16 as ``Recipe(amp=True)``
with ``--amp``, the default on CUDA as in ``collab-vit convert``; both fits measured on the held-out images); the
refinement's seconds per step (batch 64) and a forward pass's seconds per image, timed on one batch of the weight-only
start; from them the default effort's projected total with the recipe's default views: the source scores the
``views - 1`` new views of every fitting image, the refinement checks its loss over all its inputs before and after
(two passes), and takes ``ceil(passes x fitting images / 64)`` steps. Random weights and images (the cost does not
depend on them). Prints a Markdown table; take the numbers on a quiet machine.
"""
from __future__ import annotations

import argparse
import copy
import math
import platform
import time

import timm
import torch

from collab_vit.conversion.capture import model_outputs
from collab_vit.conversion.recipe import EFFORTS, Recipe, split
from collab_vit.conversion.refine import refine_logits
from collab_vit.conversion.reparam import convert_model


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deit_base_patch16_224")
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--key-dim", type=int, default=384)
    p.add_argument("--refine-steps", type=int, default=2, help="steps timed for the refinement's cost per step")
    p.add_argument("--device", default="cpu", help="where the forward passes and the refinement run (cpu, cuda)")
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                   help="capture the tokens in bfloat16 (default: on CUDA only, as collab-vit convert)")
    args = p.parse_args()
    device = torch.device(args.device)
    amp = device.type == "cuda" if args.amp is None else args.amp
    torch.manual_seed(0)
    source = timm.create_model(args.model).eval().to(device)
    images = torch.randn(args.images, *source.pretrained_cfg["input_size"], generator=torch.Generator().manual_seed(1))
    recipe = Recipe(amp=amp)
    weight_only, _ = timed(lambda: convert_model(copy.deepcopy(source), args.key_dim, "tucker", None, "fast", 0,
                                                 False, recipe))
    fast, report = timed(lambda: convert_model(copy.deepcopy(source), args.key_dim, "tucker", images, "fast", 0,
                                               False, recipe))
    fit = split(args.images, None)
    model = copy.deepcopy(source)
    convert_model(model, args.key_dim, "tucker", None, "fast", 0, False, recipe)
    timing = images[:min(fit, 64)].to(device)  # one batch: a step's cost does not depend on the pool
    targets = model_outputs(source, timing, 64)
    layers = [m for m in model.modules() if type(m).__name__ == "CollaborativeAttention"]
    passes, _ = timed(lambda: refine_logits(model, layers, timing, targets, 0, progress=False))
    steps_wall, _ = timed(lambda: refine_logits(model, layers, timing, targets, args.refine_steps, progress=False))
    per_step = (steps_wall - passes) / args.refine_steps
    forward = passes / (2 * timing.shape[0])  # the two loss passes, per image
    views = recipe.views
    steps = math.ceil(EFFORTS["default"][0] * fit / 64)
    extra = ((views - 1) * fit + 2 * views * fit) * forward  # scoring the new views, the before/after passes
    projected = fast + extra + steps * per_step
    summary = report.summary
    print(f"{args.model}, key dim {args.key_dim}, {args.images} calibration images ({fit} fit, "
          f"{args.images - fit} held out); {platform.machine()}, {args.device}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}\n")
    print("| conversion | wall s | token capture s | held-out KL weight-only / closed form | x weight-only |\n"
          "|---|---:|---:|---|---:|")
    print(f"| weight-only | {weight_only:.1f} | — | — | 1.00 |")
    kls = " / ".join(f"{summary['candidates'][c]:.3g}" for c in ("weight", "whitened"))
    print(f"| recipe, effort fast, {'bfloat16' if amp else 'float32'} capture | {fast:.1f} | "
          f"{summary['capture_seconds']:.1f} | {kls} | {fast / weight_only:.2f} |")
    print(f"| recipe, effort default ({views} views, {steps} steps), projected | {projected:.0f} | | | "
          f"{projected / weight_only:.1f} |")
    print(f"\nrefinement: {per_step:.2f} s per step (batch 64, {args.refine_steps} steps timed); forward "
          f"{forward:.3f} s per image; the views and the loss passes: {extra:.0f} s")


if __name__ == "__main__":
    main()
