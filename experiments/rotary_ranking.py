"""The rotary selection ranked by what each pair gives the logits, and the light-compression rule (RESULTS.md, "The
rotary weight-only rule").

    python experiments/rotary_ranking.py grid --source runs/sources/rope-e15-s0/model.safetensors \\
        --name rope-e15-s0 --data-dir data
    python experiments/rotary_ranking.py choose

``grid`` converts one rotary source at each q/k dim per layer (``--key-dims``, of 64; no fine-tune) and evaluates top-1
on the 10k test images, keeping each image's outcome (paired intervals). Variants at equal q/k parameters:

* ``fit``: the per-frequency fit (``rotary_fit.fit_rotary``), the weight-only conversion at every key dim;
* ``norm``: each head keeps its pairs of largest ``||T_ip|| = ||[Wq | bq]|| ||[Wk | bk]||`` (biases appended as a
  column: the ranking before this experiment);
* ``weights``: the same by ``||Wq_ip|| ||Wk_ip||`` (biases left out: the issue's comparison);
* ``logit``: by ``Frequencies.logit_energy`` under the model's rope (the package's ``selection_layer``);
* ``data``: by the measured variance of each pair's logit term along a softmax row on ``--images`` training images
  (a reference for what the data say; not a conversion the package offers).

``choose`` reads every ``--results`` source folder: per source and q/k dims each variant against the source and
``logit - fit``, ``logit - norm`` with 95 % intervals paired over the test images (``blockwise_loso.paired``); then the
rule "the selection from share ``s`` of the q/k dims, the per-frequency fit below" chosen leave-one-source-out: on the
other sources the share of largest mean top-1 among those where the selection is never more than 0.1 below the fit
(none: ``s = 1``, the fit everywhere), reported on the source left out. Writes ``table.md`` and ``rule.json``.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from statistics import fmean

import torch

from blockwise_loso import packed, paired, predictions, unpacked
from data_aware import test_set
from rotary_post_hoc import load, swap
from runner import ROOT, git_commit, machine, write_json

from collab_vit.cli import calibration_loader
from collab_vit.conversion.weights import rotary_fit
from collab_vit.conversion.calibration.capture import calibration_images
from collab_vit.conversion.reparam import probe_input_size, timm_attention_layers
from collab_vit.conversion.weights.rotary import layer_calls, rotary_layer

VARIANTS = ("fit", "norm", "weights", "logit", "data")
SELECTIONS = VARIANTS[1:]
LIMIT = 0.1  # the selection may be at most this far below the per-frequency fit where the rule picks it (points)


@torch.no_grad()
def measured_score(attn: torch.nn.Module, call: tuple) -> torch.Tensor:
    """(P, H): ``E_n Var_m Re(q~_ip(n) conj(k~_ip(m)))`` on the recorded tokens (rotated pair terms of the logit)."""
    exact = rotary_layer(attn).to(torch.float64)
    tokens, rope = call[0].to(torch.float64), call[1].get("rope")
    scores = []
    for batch in tokens.split(32):
        queries, k = exact.rotated(batch, None if rope is None else rope.to(torch.float64))
        q = queries.sum(1)  # each shared dim belongs to one head (mixing 1 on its own pairs)
        q, k = torch.complex(q[..., 0::2], q[..., 1::2]), torch.complex(k[..., 0::2], k[..., 1::2])  # (B, N, R)
        z = (q.unsqueeze(2) * k.conj().unsqueeze(1)).real  # (B, N, N, R)
        scores.append(z.var(dim=2, unbiased=False).sum((0, 1)))
    score = torch.stack(scores).sum(0) / (tokens.shape[0] * tokens.shape[1])
    return score.reshape(attn.num_heads, -1).T


def scores(model: torch.nn.Module, calibration: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Every selection variant's score (P, H) per layer."""
    layers = timm_attention_layers(model)
    calls = layer_calls(model, layers, calibration)
    out: dict[str, list[torch.Tensor]] = {v: [] for v in SELECTIONS}
    for (_, attn), call in zip(layers, calls):
        freqs = rotary_fit.frequencies(attn)
        d = freqs.u.shape[-1] - freqs.bias
        out["norm"].append(freqs.energy)
        out["weights"].append((freqs.u[..., :d].abs() ** 2).sum(-1) * (freqs.conj_v[..., :d].abs() ** 2).sum(-1))
        out["logit"].append(freqs.logit_energy(rotary_fit.rope_row_mean(attn, call[1].get("rope"))))
        out["data"].append(measured_score(attn, call))
    return out


