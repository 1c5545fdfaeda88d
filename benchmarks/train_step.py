"""CPU step time of the training loop on the quickstart model (configs/quickstart.yaml), before / after a change.

    python benchmarks/train_step.py --before bd11932            # that revision's loop vs this checkout's, interleaved
    python benchmarks/train_step.py --steps 4 --repeats 1        # this checkout only (a quick check that it runs)

The model, batch (32), image size (32 px), optimizer (AdamW through ``build_optimizer``) and loss (label smoothing
0.1) are the quickstart's; the batches are random tensors held in memory, so the data pipeline is not timed: the
time per step is ``train_one_epoch``'s (forward, backward, update, and whatever the loop adds per batch).
``--before REV`` extracts the package at REV with ``git archive`` into a temp folder and times both in child
processes, alternating, each repeat after ``--warmup`` untimed steps; the median per-step time of each is printed
and, with ``--out``, written as a markdown table. Take the numbers on a quiet machine.
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(steps: int, warmup: int, threads: int) -> dict:
    """Per-step seconds of the importable package's ``train_one_epoch`` (one repeat)."""
    import torch
    from timm.loss import LabelSmoothingCrossEntropy

    from collab_vit.training.config import build_config
    from collab_vit.training.distributed import DistInfo
    try:
        from collab_vit.training import engine as loops
        from collab_vit.training.build import build_model, build_optimizer
    except ImportError:  # the package before training/ was grouped by role
        from collab_vit.training import loops
        from collab_vit.training.model_factory import build_model
        from collab_vit.training.optim import build_optimizer

    torch.set_num_threads(threads)
    cfg = build_config(str(ROOT / 'configs' / 'quickstart.yaml'), {})
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.num_classes, cfg.img_size, cfg.drop_path, dict(cfg.model_kwargs))
    optimizer = build_optimizer(model, opt=cfg.opt, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum,
                                layer_decay=None, eps=cfg.opt_eps)
    loss_fn = LabelSmoothingCrossEntropy(smoothing=cfg.smoothing)
    shape = (cfg.batch_size, cfg.in_chans, cfg.img_size, cfg.img_size)
    batches = [(torch.randn(shape), torch.randint(0, cfg.num_classes, (cfg.batch_size,)))
               for _ in range(steps + warmup)]

    def run(loader) -> None:
        if 'parts' in inspect.signature(loops.train_one_epoch).parameters:
            parts = loops.StepParts(optimizer=optimizer, loss_fn=loss_fn, dist_info=DistInfo(), progress=False,
                                    log_interval=cfg.log_interval)
            loops.train_one_epoch(model, loader, parts, 0, 0)
        else:  # the loop's signature before StepParts
            loops.train_one_epoch(model, loader, optimizer, loss_fn, DistInfo(), 0, 0, progress=False,
                                  log_interval=cfg.log_interval)

    run(batches[:warmup])
    start = time.perf_counter()
    run(batches[warmup:])
    return {'step_s': (time.perf_counter() - start) / steps, 'torch': torch.__version__}


def child(package_root: Path, args) -> dict:
    """One repeat in a fresh process that imports the package from ``package_root``."""
    env = {**os.environ, 'PYTHONPATH': str(package_root), 'OMP_NUM_THREADS': str(args.threads)}
    out = subprocess.run([sys.executable, __file__, '--child', '--steps', str(args.steps), '--warmup',
                          str(args.warmup), '--threads', str(args.threads)], env=env, cwd=ROOT, check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def extract(rev: str, into: Path) -> Path:
    """The package as it was at ``rev`` (read-only: git archive), under ``into``."""
    archive = subprocess.run(['git', '-C', str(ROOT), 'archive', rev, 'collab_vit'], check=True,
                             capture_output=True).stdout
    subprocess.run(['tar', '-x', '-C', str(into)], input=archive, check=True)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--before', default='', help='git revision to compare with (default: this checkout only)')
    parser.add_argument('--steps', type=int, default=40)
    parser.add_argument('--warmup', type=int, default=5)
    parser.add_argument('--repeats', type=int, default=7)
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--out', default='', help='write a markdown table here (e.g. benchmarks/train_step.md)')
    parser.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.steps, args.warmup, args.threads)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        sides = {'after (this checkout)': ROOT}
        if args.before:
            sides = {f'before ({args.before})': extract(args.before, Path(tmp)), **sides}
        times = {name: [] for name in sides}
        for _ in range(args.repeats):  # alternating, so drifts in machine load hit both sides alike
            for name, root in sides.items():
                result = child(root, args)
                times[name].append(result['step_s'])
    rows = [f'| {name} | {statistics.median(t) * 1e3:.2f} ms | {min(t) * 1e3:.2f} ms |' for name, t in times.items()]
    table = '\n'.join([f'CPU step time, quickstart model (batch 32, 32 px), {args.threads} thread(s), median / min '
                       f'of {args.repeats} repeats of {args.steps} steps; {platform.machine()}, torch '
                       f'{result["torch"]}, {datetime.date.today().isoformat()}', '',
                       '| loop | median per step | min per step |', '|---|---|---|', *rows])
    print(table)
    if args.out:
        Path(args.out).write_text(table + '\n')


if __name__ == '__main__':
    main()
