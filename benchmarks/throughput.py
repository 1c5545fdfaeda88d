"""Throughput / memory of collaborative vs standard DeiT-B, side by side; writes benchmarks/throughput.md and the
throughput block of docs/performance.md.

    python benchmarks/throughput.py                 # CPU: fp32, batch 16 (GPU too when one is present)
    python benchmarks/throughput.py --repeats 3     # quicker, noisier
    python benchmarks/throughput.py --threads 1     # leave the other core to something else
    python benchmarks/throughput.py --ratios        # minutes: the CPU ratios a change must not lower (below)

``--ratios`` measures only what a change to the attention paths is checked against: collab/timm DeiT-B inference
at key dims 768/384/192 and the training step at 192 (CPU fp32, batch 16), all in one process, interleaved; it
prints one table and writes nothing.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import timm
import torch
from tqdm import tqdm

import collab_vit  # noqa: F401  (registers the models)
from measure import (BASELINE, MODEL_GROUPS, Measurement, Runner, machine_description, measure_layers, measure_models,
                     render_layer_table, render_model_table, replace_marked_block, timed)


def measure_group_in_subprocess(index: int, device: torch.device, amp, batch: int, args) -> dict:
    """Measure MODEL_GROUPS[index] in a child process (memory is returned when it exits)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "group.json"
        cmd = [sys.executable, __file__, "--group", str(index), "--group-out", str(out), "--device", device.type,
               "--amp", str(amp).replace("torch.", "") if amp else "none", "--batch", str(batch),
               "--repeats", str(args.repeats), "--warmup", str(args.warmup)] + (
                  ["--threads", str(args.threads)] if args.threads else [])
        subprocess.run(cmd, check=True)
        return {name: Measurement(**m) for name, m in json.loads(out.read_text()).items()}


def run_group(args) -> None:
    amp = None if args.amp == "none" else getattr(torch, args.amp)
    names = MODEL_GROUPS[args.group]
    results = measure_models(names, args.batch, torch.device(args.device), amp, args.warmup, args.repeats,
                             progress=lambda it: tqdm(it, desc=" vs ".join(names[1:]) + " repeats"))
    args.group_out.write_text(json.dumps({n: vars(m) for n, m in results.items()}))


RATIO_MODELS = {BASELINE: True, "collab_deit_base_patch16_224_k768": False, "collab_deit_base_patch16_224_k384": False,
                "collab_deit_base_patch16_224_k192": True}  # model: whether its training step is timed too


def print_ratios(args) -> None:
    """CPU fp32, batch ``--cpu-batch``, one process: timm's DeiT-B and collab k768/384/192 interleaved in each repeat;
    collab/timm inference ratio per key dim and training-step ratio at k192 (ratios of medians); every time is
    printed to stderr as it is taken, so an interrupted run still tells something."""
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    runners = {n: Runner(timm.create_model(n), args.cpu_batch, 224, cpu, None) for n in RATIO_MODELS}
    steps = [(n, "infer", r.infer) for n, r in runners.items()] + [
        (n, "train", r.train_step) for n, r in runners.items() if RATIO_MODELS[n]]
    for _, _, step in steps * args.warmup:
        step()
    times: dict[tuple[str, str], list[float]] = {(n, kind): [] for n, kind, _ in steps}
    for repeat in range(args.repeats):
        for name, kind, step in steps:
            times[name, kind].append(timed(step, cpu))
            print(f"repeat {repeat}: {name} {kind} {times[name, kind][-1]:.2f} s", file=sys.stderr, flush=True)
    median = {key: statistics.median(t) for key, t in times.items()}
    rows = [f"| `{n}` | {median[BASELINE, 'infer'] / median[n, 'infer']:.3f} | "
            + (f"{median[BASELINE, 'train'] / median[n, 'train']:.3f} |" if train else "- |")
            for n, train in RATIO_MODELS.items() if n != BASELINE]
    print(f"CPU fp32, batch {args.cpu_batch}, {machine_description(cpu)}, median of {args.repeats} after "
          f"{args.warmup} warm-up, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; timm DeiT-B "
          f"{median[BASELINE, 'infer']:.2f} s inference, {median[BASELINE, 'train']:.2f} s training step\n\n"
          "| model | infer ratio collab/timm | train ratio collab/timm |\n|---|---:|---:|\n" + "\n".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cpu-batch", type=int, default=16)
    parser.add_argument("--gpu-batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("throughput.md"))
    parser.add_argument("--group", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--group-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    parser.add_argument("--amp", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=16, help=argparse.SUPPRESS)
    parser.add_argument("--ratios", action="store_true", help="only the tracked CPU ratios (see above)")
    args = parser.parse_args()
    if args.group is not None:
        if args.threads:
            torch.set_num_threads(args.threads)
        return run_group(args)

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.ratios:
        return print_ratios(args)
    sections = []
    setups = [(torch.device("cpu"), None, args.cpu_batch, "CPU fp32")]
    if torch.cuda.is_available():
        setups += [(torch.device("cuda"), torch.bfloat16, args.gpu_batch, "GPU bf16 autocast"),
                   (torch.device("cuda"), None, args.gpu_batch, "GPU fp32")]
    for device, amp, batch, label in setups:
        print(f"{label}: {machine_description(device)}")
        groups = [measure_group_in_subprocess(index, device, amp, batch, args) for index in range(len(MODEL_GROUPS))]
        sections.append(render_model_table(groups, batch, f"{label}, batch {batch}, 224 px — "
                                           f"{machine_description(device)}"))
        print(sections[-1])
        layer_times = {tokens: measure_layers(tokens, batch, device, amp, args.warmup, args.repeats)
                       for tokens in (197, 577)}
        sections.append(render_layer_table(layer_times, batch))
        print(sections[-1])
    stamp = datetime.date.today().isoformat()
    header = (f"### Throughput (generated {stamp} by `python benchmarks/throughput.py {' '.join(sys.argv[1:])}`, "
              f"median of {args.repeats} interleaved repeats after {args.warmup} warm-up)\n\n"
              "Each model is measured in its own process (memory), interleaved with its own copy of timm's "
              "`deit_base_patch16_224`; ratios are to that baseline (higher is faster; memory: lower is "
              "smaller). Default glibc allocator. The analytic limit is the ratio of multiply-adds of the 12 blocks (docs/math.md, cost model). "
              "Saved activations: bytes autograd keeps for backward in one training forward.\n")
    report = header + "\n" + "\n\n".join(sections) + "\n"
    args.out.write_text(report)
    replace_marked_block(Path(__file__).parents[1] / "docs" / "performance.md", "throughput", report)
    print(f"wrote {args.out} and the throughput block of docs/performance.md")


if __name__ == "__main__":
    main()
