"""Cost of the calibrated conversion (the recipe) next to the weight-only one on DeiT-B, on this machine.

    python benchmarks/data_aware_bench.py                                  # DeiT-B, 256 images, key dim 384
    python benchmarks/data_aware_bench.py --model deit_tiny_patch16_224 --images 8 --key-dim 96 --refine-steps 1

Rows: the weight-only conversion; the recipe at ``effort="fast"`` (token capture in bfloat16 as ``Recipe(amp=True)``,
float32 as well with ``--fp32``; both fits measured on the held-out images); the refinement's seconds per step
(batch 64) and of its guard (two passes over the fitting images), timed on one batch of the weight-only start,
and from them the default effort's projected total (``ceil(80 x fitting images / 64)`` steps). Random weights and images (the cost
does not depend on them). Prints a Markdown table; take the numbers on a quiet machine.
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
    return time.perf_counter() - start, result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deit_base_patch16_224")
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--key-dim", type=int, default=384)
    p.add_argument("--refine-steps", type=int, default=2, help="steps timed for the refinement's cost per step")
    p.add_argument("--fp32", action="store_true", help="also time the recipe with a float32 token capture")
    args = p.parse_args()
    torch.manual_seed(0)
    source = timm.create_model(args.model).eval()
    images = torch.randn(args.images, *source.pretrained_cfg["input_size"], generator=torch.Generator().manual_seed(1))
    rows = []
    wall, _ = timed(lambda: convert_model(copy.deepcopy(source), args.key_dim, "tucker", None, "fast", 0, False,
                                          Recipe()))
    rows.append(("weight-only", wall, None))
    weight_only = wall
    for amp in ((True, False) if args.fp32 else (True,)):
        wall, report = timed(lambda: convert_model(copy.deepcopy(source), args.key_dim, "tucker", images, "fast", 0,
                                                   False, Recipe(amp=amp)))
        rows.append((f"recipe, effort fast, {'bfloat16' if amp else 'float32'} capture", wall, report.summary))
    fast = rows[1][1]
    fit = split(args.images, None)
    model = copy.deepcopy(source)
    convert_model(model, args.key_dim, "tucker", None, "fast", 0, False, Recipe())
    timing = images[:min(fit, 64)]  # one batch: the per-step cost does not depend on the pool, the guard scales
    targets = model_outputs(source, timing, 64)
    layers = [m for m in model.modules() if type(m).__name__ == "CollaborativeAttention"]
    guard, _ = timed(lambda: refine_logits(model, layers, timing, targets, 0, progress=False))
    steps_wall, _ = timed(lambda: refine_logits(model, layers, timing, targets, args.refine_steps, progress=False))
    per_step = (steps_wall - guard) / args.refine_steps
    guard *= fit / timing.shape[0]
    default_steps = math.ceil(EFFORTS["default"][0] * fit / 64)
    print(f"{args.model}, key dim {args.key_dim}, {args.images} calibration images ({fit} fit, "
          f"{args.images - fit} held out); {platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}\n")
    print("| conversion | wall s | token capture s | held-out KL weight-only / closed form | x weight-only |\n"
          "|---|---:|---:|---|---:|")
    for name, wall, summary in rows:
        capture = f"{summary['capture_seconds']:.1f}" if summary else "—"
        kls = "—" if not summary else " / ".join(f"{summary['candidates'][c]:.3g}" for c in ("weight", "whitened"))
        print(f"| {name} | {wall:.1f} | {capture} | {kls} | {wall / weight_only:.2f} |")
    projected = fast + guard + default_steps * per_step
    print(f"\nper calibration image, recipe (fast) beyond weight-only: {(fast - weight_only) / args.images:.2f} s")
    print(f"refinement: {per_step:.2f} s per step (batch 64, {args.refine_steps} steps timed), guard passes "
          f"{guard:.1f} s; effort default = {default_steps} steps: projected {projected:.0f} s "
          f"({projected / weight_only:.1f}x weight-only)")


if __name__ == "__main__":
    main()
