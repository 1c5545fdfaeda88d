"""The blockwise default's constants chosen leave-one-source-out on top-1, over many sources (RESULTS.md, "The
constants").

    python experiments/blockwise_loso.py grid --source runs/sources/e5-s0/model.safetensors --name e5-s0
    python experiments/blockwise_loso.py choose          # after the grid of every source
    python experiments/blockwise_loso.py check --results results/blockwise_preregistered

``grid`` converts one trained Fashion-MNIST source (``experiments/sources.sh``) at key dims D/8 and D/16 with the
package's calibrated recipe as ``collab-vit convert`` runs it (2048 training images, a seeded draw, blockwise
refinement of the better start), driving ``RecipeRun``, once per refinement lr (``--lrs``) and count of the guard's
held-out images (``--holdouts``, out of the 2048; default: the package's, 256), with the refinement's passes
(``--passes``) read along one run: each layer draws its own minibatches, so a run of fewer steps is the longer one's
prefix, layer by layer, and a layer whose loss over all the images rose keeps its start, as ``refine_blocks`` does.
Since the refinement reads each layer's tokens from the converted model (``blockwise.converted_calls``, after the
grids of results/blockwise_loso were taken), a shorter snapshot of a layer after the first was trained on the tokens
the longest run of the layers before it gives, and its "rose" is judged on the source's tokens: only the longest
snapshot is the package's run, the shorter ones approximate theirs (on a one-layer model every snapshot is the
package's run, to the bit: ``tests/test_blockwise_loso.py``).
Each JSON (one per key dim, lr and held-out count) holds every candidate's per-image held-out KL (what the guard
scores) and its test predictions (right or wrong per image, packed bits) for every start and snapshot.

``choose`` replays the guard (``recipe.choose``) for every setting (lr, passes, the guard's confidence and held-out
count), picks the setting for each source by the best mean top-1 gain over weight-only on the other sources (both key
dims), and writes ``loso.md``: each source's top-1 change from constants chosen without it, with a 95 % paired
interval over the test images, against the issue's targets; the setting chosen on all sources; each constant alone;
and ``loso.png``. ``check`` reports the sources of another folder (the pre-registered ones) under the package's
default alone (``check.md``).
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import statistics
from dataclasses import dataclass, fields, replace
from pathlib import Path
from statistics import fmean
from typing import Optional

import numpy as np
import torch

from data_aware import test_set
from whole_block import BlockRun
from runner import ROOT, figure, git_commit, log2_axes, machine, write_json

from collab_vit.cli import calibration_loader
from collab_vit.conversion.calibration.blockwise import mean_loss, source_outputs
from collab_vit.conversion.calibration.capture import calibration_images
from collab_vit.conversion.files.commands import load_source
from collab_vit.conversion.calibration.recipe import (IMAGES, PASSES, SAMPLES, Candidate, Recipe, RecipeRun,
                                                      choose, copies, split)
from collab_vit.conversion.reparam import probe_input_size, timm_attention_layers
from collab_vit.conversion.weights.rotary import is_rotary

FRACTIONS = (8, 16)  # key dims D/8 and D/16
CONFIDENCES = (0.9, 0.95)


@dataclass(frozen=True)
class Setting:
    """One choice of the blockwise default's constants."""

    lr: float
    passes: int
    confidence: float = 0.95
    holdout: int = 64  # held-out images of the guard, out of the calibration images

    def label(self) -> str:
        return f"lr {self.lr:g}, {self.passes} passes, confidence {self.confidence:g}, {self.holdout} held out"


@torch.no_grad()
def predictions(model: torch.nn.Module, test: tuple) -> np.ndarray:
    """Per test image: right (True) or wrong."""
    model.eval()
    images, labels = test
    return torch.cat([model(x).argmax(-1) == y for x, y in zip(images.split(500), labels.split(500))]).numpy()


def packed(right: np.ndarray) -> dict:
    return {"top1": 100.0 * float(right.mean()), "right": np.packbits(right).tobytes().hex()}


def unpacked(entry: dict, n: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(bytes.fromhex(entry["right"]), dtype=np.uint8))[:n].astype(bool)


