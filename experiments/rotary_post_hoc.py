"""RESULTS.md, "Rotary models": a rotary source (timm's RoPE-ViT trained on Fashion-MNIST) converted post hoc.

    python experiments/rotary_post_hoc.py --source runs/sources/rope_long-s0/model.safetensors \\
        --config configs/fmnist/rope_long.yaml --data-dir data

Every cell converts the source at a q/k dim per layer (no fine-tune) and evaluates top-1 on the 10k test images:

* ``select``: what a user would do otherwise at equal q/k parameters: each head keeps its ``K / (2 heads)``
  strongest pairs by MHA2MLA's 2-norm score ``||Wq pair|| ||Wk pair||`` and drops the rest (a standard rotary layer
  with fewer pairs, built here as the collaborative layer that computes it);
* ``uniform``: the per-frequency form with the same rank in every frequency (the issue's first row);
* ``optimal``: the per-frequency form with the ranks that minimise the summed tensor error (dynamic programming);
* ``weight``: ``collab_vit.reparametrize(model, K)``: the per-frequency form with ``R_p`` = the number of heads that
  keep ``p`` under ``select``, each fit started from that selection (the issue's third row);
* ``recipe``: ``collab_vit.reparametrize(model, K, calibration=--images training images)`` (default effort).

(``recipe-before``, an earlier default's whole-model refinement, left with that refinement when the options no
measurement kept were removed: its cells are in RESULTS_HISTORY.md.)

Also written: ``methods.md`` (the per-frequency decompositions against the dense complex float64 tensor: error and
seconds) and ``energy.md`` / ``energy.png`` (4(c): per frequency, the share of the heads' joint energy the first R
shared dims hold, the trained source against a fresh initialisation of its config, seed 0).
Writes ``results/rotary_post_hoc/<cell>.json``, ``table.md``, ``top1_vs_key_dim.png``.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from statistics import fmean

import numpy as np
import torch

from runner import ROOT, figure, git_commit, log2_axes, machine, write_json
from data_aware import test_set
from blockwise_loso import packed, paired, predictions

from collab_vit.cli import calibration_loader
from collab_vit.conversion.weights import rotary_fit
from collab_vit.conversion.calibration.capture import calibration_images
from collab_vit.conversion.reparam import probe_input_size, reparametrize, timm_attention_layers
from collab_vit.hub import save_pretrained
from collab_vit.training.build import build_model, load_weights
from collab_vit.training.config import build_config

VARIANTS = ["select", "uniform", "optimal", "weight", "recipe"]


def load(path: Path, config: str, seed: int = 0) -> tuple[torch.nn.Module, dict]:
    """The model of ``config`` (seeded init) with the weights of ``path`` (a ``.safetensors`` export or a training
    checkpoint; None: the init itself), eval mode; and the file's metadata."""
    cfg = build_config(config)
    torch.manual_seed(seed)
    kwargs = {**cfg.model_kwargs, "in_chans": cfg.in_chans}
    model = build_model(cfg.model, cfg.num_classes, cfg.img_size, 0.0, kwargs)
    meta = load_weights(model, str(path)) if path is not None else {}
    meta.setdefault("data_config", {"mean": cfg.mean, "std": cfg.std, "crop_pct": cfg.crop_pct,
                                    "interpolation": "bicubic", "input_size": (cfg.in_chans, cfg.img_size,
                                                                               cfg.img_size)})
    return model.eval(), meta


def swap(model: torch.nn.Module, name: str, layer: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, layer)


selection_layer = rotary_fit.selection_layer  # without a rope: ranked by ||T_ip||, as the recipe's "select" start
# was before the rotary weight-only rule (experiments/rotary_ranking.py compares the rankings)


