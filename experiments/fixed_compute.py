"""The calibrated default at a fixed compute (RESULTS.md, "At a fixed compute: the default"): top-1 of the blockwise
refinement by calibration images, passes and the precision of its costly parts, against what each costs on DeiT-B,
from ``blockwise_loso.py`` grids:

    for s in e5-s0 e15-s20 e15-s21; do for n in 640 1024 2048; do
        python experiments/blockwise_loso.py grid --source runs/sources/$s/model.safetensors --name $s-n$n \\
            --data-dir data --images $n --lrs 0.001 --passes 4 8 16 --threads 1 --results results/fixed_compute
    done; python experiments/blockwise_loso.py grid ... --name $s-n640-bf16 --images 640 --bf16 1 ...
    # classes per image: --name $s-n768-bf16-s2 --samples 2 --passes 8 10; $s-n640-bf16-s8 --samples 8 --passes 8
    # the lr at the default's images: --name $s-n768-bf16 --images 768 --bf16 1 --lrs 0.002 0.004 --passes 4 8
    # the whole block as the target: --name $s-n768-bf16-block --target block --passes 2 3 4 6 8
    done
    python experiments/fixed_compute.py --results results/fixed_compute    # table.md, choice.md, compute.png

Compute: DeiT-B seconds on the 2-core CPU of the parts that grow with the images (``PARTS``, measured by
``benchmarks/data_aware_bench.py --bf16-parts``: the capture and the held-out measures, the sensitivity pass, the
converted tokens, each layer's steps), float32 or bfloat16 parts. Top-1 change against the source with a 95 % interval
paired over the 10k test images; 'vs old default': against 2048 images and 16 passes in float32 (the default before the
fixed-compute choice) on the same source and key dim. ``choice.md``: for each source, the recipe within ``--budget``
DeiT-B seconds with the best mean top-1 gain over weight-only on the *other* 15-epoch sources (both key dims; a recipe
must have been run on every source): the models users convert are well trained, so no choice trades them for the 5-epoch
ones, which are reported; then each recipe's mean gain by training length.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path
from statistics import fmean

import numpy as np
from matplotlib.lines import Line2D

sys.path.insert(0, str(Path(__file__).resolve().parent))  # blockwise_loso beside this file
from blockwise_loso import unpacked  # noqa: E402
from runner import figure  # noqa: E402

from collab_vit.conversion.calibration.recipe import COST, REFINE_LR, SAMPLES, split  # noqa: E402

OLD = (2048, 16, False, SAMPLES, REFINE_LR, "attention")  # the previous default: images, passes, bfloat16
# parts, classes per image, the refinement's lr and its target (the attention layer's output, or the block's:
# experiments/whole_block.py)
# DeiT-B seconds per image on the 2-core AMD EPYC (AVX512-BF16), measured end to end (benchmarks/data_aware_bench.md,
# 2026-12-07; recipe.COST): a float32 forward pass (the capture, each held-out measure), the converted tokens, source
# outputs and mean losses of every layer, the sensitivity pass with SAMPLES classes, one pass of every layer's steps;
# float32 and bfloat16 parts; FIXED: the rest (loading, weight-only and closed-form fits, writing)
PARTS = {False: {"forward": 0.23, "replay": 0.78, "sensitivity": 1.15, "step": 0.32},
         True: {"forward": 0.23, "replay": 0.78, "sensitivity": 0.765, "step": 0.216}}
FIXED = 200.0
BLOCK_STEP = Path(__file__).resolve().parents[1] / "results" / "fixed_compute" / "block_step.json"  # a block step's
# seconds over an attention step's on DeiT-B (``whole_block.py cost``)
WEIGHT_ONLY = 62.0  # the weight-only conversion in the same run: the budget is 40 times it


@functools.cache
def block_ratio() -> float:
    """A block step's seconds over an attention step's on DeiT-B, read once (``BLOCK_STEP``)."""
    return json.loads(BLOCK_STEP.read_text())["ratio"]


def seconds(images: int, passes: int, bf16: bool, samples: int = SAMPLES, lr: float = REFINE_LR,
            target: str = "attention", held_measures: int = 3) -> float:
    """DeiT-B seconds of the recipe at ``images`` and ``passes`` (``bf16``: its costly parts in bfloat16), ``samples``
    classes drawn per image (the sensitivity pass scaled as ``recipe.COST``: 1 + 1.4 per class); ``lr`` costs
    nothing; a step against the block's output costs ``BLOCK_STEP``'s ratio more."""
    fit, c = split(images, None), dict(PARTS[bf16])
    if target == "block":
        c["step"] *= block_ratio()
    sensitivity = c["sensitivity"] * (COST["sensitivity"] + COST["per_class"] * samples) / (
        COST["sensitivity"] + COST["per_class"] * SAMPLES)
    return FIXED + c["forward"] * (images + (images - fit) * held_measures) + fit * (
        sensitivity + c["replay"] + c["step"] * passes)


def paired(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Mean of ``a - b`` in points and its 95 % half-width, paired over the images."""
    d = a.astype(float) - b.astype(float)
    return 100 * d.mean(), 100 * 1.96 * d.std(ddof=1) / math.sqrt(d.size)