def snapshots(run: RecipeRun, base: Candidate, passes: list[int], test: tuple) -> list[dict]:
    """``base`` refined blockwise for the most ``passes``; each snapshot as the package's run of that many passes
    gives it (a layer whose loss over all the images rose keeps its start), measured on the held-out images and the
    test images."""
    fit, batch = run.source.fit, run.recipe.batch_size
    steps = {math.ceil(p * fit / batch): p for p in passes}
    if len(steps) < len(passes):
        raise SystemExit(f"passes {passes} give the same step counts for {fit} fitting images")
    calls = run.cached_calls(every_layer=True)
    device = next(run.model.parameters()).device
    # what is refined: each attention layer, or (``whole_block.BlockRun``) each layer inside its block
    block = isinstance(run, BlockRun)
    sources = run.source_blocks if block else run.originals
    units = run.units(base.fits) if block else [f.layer for f in base.fits]
    targets = [source_outputs(s, c, batch, device) for s, c in zip(sources, calls)]
    first = [mean_loss(u, c, t, batch, device) for u, c, t in zip(units, calls, targets)]
    states: dict[int, list[Optional[dict]]] = {p: [None] * len(base.fits) for p in passes}

    def on_step(layer: torch.nn.Module, index: int, step: int) -> None:
        if step in steps:
            rose = mean_loss(layer, calls[index], targets[index], batch, device) > first[index]
            kept = layer.attn if block else layer  # what the snapshot loads into the fit's layer
            states[steps[step]][index] = None if rose else copy.deepcopy(kept.state_dict())

    refined = run.blockwise(base, max(steps), on_step)
    out = []
    for p in passes:
        fits = copies(base.fits)
        for f, state in zip(fits, states[p]):
            if state is not None:
                f.layer.load_state_dict(state)
        candidate = run.measure(Candidate(refined.name, fits))
        out.append({"passes": p, "steps": max(k for k, v in steps.items() if v == p), "held": candidate.held.tolist(),
                    "kept_start": sum(s is None for s in states[p]), **packed(predictions(run.model, test))})
    out[-1]["seconds"] = refined.refine["seconds"]
    return out


def prepared(args: argparse.Namespace) -> tuple:
    """From ``args`` (``--source``, ``--data-dir``, ``--images``, ``--seed``, ``--threads``): the source in eval mode,
    its test set, its calibration images, its attention layers, whether they are rotary, and D."""
    torch.set_num_threads(args.threads)
    source, _, _, meta = load_source(None, str(args.source))
    source.eval()
    test = test_set(args.data_dir, source, meta)
    loader = calibration_loader("torch/fashion_mnist", args.data_dir, "train", args.images, source,
                                meta.get("data_config"), args.seed)
    images = calibration_images(loader, probe_input_size(source))
    layers = timm_attention_layers(source)
    rotary = any(is_rotary(attn, source) for _, attn in layers)
    return source, test, images, layers, rotary, layers[0][1].num_heads * layers[0][1].head_dim


