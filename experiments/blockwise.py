"""The blockwise refinement (``conversion/calibration/blockwise.py``) against the end-to-end one,
on top-1 (RESULTS_HISTORY.md, "Blockwise refinement").

    python experiments/blockwise.py --source runs/sources/e5-s2026/model.safetensors --name e5-s2026

For one trained Fashion-MNIST source at key dims 8 and 4 (D/8, D/16): the package default (``reparametrize`` with
256 calibration images: the end-to-end refinement) and, from the same closed-form starts (``RecipeRun``: the better of
weight-only and whitened on the held-out images), the blockwise refinement with ``--images`` calibration images
(each 64 held out) at ``--steps`` steps per layer. Each row: the 10k-test top-1 of every start, of the refined model
and of what the guard keeps (``recipe.choose`` over weight-only, whitened and the refined candidate), the held-out KL,
and the seconds of the capture and of the refinement. One JSON per source in ``--results``.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from data_aware import test_set, top1
from runner import git_commit, machine, write_json

from collab_vit import reparametrize
from collab_vit.cli import calibration_loader
from collab_vit.conversion.calibration.capture import calibration_images
from collab_vit.conversion.files.commands import load_source
from collab_vit.conversion.calibration.recipe import Recipe, RecipeRun, choose
from collab_vit.conversion.reparam import probe_input_size, timm_attention_layers


def images_of(args: argparse.Namespace, source: torch.nn.Module, meta: dict, count: int) -> torch.Tensor:
    loader = calibration_loader("torch/fashion_mnist", args.data_dir, "train", count, source,
                                meta.get("data_config"), args.seed)
    return calibration_images(loader, probe_input_size(source))


def blockwise_cell(source: torch.nn.Module, images: torch.Tensor, key_dim: int, steps: int, samples: int,
                   args: argparse.Namespace, test: tuple) -> dict:
    model = copy.deepcopy(source).eval()
    recipe = Recipe(holdout=64, samples=samples, refine_lr=args.lr, batch_size=args.batch)
    run = RecipeRun(model, timm_attention_layers(model), images, recipe, args.seed)
    dims = [key_dim] * len(run.layers)
    starts = {name: run.fit_start(name, dims) for name in ("weight", "whitened")}
    row = {"starts": {}}
    for name, candidate in starts.items():
        run.measure(candidate)
        row["starts"][name] = {"held_kl": candidate.held_kl, "top1": top1(model, *test)}
    base = min(starts.values(), key=lambda c: c.held_kl)
    began = time.perf_counter()
    refined = run.blockwise(base, steps)
    seconds = time.perf_counter() - began
    row["refined"] = {"from": base.name, "held_kl": refined.held_kl, "top1": top1(model, *test),
                      "cache_seconds": seconds - refined.refine["seconds"], **refined.refine}
    best, _ = choose([*starts.values(), refined], recipe.confidence, args.seed)
    run.install(best.fits)
    row["chosen"] = {"name": best.name, "top1": top1(model, *test)}
    return row


def table(results: Path) -> str:
    """Every cell of every JSON in ``results``, top-1 change against its source (Markdown)."""
    lines = ["| source | key dim | variant | images | steps per layer | batch | S | weight-only | refined | kept "
             "(guard) | seconds |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for path in sorted(results.glob("*.json")):
        out = json.loads(path.read_text())
        base = out["source_top1"]
        for c in out["cells"]:
            if c["variant"] == "default":
                lines.append(f"| {out['source']} | {c['key_dim']} | package default ({c['chosen']}) | {c['images']} "
                             f"| | | | | {c['top1'] - base:+.2f} | | "
                             f"{c['seconds']:.0f} |")
                continue
            r = c["refined"]
            lines.append(f"| {out['source']} | {c['key_dim']} | {c['variant']} from {r['from']} | {c['images']} | "
                         f"{c['steps']} | {c.get('batch', 64)} | {c.get('samples', 4 if c['variant'] == 'fisher' else 0)} | "
                         f"{c['starts']['weight']['top1'] - base:+.2f} | {r['top1'] - base:+.2f} | "
                         f"{c['chosen']['name']} {c['chosen']['top1'] - base:+.2f} | "
                         f"{r['cache_seconds'] + r.get('seconds', r.get('refine_seconds', 0)):.0f} |")  # (rows before 2026-12-03 14:20)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source")
    parser.add_argument("--name")
    parser.add_argument("--table", action="store_true", help="print the table of every JSON in --results and stop")
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--key-dims", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--images", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--steps", type=int, nargs="+", default=[500, 2000])
    parser.add_argument("--samples", type=int, nargs="+", default=[4],
                        help="S: each layer's Fisher form from S drawn classes (the plain squared error, the rows with "
                             "S = 0, was removed from the package after commit 40ceded)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=64, help="images per step of the blockwise refinement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-default", action="store_true", help="skip the package default (end to end)")
    parser.add_argument("--results", type=Path, default=Path("results/blockwise"))
    args = parser.parse_args()
    if args.table:
        print(table(args.results))
        return
    torch.set_num_threads(1)
    source, _, _, meta = load_source(None, args.source)
    source.eval()
    test = test_set(args.data_dir, source, meta)
    out = {"source": args.name, "source_top1": top1(source, *test), "commit": git_commit(), "machine": machine(),
           "cells": []}
    print(f"{args.name}: source {out['source_top1']:.2f}", flush=True)
    path = args.results / f"{args.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    for key_dim in args.key_dims:
        if not args.no_default:
            images = images_of(args, source, meta, 256)
            model = copy.deepcopy(source).eval()
            began = time.perf_counter()
            model, report = reparametrize(model, key_dim, calibration=images, seed=args.seed, progress=False,
                                          return_report=True)
            cell = {"key_dim": key_dim, "variant": "default", "images": 256, "seconds": time.perf_counter() - began,
                    "top1": top1(model, *test), "chosen": report.summary.get("chosen")}
            out["cells"].append(cell)
            print(f"k{key_dim} default: {cell['top1']:.2f} ({cell['chosen']}, {cell['seconds']:.0f} s)", flush=True)
            write_json(path, out)
        for count in args.images:
            images = images_of(args, source, meta, count)
            for steps, samples in [(t, s) for s in args.samples for t in args.steps]:
                cell = {"key_dim": key_dim, "variant": "fisher" if samples else "blocks", "images": count,
                        "steps": steps, "samples": samples, "batch": args.batch,
                        **blockwise_cell(source, images, key_dim, steps, samples, args, test)}
                out["cells"].append(cell)
                r = cell["refined"]
                print(f"k{key_dim} {cell['variant']} S={samples} {count} img {steps} steps batch {args.batch}: weight "
                      f"{cell['starts']['weight']['top1']:.2f} whitened {cell['starts']['whitened']['top1']:.2f} "
                      f"refined {r['top1']:.2f} (loss {r['loss_before']:.4g} -> {r['loss_after']:.4g}, cache "
                      f"{r['cache_seconds']:.0f} s, refine {r['seconds']:.0f} s) chosen "
                      f"{cell['chosen']['name']} {cell['chosen']['top1']:.2f}", flush=True)
                write_json(path, out)


if __name__ == "__main__":
    main()