def load(results: Path) -> dict[tuple, dict]:
    """Every snapshot of the grids under ``results``: (source, key dim, images, passes, bf16, samples, lr, target)
    -> its test outcomes, the source's and the weight-only fit's."""
    cells: dict[tuple, dict] = {}
    for path in sorted(results.glob("*/k*.json")):
        row = json.loads(path.read_text())
        n = row["test_images"]
        source = unpacked({"right": row["source_right"]}, n)
        weight = unpacked(row["starts"]["weight"], n)
        for snap in row["snapshots"]:
            key = (row["source"].split("-n")[0], row["key_dim"], row["images"], snap["passes"], row.get("bf16", False),
                   row["samples"], row["lr"], row.get("target", "attention"))
            cells[key] = {"right": unpacked(snap, n), "source": source, "weight": weight}
    return cells


def recipe_name(recipe: tuple) -> str:
    images, passes, bf16, samples, lr, target = recipe
    classes = "" if samples == SAMPLES else f", {samples} classes"
    rate = "" if lr == REFINE_LR else f", lr {lr:g}"
    block = ", whole block" if target == "block" else ""
    return f"{images} x {passes}, {'bfloat16' if bf16 else 'float32'}{classes}{rate}{block}"


def choose(cells: dict[tuple, dict], budget: float, bf16: bool) -> list[str]:
    """``choice.md``'s lines: the recipe (images, passes, classes per image, target; its parts in the precision the
    device's rule gives, ``bf16``; the lr the package's) chosen leaving each source out, and what it gives that source;
    the same choice with the lr free, scored on the sources left out; each recipe's mean gain."""
    sources = sorted({k[0] for k in cells})
    dims = {s: sorted({k[1] for k in cells if k[0] == s}) for s in sources}
    free = sorted({k[2:] for k in cells if seconds(*k[2:]) <= budget and k[4] == bf16})
    fixed = [r for r in free if r[4] == REFINE_LR]

    def gain(source: str, recipe: tuple) -> float | None:
        found = [cells.get((source, d, *recipe)) for d in dims[source]]
        return None if None in found else fmean(paired(c["right"], c["weight"])[0] for c in found)

    def left_out(recipes: list[tuple]) -> dict[str, tuple]:
        """Each source's recipe, the best mean gain on the other 15-epoch sources (what users convert: no choice
        trades them for the 5-epoch ones)."""
        chosen = {}
        for left in sources:
            others = [s for s in sources if s != left]
            others = [s for s in others if s.startswith("e15")] or others
            scored = {r: [gain(s, r) for s in others] for r in recipes if gain(left, r) is not None}
            scored = {r: fmean(g) for r, g in scored.items() if others and None not in g}
            if scored:
                chosen[left] = max(scored, key=scored.get)
        return chosen

    lines = [f"Within {budget:.0f} DeiT-B seconds, {'bfloat16' if bf16 else 'float32'} parts, lr {REFINE_LR:g}; each "
             "source's recipe chosen on the other 15-epoch sources (best mean top-1 gain over weight-only, both key "
             "dims; the 5-epoch sources do not vote).", "",
             "| left out | recipe chosen on the others | DeiT-B s | key dim | vs weight-only | vs old default |",
             "|---|---|---:|---:|---:|---:|"]
    for left, best in left_out(fixed).items():
        for d in dims[left]:
            c, old = cells[(left, d, *best)], cells.get((left, d, *OLD))
            vs = "{:+.2f} ± {:.2f}".format(*paired(c["right"], c["weight"]))
            against = "" if old is None else "{:+.2f} ± {:.2f}".format(*paired(c["right"], old["right"]))
            lines.append(f"| {left} | {recipe_name(best)} | {seconds(*best):.0f} | {d} | {vs} | {against} |")
    lines += ["", "The choice scored on the sources it left out, with the lr fixed and free (mean gain over weight-only, "
              "both key dims; worst cell against weight-only):", "",
              "| lr | recipes chosen | 15-epoch sources | 5-epoch sources | worst cell |", "|---|---|---:|---:|---:|"]
    for label, pool in ((f"{REFINE_LR:g}", fixed), ("free", free)):
        chosen = left_out(pool)
        by = [[gain(s, r) for s, r in chosen.items() if s.startswith(e)] for e in ("e15", "e5")]
        worst = min(paired(cells[(s, d, *r)]["right"], cells[(s, d, *r)]["weight"])[0]
                    for s, r in chosen.items() for d in dims[s])
        names = "; ".join(sorted({recipe_name(r) for r in chosen.values()}))
        lines.append(f"| {label} | {names} | {fmean(by[0]) if by[0] else math.nan:+.2f} | "
                     f"{fmean(by[1]) if by[1] else math.nan:+.2f} | {worst:+.2f} |")
    lines += ["", "Each recipe's mean top-1 gain over weight-only, by training length (both key dims):", "",
              "| recipe | DeiT-B s | 5-epoch sources | 15-epoch sources |", "|---|---:|---:|---:|"]
    for recipe in sorted({k[2:] for k in cells}, key=lambda r: seconds(*r)):
        by = {e: [g for s in sources if s.startswith(e) and (g := gain(s, recipe)) is not None] for e in ("e5", "e15")}
        shown = [f"{fmean(v):+.2f} ({len(v)})" if v else "" for v in by.values()]
        lines.append(f"| {recipe_name(recipe)} | {seconds(*recipe):.0f} | {shown[0]} | {shown[1]} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=Path("results/fixed_compute"))
    p.add_argument("--budget", type=float, default=40 * WEIGHT_ONLY, help="DeiT-B seconds (default: 40 x weight-only)")
    p.add_argument("--bf16", type=int, choices=(0, 1), default=1,
                   help="the parts' precision of the recipes chosen among (the device's rule; 1: bfloat16 units)")
    args = p.parse_args()
    cells = load(args.results)
    lines = ["| source | key dim | recipe | DeiT-B s | vs source | vs weight-only | vs old default |",
             "|---|---:|---|---:|---:|---:|---:|"]
    fig = figure(9, 3.6)
    axes = fig.subplots(1, 2)
    for key, c in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], seconds(*kv[0][2:]))):
        name, key_dim, *recipe = key
        old = cells.get((name, key_dim, *OLD))
        vs = [paired(c["right"], c[ref]) for ref in ("source", "weight")]
        against = "" if old is None else "{:+.2f} ± {:.2f}".format(*paired(c["right"], old["right"]))
        cost = seconds(*recipe)
        lines.append(f"| {name} | {key_dim} | {recipe_name(tuple(recipe))} | {cost:.0f} | "
                     f"{vs[0][0]:+.2f} ± {vs[0][1]:.2f} | {vs[1][0]:+.2f} ± {vs[1][1]:.2f} | {against} |")
        ax = axes[0 if key_dim == min(k[1] for k in cells if k[0] == name) else 1]
        marker = ("^" if recipe[3] != SAMPLES else "D" if recipe[4] != REFINE_LR else "P" if recipe[5] == "block"
                  else "s" if recipe[2] else "o")
        ax.errorbar(cost, vs[1][0], yerr=vs[1][1], fmt=marker, ms=4,
                    color=f"C{sorted({k[0] for k in cells}).index(name) % 10}")
    for ax, title in zip(axes, ("D/16", "D/8")):
        ax.axvline(args.budget, color="grey", ls="--", lw=0.8)
        ax.set(title=f"key dim {title}", xlabel="DeiT-B seconds on the 2-core CPU",
               ylabel="top-1 gain over weight-only")
    names = sorted({k[0] for k in cells})
    axes[1].legend(handles=[Line2D([], [], color=f"C{i % 10}", marker="o", ls="", label=n) for i, n in
                            enumerate(names)], fontsize=7)
    fig.suptitle("circles: float32 parts, squares: bfloat16, triangles: 2 or 8 classes per image, diamonds: another "
                 "lr, plus: the whole block; dashed: the budget",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(args.results / "compute.png", dpi=120)
    (args.results / "table.md").write_text("\n".join(lines) + "\n")
    choice = choose(cells, args.budget, bool(args.bf16))
    (args.results / "choice.md").write_text("\n".join(choice) + "\n")
    print("\n".join(lines + [""] + choice))


if __name__ == "__main__":
    main()