def per_frequency(attn: torch.nn.Module, key_dim: int, variant: str) -> torch.nn.Module:
    """The per-frequency form at other ranks: ``uniform`` (``K / dh`` in every frequency) or ``optimal``."""
    freqs = rotary_fit.frequencies(attn)
    pairs = freqs.u.shape[0]
    fitted = rotary_fit.plan(freqs, allocation="optimal")
    ranks = [key_dim // (2 * pairs)] * pairs if variant == "uniform" else fitted.ranks[key_dim // 2]
    return rotary_fit.compressed_layer(attn, freqs, fitted.fits, ranks)


def convert(source: torch.nn.Module, key_dim: int, variant: str, calibration: torch.Tensor, seed: int
            ) -> tuple[torch.nn.Module, list[dict], dict]:
    """The converted copy of ``source``, one row per layer (key dim, tensor error) and the recipe's summary."""
    model = copy.deepcopy(source)
    if variant in ("weight", "recipe"):
        model, report = reparametrize(model, key_dim, calibration=calibration if variant == "recipe" else None,
                                      seed=seed, progress=False, return_report=True)
        return model, [r.as_dict() for r in report], report.summary
    rows = []
    for name, attn in timm_attention_layers(model):
        layer = (selection_layer(attn, key_dim) if variant == "select"
                 else per_frequency(attn, key_dim, variant))
        rows.append({"name": name, "key_dim": layer.key_dim, "tensor_error": rotary_fit.layer_error(attn, layer)})
        swap(model, name, layer.eval())
    return model, rows, {}


def run_cell(source: torch.nn.Module, key_dim: int, variant: str, calibration: torch.Tensor, test: tuple,
             args: argparse.Namespace) -> dict:
    path = args.results / f"{variant}_k{key_dim}.json"
    if path.exists():
        return json.loads(path.read_text())
    start = time.perf_counter()
    model, layers, summary = convert(source, key_dim, variant, calibration, args.seed)
    seconds = time.perf_counter() - start
    row = {"variant": variant, "key_dim": key_dim,
           "images": calibration.shape[0] if variant.startswith("recipe") else 0,
           "key_dims": [x["key_dim"] for x in layers], "tensor_error": fmean(x["tensor_error"] for x in layers),
           **packed(predictions(model, test)), "top1_source": args.top1_source, "source_right": args.source_right,
           "test_images": int(test[1].numel()), "seconds": round(seconds, 2),
           "per_layer": layers, "summary": summary, "commit": git_commit(), "machine": machine()}
    write_json(path, row)
    if key_dim in args.save and variant in ("select", "weight", "recipe"):
        save(model, variant, key_dim, args)
    print(f"{variant} k{key_dim}: top-1 {row['top1']:.2f} ({row['top1'] - args.top1_source:+.2f}), tensor error "
          f"{row['tensor_error']:.3f}, {seconds:.1f} s" + (f", kept {summary['chosen']}" if "chosen" in summary
                                                           else ""), flush=True)
    return row


def selection_table(folders: list[Path]) -> str:
    """The selection against the recipe (RESULTS.md, "Compressed: calibration at 3/4 and 1/2 of the q/k dims") across
    rotary sources (one ``--results`` folder each, cells with per-image predictions): per
    source and q/k dims, the selection, the weight-only conversion and the recipe (kept candidate) against the
    source, and the recipe minus the selection, each with its 95 % interval paired over the test images."""
    lines = ["| source | q/k dims | select | weight-only | recipe (kept) | recipe - select |",
             "|---|---:|---:|---:|---|---:|"]
    for folder in folders:
        for path in sorted(folder.glob("recipe_k*.json"), key=lambda p: -int(p.stem.split("_k")[1])):
            cells = {v: json.loads((folder / f"{v}_k{path.stem.split('_k')[1]}.json").read_text())
                     for v in ("select", "weight", "recipe")}
            row = cells["select"]
            shown = {v: "{:+.2f} ± {:.2f}".format(*paired(row, c)) for v, c in cells.items()}
            lines.append(f"| {folder.name} | {cells['recipe']['key_dim']} | {shown['select']} | {shown['weight']} | "
                         f"{shown['recipe']} ({cells['recipe']['summary']['chosen']}) | "
                         + "{:+.2f} ± {:.2f} |".format(*paired(row, cells["recipe"], cells["select"])))
    return "\n".join(lines) + "\n"


def save(model: torch.nn.Module, variant: str, key_dim: int, args: argparse.Namespace) -> None:
    """The converted model for experiments/rotary_finetune.sh: a hub folder (``weight``, ``recipe``), or the state
    dict (``select``: the architecture of the ``weight`` folder at the same key dim, other weights)."""
    args.runs.mkdir(parents=True, exist_ok=True)
    if variant == "select":
        torch.save(model.state_dict(), args.runs / f"select_k{key_dim}.pth")
    else:
        save_pretrained(model, str(args.runs / f"{variant}_k{key_dim}"), data_config=args.data_config)


def table(rows: list[dict], top1_source: float) -> str:
    keys = sorted({r["key_dim"] for r in rows}, reverse=True)
    found = {(r["variant"], r["key_dim"]): r for r in rows}
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    lines = [f"Source top-1 {top1_source:.2f} (10k test images); top-1 change right after conversion (tensor error "
             f"of the per-frequency forms, mean over layers); q/k dims per layer of 64.", "",
             "| q/k dims | " + " | ".join(variants) + " |", "|---|" + "---:|" * len(variants)]
    for k in keys:
        cells = []
        for v in variants:
            r = found.get((v, k))
            cells.append("—" if r is None else f"{r['top1'] - top1_source:+.2f} ({r['tensor_error']:.3f})")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    recipe = [found[("recipe", k)] for k in keys if ("recipe", k) in found]
    if recipe:
        lines += ["", f"Recipe: the candidates' held-out KL ({recipe[0]['images']} images, "
                  f"{recipe[0]['summary']['images_held_out']} held out; the better start refined), the one kept:", "",
                  "| q/k dims | weight | whitened | select | refined | kept |", "|---|---:|---:|---:|---:|---|"]
        for r in recipe:
            kl = r["summary"]["candidates"]
            refined = next((c for c in kl if "+" in c), None)
            select = f"{kl['select']:.4f}" if "select" in kl else "—"  # older cells lack it
            lines.append(f"| {r['key_dim']} | {kl['weight']:.4f} | {kl['whitened']:.4f} | {select} | " +
                         ("—" if refined is None else f"{kl[refined]:.4f} ({refined})") +
                         f" | {r['summary']['chosen']} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], top1_source: float, path: Path) -> None:
    fig = figure(7, 4.5)
    ax = fig.add_subplot()
    for variant in VARIANTS:
        pts = sorted((r["key_dim"], r["top1"]) for r in rows if r["variant"] == variant)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", lw=1.2, label=variant)
    log2_axes(ax, ("q/k dims per layer (of 64), equal q/k parameters", "Fashion-MNIST top-1 (%), no fine-tune",
                   "RoPE-ViT converted post hoc: per-frequency form vs each head keeping its strongest pairs"),
              (top1_source, "source"))
    fig.tight_layout()
    fig.savefig(path)


def dense(cp: rotary_fit.CP) -> torch.Tensor:
    return torch.einsum("ir,jr,kr->ijk", cp.mixing, cp.query, cp.key)


def closed_form(x: torch.Tensor, rank: int) -> torch.Tensor:
    """A complex SVD / Tucker-like closed form: the top ``rank`` left singular vectors of the query-mode and key-mode
    unfoldings, then the mixing by least squares (one ALS half-step)."""
    heads, d, e = x.shape
    a = torch.linalg.svd(x.permute(1, 0, 2).reshape(d, -1), full_matrices=False)[0][:, :rank]
    c = torch.linalg.svd(x.permute(2, 0, 1).reshape(e, -1), full_matrices=False)[0][:, :rank]
    m = rotary_fit.solve(torch.einsum("ijk,jr,kr->ir", x, a.conj(), c.conj()), rotary_fit.gram(a) * rotary_fit.gram(c))
    return torch.einsum("ir,jr,kr->ijk", m, a, c)


def tensorly_parafac(x: torch.Tensor, rank: int) -> torch.Tensor:
    """tensorly's CP-ALS on the dense complex tensor (SVD init, the paper's procedure over the complex numbers)."""
    import tensorly as tl
    from tensorly.decomposition import parafac
    cp = parafac(tl.tensor(x.numpy()), rank, init="svd", n_iter_max=100, tol=1e-10)
    return torch.from_numpy(np.asarray(tl.cp_to_tensor(cp)))


def methods(source: torch.nn.Module) -> str:
    """Every layer's frequencies at ranks 1..H-1 by each method, against the dense complex float64 tensor: the
    relative error (pooled over layers and frequencies) and the seconds (one thread)."""
    errors: dict[str, dict[int, float]] = {}
    seconds: dict[str, float] = {}
    energy = 0.0
    for _, attn in timm_attention_layers(source):
        freqs = rotary_fit.frequencies(attn)
        heads = attn.num_heads
        for p in range(freqs.u.shape[0]):
            x = torch.einsum("id,ie->ide", freqs.u[p], freqs.conj_v[p])
            energy += float((x.abs() ** 2).sum())
            began = time.perf_counter()
            fits = rotary_fit.fit_frequency(freqs.u[p], freqs.conj_v[p])
            seconds["complex CP-ALS on the compressed core (package)"] = seconds.get(
                "complex CP-ALS on the compressed core (package)", 0.0) + time.perf_counter() - began
            for rank in range(1, heads):
                approx = {"complex CP-ALS on the compressed core (package)": dense(fits[rank])}
                for label, fn in (("complex SVD closed form + least-squares mixing", closed_form),
                                  ("tensorly parafac on the dense complex tensor", tensorly_parafac)):
                    began = time.perf_counter()
                    approx[label] = fn(x, rank)
                    seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - began
                for label, y in approx.items():
                    errors.setdefault(label, {})
                    errors[label][rank] = errors[label].get(rank, 0.0) + float(((x - y).abs() ** 2).sum())
    ranks = sorted(next(iter(errors.values())))
    lines = ["Per-frequency decomposition against the dense complex float64 tensor of each frequency (every layer; "
             "relative error pooled over layers and frequencies; seconds summed, one thread; the package's fit "
             "gives every rank at once).", "",
             "| method | " + " | ".join(f"rank {r}" for r in ranks) + " | seconds |",
             "|---|" + "---:|" * (len(ranks) + 1)]
    for label, by_rank in errors.items():
        lines.append(f"| {label} | " + " | ".join(f"{(by_rank[r] / energy) ** 0.5:.4f}" for r in ranks) +
                     f" | {seconds[label]:.2f} |")
    return "\n".join(lines) + "\n"


def shares(model: torch.nn.Module) -> np.ndarray:
    """(layers, frequencies, H): the share of each frequency's joint energy the first R = 1..H shared dims hold."""
    out = []
    for _, attn in timm_attention_layers(model):
        freqs = rotary_fit.frequencies(attn)
        energy = freqs.energy.sum(1)
        out.append([[1 - fit.error / float(energy[p]) for fit in rotary_fit.fit_frequency(freqs.u[p],
                                                                                          freqs.conj_v[p])[1:]]
                    for p in range(freqs.u.shape[0])])
    return np.asarray(out)


def energy_report(trained: torch.nn.Module, init: torch.nn.Module, path: Path) -> str:
    """4(c): the shares of the trained source and of its initialisation, per frequency (mean over layers), and the
    plot."""
    s_trained, s_init = shares(trained), shares(init)
    heads = s_trained.shape[2]
    shown = range(1, heads)
    lines = ["Share of each frequency's joint energy (the heads' H complex rank-1 forms) held by the first R shared "
             "complex dims (the per-frequency CP), mean over the layers; trained source / fresh initialisation.", "",
             "| pair p | " + " | ".join(f"R={r}" for r in shown) + " |", "|---|" + "---:|" * len(shown)]
    for p in range(s_trained.shape[1]):
        lines.append(f"| {p} | " + " | ".join(f"{s_trained[:, p, r - 1].mean():.3f} / {s_init[:, p, r - 1].mean():.3f}"
                                              for r in shown) + " |")
    lines.append("| all | " + " | ".join(f"{s_trained[:, :, r - 1].mean():.3f} / {s_init[:, :, r - 1].mean():.3f}"
                                         for r in shown) + " |")
    lines += ["", "Per layer (mean over frequencies), trained / init:", "",
              "| layer | " + " | ".join(f"R={r}" for r in shown) + " |", "|---|" + "---:|" * len(shown)]
    for layer in range(s_trained.shape[0]):
        lines.append(f"| {layer} | " + " | ".join(f"{s_trained[layer, :, r - 1].mean():.3f} / "
                                                  f"{s_init[layer, :, r - 1].mean():.3f}" for r in shown) + " |")
    fig = figure(7, 4)
    ax = fig.add_subplot()
    for r in shown:
        ax.plot(s_trained[:, :, r - 1].mean(0), marker="o", label=f"trained, R={r}", color=f"C{r}")
        ax.plot(s_init[:, :, r - 1].mean(0), ls="--", marker="x", label=f"init, R={r}", color=f"C{r}")
    ax.set_xlabel("source pair p (its frequency and axis)")
    ax.set_ylabel("share of the frequency's energy")
    ax.set_title(f"Per-frequency redundancy across {heads} heads (mean over layers)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", type=Path, help="the trained rotary model (.safetensors or checkpoint)")
    p.add_argument("--selection-table", nargs="+", type=Path, metavar="FOLDER",
                   help="instead: the recipe against the selection over these --results folders")
    p.add_argument("--config", default=str(ROOT / "configs" / "fmnist" / "rope_long.yaml"))
    p.add_argument("--data-dir", default="data")
    p.add_argument("--results", type=Path, default=ROOT / "results" / "rotary_post_hoc")
    p.add_argument("--key-dims", nargs="+", type=int, default=[32, 16, 8, 4])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS)
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", nargs="*", type=int, default=[], help="q/k dims whose models are kept for the fine-tune")
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "rotary_post_hoc")
    args = p.parse_args()
    if args.selection_table:
        print(selection_table(args.selection_table), end="")
        return
    if args.source is None:
        p.error("--source is required (or --selection-table)")
    torch.set_num_threads(1)
    args.results.mkdir(parents=True, exist_ok=True)
    source, meta = load(args.source, args.config)
    args.data_config = {k: v for k, v in meta["data_config"].items() if k != "input_size"}
    (args.results / "methods.md").write_text(methods(source))
    (args.results / "energy.md").write_text(energy_report(source, load(None, args.config)[0],
                                                          args.results / "energy.png"))
    test = test_set(args.data_dir, source, meta)
    reference = packed(predictions(source, test))
    args.top1_source, args.source_right = reference["top1"], reference["right"]
    print(f"source top-1 {args.top1_source:.2f}", flush=True)
    loader = calibration_loader("torch/fashion_mnist", args.data_dir, "train", args.images, source,
                                meta.get("data_config"), args.seed)
    calibration = calibration_images(loader, probe_input_size(source))
    rows = [run_cell(source, k, v, calibration, test, args) for k in args.key_dims for v in args.variants
            if v != "uniform" or k % (2 * rotary_fit.frequencies(source.blocks[0].attn).u.shape[0]) == 0]
    (args.results / "table.md").write_text(table(rows, args.top1_source))
    plot(rows, args.top1_source, args.results / "top1_vs_key_dim.png")
    print(table(rows, args.top1_source))


if __name__ == "__main__":
    main()
