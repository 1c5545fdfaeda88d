"""The calibrated default at a fixed compute (issue 56): top-1 of the blockwise refinement by calibration images and
passes, against the compute each costs on DeiT-B, from ``blockwise_loso.py`` grids run at several image counts:

    for n in 640 1024 2048; do
        python experiments/blockwise_loso.py grid --source runs/sources/e5-s0/model.safetensors --name e5-s0-n$n \\
            --data-dir data --images $n --lrs 0.001 --passes 4 8 16 --threads 1 --results results/fixed_compute
    done
    python experiments/fixed_compute.py --results results/fixed_compute    # table.md, compute.png

Compute: the recipe's parts in forward passes of the source per image (``recipe.COST``, measured on DeiT-B) times
DeiT-B's forward on the 2-core CPU (``--forward``, seconds per image: benchmarks/data_aware_bench.md), the closed
forms aside. Top-1 change against the source with a 95 % interval paired over the 10k test images; 'vs old
default': against 2048 images and 16 passes (the default before issue 56) on the same source and key dim.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # blockwise_loso beside this file
from blockwise_loso import unpacked  # noqa: E402
from runner import figure  # noqa: E402

from collab_vit.conversion.calibration.recipe import COST, SAMPLES, split  # noqa: E402

OLD = (2048, 16)  # the default before issue 56


def seconds(images: int, passes: int, forward: float, held_measures: int = 3) -> float:
    """DeiT-B seconds of the recipe's passes over ``images`` at ``passes`` (``recipe.plan``'s model)."""
    fit = split(images, None)
    units = images * COST["capture"] + (images - fit) * held_measures + fit * (
        COST["sensitivity"] + COST["per_class"] * SAMPLES + COST["replay"] + COST["step"] * passes)
    return units * forward


def paired(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Mean of ``a - b`` in points and its 95 % half-width, paired over the images."""
    d = a.astype(float) - b.astype(float)
    return 100 * d.mean(), 100 * 1.96 * d.std(ddof=1) / math.sqrt(d.size)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=Path("results/fixed_compute"))
    p.add_argument("--forward", type=float, default=0.2, help="DeiT-B's forward, seconds per image")
    args = p.parse_args()
    cells: dict[tuple, dict] = {}
    for path in sorted(args.results.glob("*/k*.json")):
        row = json.loads(path.read_text())
        n = row["test_images"]
        source = unpacked({"right": row["source_right"]}, n)
        weight = unpacked(row["starts"]["weight"], n)
        for snap in row["snapshots"]:
            cells[(row["source"].split("-n")[0], row["key_dim"], row["images"], snap["passes"])] = {
                "right": unpacked(snap, n), "source": source, "weight": weight}
    lines = ["| source | key dim | images | passes | DeiT-B s | vs source | vs weight-only | vs old default |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    fig = figure(9, 3.6)
    axes = fig.subplots(1, 2)
    for (name, key_dim, images, passes), c in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][3])):
        old = cells.get((name, key_dim, *OLD))
        vs = [paired(c["right"], c[ref]) for ref in ("source", "weight")]
        against = "" if old is None else "{:+.2f} ± {:.2f}".format(*paired(c["right"], old["right"]))
        cost = seconds(images, passes, args.forward)
        lines.append(f"| {name} | {key_dim} | {images} | {passes} | {cost:.0f} | {vs[0][0]:+.2f} ± {vs[0][1]:.2f} | "
                     f"{vs[1][0]:+.2f} ± {vs[1][1]:.2f} | {against} |")
        ax = axes[0 if key_dim == min(k for _, k, _, _ in cells) else 1]
        ax.errorbar(cost, vs[0][0], yerr=vs[0][1], fmt="o", color=f"C{[640, 1024, 2048].index(images) % 10}")
        ax.annotate(f"{images}/{passes}", (cost, vs[0][0]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for ax, key_dim in zip(axes, sorted({k for _, k, _, _ in cells})):
        ax.axvline(1800, color="grey", ls="--", lw=0.8)
        ax.set(title=f"key dim {key_dim}", xlabel="DeiT-B seconds on the 2-core CPU (images/passes)",
               ylabel="top-1 change vs the source")
    fig.tight_layout()
    fig.savefig(args.results / "compute.png", dpi=120)
    (args.results / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