def converted(source: torch.nn.Module, key_dim: int, variant: str, ranked: dict, plans: list) -> torch.nn.Module:
    model = copy.deepcopy(source)
    for index, (name, attn) in enumerate(timm_attention_layers(model)):
        layer = (rotary_fit.compressed_layer(attn, rotary_fit.frequencies(attn), plans[index].fits,
                                             plans[index].ranks[key_dim // 2]) if variant == "fit"  # fit_rotary's
                 else rotary_fit.strongest_pairs(attn, key_dim, ranked[variant][index]))
        swap(model, name, layer.eval())
    return model


def grid(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    folder = args.results / args.name
    folder.mkdir(parents=True, exist_ok=True)
    source, meta = load(args.source, args.config)
    test = test_set(args.data_dir, source, meta)
    reference = packed(predictions(source, test))
    write_json(folder / "source.json", {"source": str(args.source), **reference, "test_images": int(test[1].numel())})
    print(f"{args.name}: source top-1 {reference['top1']:.2f}", flush=True)
    loader = calibration_loader("torch/fashion_mnist", args.data_dir, "train", args.images, source,
                                meta.get("data_config"), args.seed)
    ranked = scores(source, calibration_images(loader, probe_input_size(source)))
    plans = [rotary_fit.plan(rotary_fit.frequencies(attn)) for _, attn in timm_attention_layers(source)]
    for key_dim in args.key_dims:
        seen: dict[tuple, str] = {}  # the layers' kept pairs -> the variant that kept them (same model, same outcomes)
        for variant in args.variants:
            path = folder / f"{variant}_k{key_dim}.json"
            kept = (variant,) if variant == "fit" else tuple(tuple(rotary_fit.selection_slots(score)[:key_dim // 2])
                                                             for score in ranked[variant])
            twin = folder / f"{seen.get(kept)}_k{key_dim}.json"
            seen.setdefault(kept, variant)
            if path.exists():
                continue
            began = time.perf_counter()
            right = (unpacked(json.loads(twin.read_text()), int(test[1].numel())) if twin.exists()
                     else predictions(converted(source, key_dim, variant, ranked, plans), test))
            row = {"variant": variant, "key_dim": key_dim, **packed(right), "top1_source": reference["top1"],
                   "source_right": reference["right"], "test_images": int(test[1].numel()),
                   "images": args.images if variant == "data" else 0,
                   "same_layers_as": twin.stem.split("_k")[0] if twin.exists() else None,
                   "seconds": round(time.perf_counter() - began, 2), "commit": git_commit(), "machine": machine()}
            write_json(path, row)
            print(f"{variant} k{key_dim}: {row['top1']:.2f} ({row['top1'] - reference['top1']:+.2f})", flush=True)


def cells(folder: Path) -> dict[tuple[str, int], dict]:
    rows = [json.loads(p.read_text()) for p in folder.glob("*_k*.json")]
    return {(r["variant"], r["key_dim"]): r for r in rows}


def rule_top1(found: dict, share: float, full: int) -> dict[int, tuple[str, float]]:
    """Per q/k dims: the variant the rule "selection from ``share``" picks and its top-1."""
    keys = sorted({k for _, k in found})
    return {k: (v, found[(v, k)]["top1"]) for k in keys for v in ["logit" if k >= share * full else "fit"]}


def valid(found: dict, share: float, full: int) -> bool:
    """The selection never more than ``LIMIT`` below the fit where the rule picks it."""
    return all(found[("logit", k)]["top1"] - found[("fit", k)]["top1"] >= -LIMIT
               for (v, k) in found if v == "fit" and k >= share * full)


def best_share(sources: dict[str, dict], full: int) -> float:
    """The share of largest mean top-1 over ``sources`` among the valid ones (ties: the larger share)."""
    shares = sorted({k / full for found in sources.values() for _, k in found} | {1.0})
    allowed = [s for s in shares if all(valid(found, s, full) for found in sources.values())]
    return max(allowed, key=lambda s: (fmean(t for found in sources.values()
                                             for _, t in rule_top1(found, s, full).values()), s))


def choose(args: argparse.Namespace) -> None:
    folders = sorted(p for p in args.results.iterdir() if (p / "source.json").exists())
    sources = {f.name: cells(f) for f in folders}
    full = args.full
    lines = ["Top-1 change against the source on the 10k test images, 95 % interval paired over the images; q/k "
             f"dims per layer of {full}; `fit` the per-frequency fit, the others each head keeping its strongest "
             "pairs by `norm` (||[W|b]||, before), `weights` (biases left out), `logit` (`logit_energy`, now), "
             f"`data` (measured on training tokens).", "",
             "| source | top-1 | q/k dims | " + " | ".join(VARIANTS) + " | logit - fit | logit - norm |",
             "|---|---:|---:|" + "---:|" * (len(VARIANTS) + 2)]
    for name, found in sources.items():
        for key_dim in sorted({k for _, k in found}, reverse=True):
            row = found[("fit", key_dim)]
            shown = [("{:+.2f} ± {:.2f}".format(*paired(row, found[(v, key_dim)])) if (v, key_dim) in found else "—")
                     for v in VARIANTS]
            diffs = ["{:+.2f} ± {:.2f}".format(*paired(row, found[("logit", key_dim)], found[(v, key_dim)]))
                     for v in ("fit", "norm")]
            lines.append(f"| {name} | {row['top1_source']:.2f} | {key_dim} | " + " | ".join(shown + diffs) + " |")
    rules = {}
    lines += ["", f"Rule: the selection (`logit`) from share s of the q/k dims, the per-frequency fit below; s of "
              f"largest mean top-1 where the selection is never more than {LIMIT} below the fit (else s = 1), chosen "
              "without the source it is reported on" + (" (one source: chosen on it)" if len(sources) == 1 else "")
              + ".", "", "| left out | s chosen on the others | rule - fit (mean top-1 there) | "
              f"selection within {LIMIT} of fit there |", "|---|---:|---:|---|"]
    for name, found in sources.items():
        others = {n: f for n, f in sources.items() if n != name} or {name: found}
        share = best_share(others, full)
        gain = fmean(t for _, t in rule_top1(found, share, full).values()) - fmean(
            t for _, t in rule_top1(found, 1.0, full).values())
        rules[name] = share
        lines.append(f"| {name} | {share:.3f} | {gain:+.2f} | {'yes' if valid(found, share, full) else 'no'} |")
    overall = best_share(sources, full)
    lines += ["", f"On all {len(sources)} source(s): s = {overall:.3f}."]
    write_json(args.results / "rule.json", {"left_out": rules, "all": overall, "limit": LIMIT,
                                            "sources": list(sources)})
    (args.results / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("grid", "choose"))
    p.add_argument("--source", type=Path, help="grid: the trained rotary model (.safetensors or checkpoint)")
    p.add_argument("--name", help="grid: the source's folder under --results")
    p.add_argument("--config", default=str(ROOT / "configs" / "fmnist" / "rope_long.yaml"))
    p.add_argument("--data-dir", default="data")
    p.add_argument("--results", type=Path, default=ROOT / "results" / "rotary_ranking")
    p.add_argument("--key-dims", nargs="+", type=int, default=[56, 48, 40, 32, 24, 16])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--images", type=int, default=256, help="grid: training images of the `data` score")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--full", type=int, default=64, help="choose: the layers' q/k dims")
    args = p.parse_args()
    if args.command == "grid":
        if args.source is None or args.name is None:
            p.error("grid needs --source and --name")
        grid(args)
    else:
        choose(args)


if __name__ == "__main__":
    main()