def grid(args: argparse.Namespace) -> None:
    source, test, images, layers, rotary, full = prepared(args)
    reference = packed(predictions(source, test))
    print(f"{args.name}: source top-1 {reference['top1']:.2f}, D {full}{', rotary' if rotary else ''}", flush=True)
    for key_dim, lr, holdout in itertools.product([full // f for f in FRACTIONS], args.lrs, args.holdouts or [None]):
        held = args.images - split(args.images, holdout)
        path = args.results / args.name / f"k{key_dim}_lr{lr:g}_held{held}.json"
        if path.exists():
            continue
        model = copy.deepcopy(source).eval()
        recipe = Recipe(refine_lr=lr, holdout=holdout, bf16=args.bf16, samples=args.samples or SAMPLES)
        run = (BlockRun if args.target == "block" else RecipeRun)(
            model, timm_attention_layers(model), images, recipe, args.seed, rotary)
        dims = [key_dim] * len(run.layers)
        starts = {}
        for name in run.starts.names:
            candidate = run.fit_start(name, dims)
            starts[name] = {"held": candidate.held.tolist(), **packed(predictions(model, test)),
                            "candidate": candidate}
        base = min(starts, key=lambda n: starts[n]["candidate"].held_kl)  # the start the package refines
        snaps = snapshots(run, starts[base]["candidate"], args.passes, test)
        for entry in starts.values():
            del entry["candidate"]
        row = {"source": args.name, "source_top1": reference["top1"], "source_right": reference["right"],
               "rotary": rotary, "full": full, "key_dim": key_dim, "lr": lr, "images": args.images,
               "fit": run.source.fit, "samples": recipe.samples, "bf16": run.bf16, "target": args.target,
               "starts": starts,
               "refined_from": base,
               "snapshots": snaps, "test_images": int(test[1].numel()), "commit": git_commit(),
               "machine": machine()}
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, row)
        shown = " / ".join(f"{s['top1']:.2f}" for s in snaps)
        print(f"{args.name} k{key_dim} lr {lr:g} held {held}: weight {starts['weight']['top1']:.2f}, {base} "
              f"{starts[base]['top1']:.2f}, refined {shown} at {args.passes} passes, "
              f"{snaps[-1]['seconds']:.0f} s", flush=True)


def kept(row: dict, setting: Setting, seed: int = 0) -> tuple[str, dict]:
    """The candidate the package keeps under ``setting`` (``recipe.choose`` on the stored per-image held-out KL)."""
    snap = next(s for s in row["snapshots"] if s["passes"] == setting.passes)
    entries = {**row["starts"], f"{row['refined_from']}+blocks": snap}
    pool = [Candidate(name, [], fmean(e["held"]), held=torch.tensor(e["held"], dtype=torch.float64))
            for name, e in entries.items()]
    best, _ = choose(pool, setting.confidence, seed)
    return best.name, entries[best.name]


def held_out(row: dict) -> int:
    return len(row["starts"]["weight"]["held"])


def load_rows(results: Path, lr: Optional[float] = None) -> list[dict]:
    rows = [json.loads(p.read_text()) for p in sorted(results.glob("*/k*_lr*.json"))]
    return [r for r in rows if lr is None or r["lr"] == lr]


def outcomes(rows: list[dict]) -> dict[tuple[str, int], dict[Setting, float]]:
    """(source, key dim) -> setting -> the kept candidate's top-1 minus weight-only's."""
    table: dict[tuple[str, int], dict[Setting, float]] = {}
    for row in rows:
        for snap in row["snapshots"]:
            for confidence in CONFIDENCES:
                setting = Setting(row["lr"], snap["passes"], confidence, held_out(row))
                gain = kept(row, setting)[1]["top1"] - row["starts"]["weight"]["top1"]
                table.setdefault((row["source"], row["key_dim"]), {})[setting] = gain
    return table


def leave_one_out(table: dict[tuple[str, int], dict[Setting, float]]) -> dict[str, Setting]:
    """For each source (and "all"), the setting with the best mean gain over weight-only on the other sources' cells,
    among the settings measured on every cell; ties to the first of a fixed order (fewer passes first)."""
    common = set.intersection(*(set(v) for v in table.values()))
    order = sorted(common, key=lambda c: (c.passes, c.lr, -c.confidence, c.holdout))
    chosen = {}
    for held_out in [*sorted({s for s, _ in table}), None]:
        cells = [v for (s, _), v in table.items() if s != held_out]
        chosen[held_out or "all"] = max(order, key=lambda c: fmean(v[c] for v in cells))
    return chosen


def paired(row: dict, entry: dict, against: Optional[dict] = None) -> tuple[float, float]:
    """Top-1 change of ``entry`` against the source (or ``against``) and the half-width of its 95 % interval, paired
    over the test images (normal approximation of the mean of per-image differences in {-1, 0, 1})."""
    n = row["test_images"]
    diff = unpacked(entry, n).astype(float) - unpacked(against or {"right": row["source_right"]}, n).astype(float)
    return 100.0 * diff.mean(), 100.0 * 1.96 * diff.std(ddof=1) / math.sqrt(n)


HEADER = ("Top-1 on the 10k test images, change against the source with a 95 % interval paired over the test images; "
          "'share': the recipe's drop over weight-only's where weight-only loses >= 0.5 (target <= 0.5, moonshot "
          "<= 1/3); 'vs weight': recipe minus weight-only (target >= -0.1); 'refined alone': the blockwise candidate, "
          "whatever the guard kept.")


def targets(rows: list[dict], table: dict[tuple[str, int], dict[Setting, float]], chosen: dict[str, Setting]
            ) -> list[str]:
    """Each source's cells (``table``: ``outcomes(rows)``) under the setting ``chosen`` for it, against the issue's
    targets (a markdown table and a count)."""
    by_cell = {(r["source"], r["key_dim"], r["lr"], held_out(r)): r for r in rows}
    lines = ["| source | top-1 | key dim | setting | weight-only | refined alone | recipe (kept) | vs weight | share | "
             "targets |", "|---|---:|---:|---|---:|---:|---|---:|---:|---|"]
    met_all, halves = [], []
    for (name, key_dim), values in sorted(table.items()):
        setting = chosen[name]
        row = by_cell[(name, key_dim, setting.lr, setting.holdout)]
        weight = row["starts"]["weight"]["top1"] - row["source_top1"]
        which, entry = kept(row, setting)
        change, half = paired(row, entry)
        share = change / weight if weight <= -0.5 else None
        met = values[setting] >= -0.1 and (share is None or share <= 0.5)
        met_all.append(met)
        if share is not None:
            halves.append(share <= 0.5)
        alone = next(s for s in row["snapshots"] if s["passes"] == setting.passes)["top1"] - row["source_top1"]
        lines.append(f"| {name} | {row['source_top1']:.2f} | {key_dim} | {setting.label()} | {weight:+.2f} | "
                     f"{alone:+.2f} | {change:+.2f} ± {half:.2f} ({which}) | {values[setting]:+.2f} | "
                     f"{'—' if share is None else f'{share:.2f}'} | {'met' if met else 'missed'}"
                     f"{' (moonshot)' if share is not None and share <= 1 / 3 else ''} |")
    return lines + ["", f"Targets met in {sum(met_all)} of {len(met_all)} cells; at most half of weight-only's drop "
                    f"in {sum(halves)} of {len(halves)} cells where it loses >= 0.5.", ""]


def report(results: Path) -> None:
    rows = load_rows(results)
    table = outcomes(rows)
    chosen = leave_one_out(table)
    lines = ["# The blockwise default's constants by leave-one-source-out (experiments/blockwise_loso.py)", "",
             f"{len({s for s, _ in table})} sources, key dims D/8 and D/16, {rows[0]['images']} calibration images "
             "(the held-out ones among them); each source's setting chosen without it. " + HEADER, "",
             f"Chosen on all sources: **{chosen['all'].label()}**.", "", *targets(rows, table, chosen)]
    (results / "loso.md").write_text("\n".join(lines) + "\n" + sensitivity(table, chosen["all"]))
    plot(table, {(r["source"], r["key_dim"]): r["full"] // r["key_dim"] for r in rows}, chosen["all"],
         results / "loso.png")
    print((results / "loso.md").read_text())


def package_default(images: int = IMAGES["full"]) -> Setting:
    """The package's blockwise recipe these grids chose (``--effort full``: 16 passes; the default at a fixed
    compute spends 8 passes on 640 images, ``experiments/fixed_compute.py``) as a setting, at ``images`` calibration
    images."""
    recipe = Recipe()
    return Setting(recipe.refine_lr, PASSES["full"], recipe.confidence, images - split(images, recipe.holdout))


def check(results: Path) -> None:
    """The pre-registered check: every source in ``results`` under the package's default alone (``check.md``)."""
    rows = load_rows(results)
    setting = package_default(rows[0]["images"])
    lines = ["# The pre-registered check of the frozen blockwise default (experiments/blockwise_loso.py check)", "",
             f"Sources converted only after the defaults were frozen (their seeds fixed beforehand in "
             f"experiments/sources.sh); {rows[0]['images']} calibration images, the package's default recipe: "
             f"{setting.label()}. " + HEADER, "",
             *targets(rows, outcomes(rows), {r["source"]: setting for r in rows})]
    (results / "check.md").write_text("\n".join(lines))
    print((results / "check.md").read_text())


def sensitivity(table: dict[tuple[str, int], dict[Setting, float]], best: Setting) -> str:
    """Each constant varied alone around ``best``: mean and worst gain over weight-only across every cell."""
    lines = ["## Each constant alone", "", f"Around the all-source choice ({best.label()}): recipe top-1 minus "
             "weight-only over every source and key dim.", "", "| constant | value | mean | worst | cells |",
             "|---|---|---:|---:|---:|"]
    for f in fields(Setting):
        for value in sorted({getattr(c, f.name) for v in table.values() for c in v}):
            setting = replace(best, **{f.name: value})
            gains = [v[setting] for v in table.values() if setting in v]
            if not gains:
                continue  # not measured with the other constants at their choice
            mark = " (chosen)" if value == getattr(best, f.name) else ""
            lines.append(f"| {f.name} | {value}{mark} | {fmean(gains):+.3f} | {min(gains):+.2f} | {len(gains)} |")
    return "\n".join(lines) + "\n"


def plot(table: dict[tuple[str, int], dict[Setting, float]], fractions: dict[tuple[str, int], int], best: Setting,
         path: Path) -> None:
    """Gain over weight-only against passes, a panel per key dim (``fractions``: D / key dim of each cell): each
    source at the all-source choice (thin), and the median over the sources for each lr and held-out count (one
    source's large gains, e.g. the rotary one's, do not move a median)."""
    fig = figure(9, 3.8)
    for i, fraction in enumerate(FRACTIONS):
        ax = fig.add_subplot(1, len(FRACTIONS), i + 1)
        cells = {cell: v for cell, v in table.items() if fractions[cell] == fraction}
        points = sorted({c.passes for v in cells.values() for c in v})
        for (name, _), v in sorted(cells.items()):
            ys = [v.get(replace(best, passes=p), math.nan) for p in points]
            ax.plot(points, ys, color="0.75", lw=0.8)
            ax.annotate(name, (points[-1], ys[-1]), fontsize=5, color="0.5")
        for lr, holdout in sorted({(c.lr, c.holdout) for v in cells.values() for c in v}):
            settings = [replace(best, lr=lr, holdout=holdout, passes=p) for p in points]
            ys = [statistics.median(v[c] for v in cells.values()) if all(c in v for v in cells.values())
                  else math.nan for c in settings]
            if all(map(math.isnan, ys)):
                continue  # not measured on every source
            ax.plot(points, ys, marker="o", label=f"median, lr {lr:g}, {holdout} held out")
        log2_axes(ax, ("refinement passes over the fitting images", "recipe top-1 minus weight-only",
                       f"key dim D/{fraction} ({len(cells)} sources)"), (0.0, "weight-only"))
        ax.set_yscale("symlog", linthresh=1.0)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("grid", help="one source's grid of settings")
    g.add_argument("--source", type=Path, required=True, help="a trained model (.safetensors export)")
    g.add_argument("--name", required=True, help="the source's name in the results")
    g.add_argument("--data-dir", default="data")
    g.add_argument("--images", type=int, default=IMAGES["full"], help="calibration images (the recipe chosen here)")
    g.add_argument("--lrs", nargs="+", type=float, default=[1e-3, 3e-3])
    g.add_argument("--passes", nargs="+", type=int, default=[4, 8, 16, 32])
    g.add_argument("--holdouts", nargs="+", type=int, help="the guard's held-out images (default: the package's)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=2)
    g.add_argument("--bf16", type=int, choices=(0, 1), default=None,
                   help="the sensitivity pass and the steps in bfloat16 autocast (1) or float32 (0); default: the "
                   "package's rule on this device (recipe.bf16_native)")
    g.add_argument("--samples", type=int, default=None,
                   help="classes drawn per image for the sensitivities (default: the package's, recipe.SAMPLES)")
    g.add_argument("--target", choices=("attention", "block"), default="attention",
                   help="the refinement's output: the attention layer's (the package's) or its block's "
                   "(experiments/whole_block.py)")
    c = sub.add_parser("choose", help="leave-one-source-out choice over every grid in --results")
    k = sub.add_parser("check", help="the sources in --results under the package's default alone")
    for q in (g, c, k):
        q.add_argument("--results", type=Path, default=ROOT / "results" / "blockwise_loso")
    args = p.parse_args()
    if args.command == "grid":
        grid(args)
    elif args.command == "choose":
        report(args.results)
    else:
        check(args.results)


if __name__ == "__main__":
    main()
