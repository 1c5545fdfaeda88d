"""Why the whitened closed form can lose more top-1 than weight-only (RESULTS.md (b), the 15-epoch source): the
class token. DeiT's head reads only the class token, but it is 1 of 50 tokens, so the pooled query moment barely
sees it. Per layer, the attention-output error on held-out images for the class token's row and for the patch
rows, weight-only vs data-aware; then an exploratory probe (not a package option): the class token's queries
weighted ``w`` times in the query moment (``S = sum_patches x x^T + w x_cls x_cls^T``), top-1 at key dims 8 and 4.

    python experiments/data_aware_class_token.py --source runs/experiments/data_aware_e15/model.safetensors

Writes ``results/data_aware_e15/class_token.json`` (or ``--out``). These weights are not chosen on a validation
split: a diagnosis, not a tuned result (``"balanced"``, the rule, is in data_aware.py's ``data-cls`` cells).
"""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from data_aware import HELD_OUT, test_set, top1
from runner import ROOT, git_commit, machine, write_json

from collab_vit.cli import calibration_loader
from collab_vit.conversion.calibration import capture
from collab_vit.conversion.calibration.capture import calibration_images
from collab_vit.conversion.files.commands import load_source
from collab_vit.conversion.calibration.recipe import Recipe
from collab_vit.conversion.reparam import convert_model, probe_input_size, timm_attention_layers


@torch.no_grad()
def row_errors(model: torch.nn.Module, source: torch.nn.Module, held: torch.Tensor) -> list[dict]:
    layers = timm_attention_layers(source)
    _, tokens, _, _ = capture.source_tokens(source.eval(), layers, held, 0, 64)
    rows = []
    for (name, attn), x in zip(layers, tokens):
        ref, out = attn(x), model.get_submodule(name)(x)
        rows.append({"layer": name,
                     "class_token": float((out[:, 0] - ref[:, 0]).norm() / ref[:, 0].norm()),
                     "patches": float((out[:, 1:] - ref[:, 1:]).norm() / ref[:, 1:].norm())})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", type=Path, required=True)
    p.add_argument("--data-dir", default="data")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "data_aware_e15" / "class_token.json")
    p.add_argument("--weights", type=float, nargs="+", default=[1.0, 49.0, 200.0])
    args = p.parse_args()
    torch.set_num_threads(1)
    source, _, _, meta = load_source(None, str(args.source))
    if getattr(source, "cls_token", None) is None or getattr(source, "num_prefix_tokens", 1) != 1:
        raise SystemExit(f"{args.source}: the diagnosis needs a ViT with one class token (token 0) and no registers")
    test = test_set(args.data_dir, source, meta)
    base = top1(source, *test)
    loader = calibration_loader("torch/fashion_mnist", args.data_dir, "train", 256 + HELD_OUT, source,
                                meta.get("data_config"), 0)
    pool = calibration_images(loader, probe_input_size(source))
    pool, held = pool[:-HELD_OUT], pool[-HELD_OUT:]
    result = {"source_top1": base, "errors_key_dim_4": {}, "class_weight_probe": [], "commit": git_commit(),
              "machine": machine()}
    for variant in ("weight", "data"):
        model = copy.deepcopy(source)
        convert_model(model, 4, None if variant == "weight" else pool, "fast", 0, False,
                      Recipe(candidates=("whitened",), prefix_weight=1.0))
        result["errors_key_dim_4"][variant] = row_errors(model, source, held)
        print(variant, result["errors_key_dim_4"][variant], flush=True)
    for weight in args.weights:
        for key_dim in (8, 4):
            model = copy.deepcopy(source)
            convert_model(model, key_dim, pool, "fast", 0, False,
                          Recipe(candidates=("whitened",), prefix_weight=weight))
            row = {"class_weight": weight, "key_dim": key_dim, "delta_top1": round(top1(model, *test) - base, 2)}
            result["class_weight_probe"].append(row)
            print(row, flush=True)
    write_json(args.out, result)
    print(json.dumps(result["class_weight_probe"]))


if __name__ == "__main__":
    main()
