"""Issue 40: the whole-model refinement (the recipe's default before the blockwise one) with more calibration images.

    python experiments/whole_model_images.py --source runs/sources/e5-s2026/model.safetensors --name e5-s2026 \\
        --key-dim 4 --images 2048 --start weight

Converts one Fashion-MNIST source with ``--images`` calibration images (training split, seeded draw) as the default
did before issue 40 item 2: 8 crop views per fitting image, 160 passes of the whole model's forward and backward, the
guard over weight-only, the whitened closed form and the refinement of ``--start`` (the start the old default
refined: the one with the lower held-out KL; pinned here). Prints one JSON line: the 10k-test top-1, the seconds, the
candidate kept and the steps. (The row in RESULTS.md ran as the default effort of commit 21b156c.)
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import torch

from blockwise import images_of
from data_aware import test_set, top1

from collab_vit.conversion.files import load_source
from collab_vit.conversion.recipe import Recipe
from collab_vit.conversion.reparam import convert_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--key-dim", type=int, default=4)
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--start", choices=("weight", "whitened"), default="weight")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    source, _, _, meta = load_source(None, args.source)
    source.eval()
    test = test_set(args.data_dir, source, meta)
    images = images_of(args, source, meta, args.images)
    model = copy.deepcopy(source)
    began = time.perf_counter()
    report = convert_model(model, args.key_dim, "tucker", images, "default", args.seed, False,
                           Recipe(candidates=("weight", "whitened", f"{args.start}+refine")))
    print(json.dumps({"source": args.name, "key_dim": args.key_dim, "images": args.images,
                      "variant": "whole-model refinement", "top1": top1(model, *test),
                      "seconds": time.perf_counter() - began, "chosen": report.summary["chosen"],
                      "steps": report.summary["refine_steps"]}), flush=True)


if __name__ == "__main__":
    main()
