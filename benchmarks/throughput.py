"""Throughput / memory of collaborative vs standard DeiT-B, side by side; writes benchmarks/throughput.md.

    python benchmarks/throughput.py                 # CPU: fp32, batch 16 (GPU too when one is present)
    python benchmarks/throughput.py --repeats 3     # quicker, noisier
"""
from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch
from tqdm import tqdm

import collab_vit  # noqa: F401  (registers the models)
from collab_vit.benchmark import (MODELS, machine_description, measure_layers, measure_models, render_layer_table,
                                  render_model_table, replace_readme_block)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cpu-batch", type=int, default=16)
    parser.add_argument("--gpu-batch", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("throughput.md"))
    args = parser.parse_args()

    sections = []
    setups = [(torch.device("cpu"), None, args.cpu_batch, "CPU fp32")]
    if torch.cuda.is_available():
        setups += [(torch.device("cuda"), torch.bfloat16, args.gpu_batch, "GPU bf16 autocast"),
                   (torch.device("cuda"), None, args.gpu_batch, "GPU fp32")]
    for device, amp, batch, label in setups:
        print(f"{label}: {machine_description(device)}")
        results = measure_models(MODELS, batch, device, amp, args.warmup, args.repeats,
                                 progress=lambda it: tqdm(it, desc=f"{label} repeats"))
        sections.append(render_model_table(results, batch, f"{label}, batch {batch}, 224 px — "
                                           f"{machine_description(device)}"))
        print(sections[-1])
        layer_times = {tokens: measure_layers(tokens, batch, device, amp, args.warmup, args.repeats)
                       for tokens in (197, 577)}
        sections.append(render_layer_table(layer_times, batch))
        print(sections[-1])
    stamp = datetime.date.today().isoformat()
    header = (f"### Throughput (generated {stamp} by `python benchmarks/throughput.py`, median of {args.repeats} "
              f"interleaved repeats after {args.warmup} warm-up)\n\n"
              "Ratios are to timm's `deit_base_patch16_224` in the same run (higher is faster; memory: lower is "
              "smaller). The analytic limit is the ratio of multiply-adds of the 12 blocks (DESIGN.md cost model). "
              "Saved activations: bytes autograd keeps for backward in one training forward.\n")
    report = header + "\n" + "\n\n".join(sections) + "\n"
    args.out.write_text(report)
    replace_readme_block(Path(__file__).parents[1] / "README.md", "throughput", report)
    print(f"wrote {args.out} and the README's throughput block")


if __name__ == "__main__":
    main()
