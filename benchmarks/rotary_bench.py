"""Rotary conversion on the CPU (RESULTS.md, "Rotary models"): seconds to convert a DINOv3-B-sized model weight-only
beside DeiT-B's at the same key dim, and each converted model's inference throughput beside its source's.

Random weights (timm's init; the hub is not needed). Both convert at full rank (key dim 768 = 12 heads x 64): the
per-frequency compression of rotary attention is not merged, so full rank is the only key dim both take. Each timing
is repeated (``--repeats``), the models interleaved within a repeat; min and median are written. Throughput: batch 8
at each source's own input size, ``torch.inference_mode``, 1 and 2 threads, one warm-up pass first.

    PYTHONPATH=. python benchmarks/rotary_bench.py --out benchmarks/rotary.md
"""
from __future__ import annotations

import argparse
import copy
import datetime
import platform
import statistics
import subprocess
import time

import timm
import torch

import collab_vit

SOURCES = ("vit_base_patch16_dinov3", "deit_base_patch16_224")
KEY_DIM = 768  # full rank of both (12 heads x 64)


def cpu_name() -> str:
    """lscpu's model name (platform's processor where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration, subprocess.SubprocessError):
        return platform.processor() or "unknown"


def conversion_seconds(sources: dict[str, torch.nn.Module], repeats: int) -> dict[str, list[float]]:
    """Seconds of ``collab_vit.reparametrize(copy, KEY_DIM)`` (weight-only) per source, ``repeats`` times each."""
    times: dict[str, list[float]] = {name: [] for name in sources}
    for _ in range(repeats):
        for name, source in sources.items():
            model = copy.deepcopy(source)
            start = time.perf_counter()
            collab_vit.reparametrize(model, KEY_DIM, progress=False)
            times[name].append(time.perf_counter() - start)
    return times


def throughput(models: dict[str, torch.nn.Module], threads: int, repeats: int, batch: int = 8) -> dict[str, list[float]]:
    """Images per second of each model's forward on a batch of ``batch`` at its input size, ``threads`` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    rates: dict[str, list[float]] = {name: [] for name in models}
    inputs = {name: torch.randn(batch, *m.pretrained_cfg["input_size"]) for name, m in models.items()}
    try:
        with torch.inference_mode():
            for name, model in models.items():
                model(inputs[name])  # warm-up
            for _ in range(repeats):
                for name, model in models.items():
                    start = time.perf_counter()
                    model(inputs[name])
                    rates[name].append(batch / (time.perf_counter() - start))
    finally:
        torch.set_num_threads(before)
    return rates


def row(label: str, values: list[float], digits: int) -> str:
    return f"| {label} | {min(values):.{digits}f} | {statistics.median(values):.{digits}f} | {len(values)} |"


def report(conversion: dict[str, list[float]], rates: dict[int, dict[str, list[float]]],
           sizes: dict[str, tuple]) -> str:
    """The markdown page: machine, conversion seconds, throughput per thread count."""
    ratio = statistics.median(conversion[SOURCES[0]]) / statistics.median(conversion[SOURCES[1]])
    lines = ["# Rotary conversion and throughput on the CPU", "",
             f"Measured {datetime.date.today().isoformat()} on {cpu_name()} (`benchmarks/rotary_bench.py`), torch "
             f"{torch.__version__}, timm {timm.__version__}. The machine was shared with other jobs (loaded): figures "
             f"are min and median over repeats, models interleaved. Random weights; both at key dim {KEY_DIM}, full "
             f"rank: the per-frequency compression of rotary attention is not merged yet.", "",
             "## Weight-only conversion (`collab_vit.reparametrize(model, 768)`), seconds", "",
             "| source | min | median | runs |", "|---|---:|---:|---:|"]
    lines += [row(f"`{name}`", conversion[name], 2) for name in SOURCES]
    lines += ["", f"DINOv3-B / DeiT-B (medians): {ratio:.2f}x (target: at most 1.5x).", "",
              "## Inference throughput, batch 8, img/s (higher is better)", ""]
    for threads, measured in rates.items():
        lines += [f"{threads} thread{'s' * (threads > 1)}:", "", "| model | input | min | median | runs |",
                  "|---|---|---:|---:|---:|"]
        lines += [row(f"`{name}` | {sizes[name.split(' ')[0]][1]} px", values, 2) for name, values in measured.items()]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/rotary.md")
    args = parser.parse_args()
    torch.manual_seed(0)
    sources = {name: timm.create_model(name).eval() for name in SOURCES}
    conversion = conversion_seconds(sources, args.repeats)
    models = {}
    for name, source in sources.items():
        models[name] = source
        models[f"{name} converted"] = collab_vit.reparametrize(copy.deepcopy(source), KEY_DIM, progress=False).eval()
    sizes = {name: tuple(m.pretrained_cfg["input_size"]) for name, m in sources.items()}
    rates = {threads: throughput(models, threads, args.repeats) for threads in (1, 2)}
    text = report(conversion, rates, sizes)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
