"""Cost of the data-aware conversion next to the weight-only one (issue target: the closed form on DeiT-B's 12
layers to key dim 384 with 256 calibration images at 224 px in at most 2x the weight-only time, forward passes
included), where the time goes, the peak bytes of calibration tokens held, and the refinement's cost per step.

    python benchmarks/data_aware_bench.py                                  # DeiT-B, 256 images, key dim 384
    python benchmarks/data_aware_bench.py --model deit_tiny_patch16_224 --images 8 --key-dim 96 --refine-steps 2

Random weights (the cost does not depend on them) and random images. Prints a Markdown table; take the numbers on
a quiet machine (one thread per decomposition, as the conversion does).
"""
from __future__ import annotations

import argparse
import copy
import platform
import time

import timm
import torch

import collab_vit


ROWS = {"source": ("source", False), "sequential": ("sequential", False), "source-amp": ("source", True),
        "sequential-amp": ("sequential", True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deit_base_patch16_224")
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--key-dim", type=int, default=384)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--refine-steps", type=int, default=3, help="steps timed for the refinement's cost per step "
                   "(0: not timed)")
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), help="conversions timed (default: all)")
    p.add_argument("--threads", type=int, default=0, help="torch threads for the forward passes (0: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    source = timm.create_model(args.model).eval()
    images = torch.randn(args.images, *source.pretrained_cfg["input_size"], generator=torch.Generator().manual_seed(1))
    rows = []

    start = time.perf_counter()
    reports = collab_vit.reparametrize_layers(copy.deepcopy(source), args.key_dim, progress=False)
    rows.append(("weight-only", time.perf_counter() - start, sum(r.seconds for r in reports), 0.0, 0))
    for capture, amp in (ROWS[row] for row in ROWS if row in args.rows):
        start = time.perf_counter()
        reports = collab_vit.reparametrize_layers(copy.deepcopy(source), args.key_dim, calibration=images,
                                                  capture=capture, batch_size=args.batch_size, amp=amp,
                                                  progress=False)
        rows.append((f"data-aware, {capture} tokens" + (", bf16 capture (`amp=True`)" if amp else ""),
                     time.perf_counter() - start, sum(r.seconds for r in reports),
                     reports.summary["capture_seconds"], reports.summary["peak_token_bytes"]))
    refine = collab_vit.reparametrize_layers(copy.deepcopy(source), args.key_dim, calibration=images,
                                             refine_steps=args.refine_steps, batch_size=args.batch_size,
                                             progress=False).summary["refine"] if args.refine_steps else None

    print(f"{args.model}, key dim {args.key_dim}, {args.images} calibration images, batch {args.batch_size}; "
          f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}\n")
    print("| conversion | wall s | fits (whitening + decomposition) s | forward passes, moments s | "
          "peak calibration tokens held (MB) |\n|---|---:|---:|---:|---:|")
    for name, wall, fits, capture, peak in rows:
        print(f"| {name} | {wall:.1f} | {fits:.1f} | {capture:.1f} | {peak / 2**20:.1f} |")
    if refine:
        print(f"\nrefinement: {refine['seconds'] / max(refine['steps'], 1):.2f} s per step (batch {args.batch_size}, "
              f"{refine['steps']} steps)")


if __name__ == "__main__":
    main()
