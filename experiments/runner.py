"""Shared by the experiment scripts: run ``train.py`` / ``eval.py`` cells side by side, one JSON per run, tables.

Each cell is an ordinary ``python train.py -c CONFIG --seed S --output RUN_DIR [flags]`` command, so any cell can be
rerun by hand. An interrupted grid continues where it stopped: a cell whose JSON exists is not run again, a finished
run directory is only read, and a run with an epoch checkpoint (``last.pth``) continues with ``--resume`` (exact).
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Cell:
    """One training run: a config, a seed, extra flags; ``name`` is unique within an experiment."""

    name: str
    config: str
    seed: int = 0
    flags: list[str] = field(default_factory=list)
    label: dict[str, Any] = field(default_factory=dict)  # what the tables group by (variant, key dim, ...)

    def command(self, run_dir: Path, resume: bool = False) -> list[str]:
        return [sys.executable, str(ROOT / 'train.py'), '-c', str(ROOT / self.config), '--seed', str(self.seed),
                '--output', str(run_dir), '--progress', 'false', *self.flags, *(['--resume'] if resume else [])]


def git_commit() -> str:
    try:
        return subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return 'unknown'


def machine() -> str:
    import torch
    return (f'{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, '
            f'torch {torch.__version__}')


def env_for_children() -> dict[str, str]:
    """Children import this checkout's package, whatever is installed."""
    env = dict(os.environ)
    env['PYTHONPATH'] = str(ROOT) + os.pathsep + env.get('PYTHONPATH', '')
    env.setdefault('OMP_NUM_THREADS', '1')
    return env


def read_run(run_dir: Path) -> dict[str, Any]:
    """Final metrics of a finished training run: the summary of the last epoch in ``log.jsonl`` and its config."""
    import yaml
    records = [json.loads(line) for line in (run_dir / 'log.jsonl').read_text().splitlines() if line.strip()]
    config = yaml.safe_load((run_dir / 'config.yaml').read_text())
    last = records[-1]
    return {'top1': last['top1'], 'top5': last['top5'], 'val_loss': last['val_loss'], 'epochs': len(records),
            'train_seconds': sum(r['epoch_time'] for r in records), 'curve': [r['top1'] for r in records],
            'config': config}


def model_counts(config: dict[str, Any]) -> dict[str, int]:
    """Parameters and attention query/key parameters of the model a resolved config builds."""
    import timm
    sys.path.insert(0, str(ROOT))
    import collab_vit  # noqa: F401
    from collab_vit.models import query_key_params
    kwargs = {**config['model_kwargs'], 'img_size': config['img_size'], 'num_classes': config['num_classes']}
    if config.get('in_chans', 3) != 3:
        kwargs['in_chans'] = config['in_chans']
    model = timm.create_model(config['model'], device='meta', **kwargs)
    return {'params': sum(p.numel() for p in model.parameters()),
            'qk_params': sum(query_key_params(block.attn) for block in model.blocks)}


def run_cells(cells: Sequence[Cell], results: Path, runs: Path, jobs: int = 2,
              on_done: Optional[Callable[[Cell, dict], None]] = None) -> list[dict[str, Any]]:
    """Run every cell without a ``results/<name>.json`` yet, ``jobs`` at a time; return all cells' records.

    Progress is one plain line per start and finish (with the running count), fit for a terminal and a log file.
    """
    results.mkdir(parents=True, exist_ok=True)
    todo = [c for c in cells if not (results / f'{c.name}.json').exists()]
    print(f'{len(cells)} cells, {len(cells) - len(todo)} already done, {len(todo)} to run, {jobs} at a time',
          flush=True)
    running: list[tuple[Cell, subprocess.Popen, float, Any, str]] = []
    done = len(cells) - len(todo)
    failures = []
    while todo or running:
        while todo and len(running) < jobs:
            cell = todo.pop(0)
            run_dir = runs / cell.name
            finished = (run_dir / 'model.safetensors').exists()
            resume = not finished and (run_dir / 'last.pth').exists()
            if run_dir.exists() and not (finished or resume):  # an attempt without a checkpoint: start afresh
                import shutil
                shutil.rmtree(run_dir)
            runs.mkdir(parents=True, exist_ok=True)
            log = open(runs / f'{cell.name}.log', 'a')  # beside the run directory, which holds only the run
            command = [sys.executable, '-c', 'pass'] if finished else cell.command(run_dir, resume)
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env_for_children())
            what = 'read finished' if finished else 'resume' if resume else 'start'
            running.append((cell, proc, time.time(), log, what))
            print(f'{time.strftime("%H:%M:%S")} {what} {cell.name}', flush=True)
        time.sleep(2)
        for item in list(running):
            cell, proc, start, log, what = item
            if proc.poll() is None:
                continue
            running.remove(item)
            log.close()
            seconds = time.time() - start
            done += 1
            if proc.returncode != 0:
                failures.append(cell.name)
                print(f'{time.strftime("%H:%M:%S")} FAILED {cell.name} (exit {proc.returncode}); see '
                      f'{runs / cell.name}.log', flush=True)
                continue
            record = finish_cell(cell, runs / cell.name, seconds)
            record['invocation'] = what  # 'start': seconds is the whole run; else only this invocation's part
            if on_done is not None:
                on_done(cell, record)
            write_json(results / f'{cell.name}.json', record)
            print(f'{time.strftime("%H:%M:%S")} [{done}/{len(cells)}] {cell.name}: top-1 {record["top1"]:.2f} '
                  f'({seconds:.0f} s)', flush=True)
    if failures:
        raise SystemExit(f'error: {len(failures)} cell(s) failed: {", ".join(failures)}')
    return [json.loads((results / f'{c.name}.json').read_text()) for c in cells]


def finish_cell(cell: Cell, run_dir: Path, seconds: float) -> dict[str, Any]:
    run = read_run(run_dir)
    return {'name': cell.name, **cell.label, 'seed': cell.seed, 'top1': run['top1'], 'top5': run['top5'],
            'val_loss': run['val_loss'], **model_counts(run['config']), 'seconds': round(seconds, 1),
            'train_seconds': round(run['train_seconds'], 1), 'epochs': run['epochs'], 'top1_per_epoch': run['curve'],
            'command': ' '.join(['python', 'train.py', '-c', cell.config, '--seed', str(cell.seed), *cell.flags]),
            'config': run['config'], 'commit': git_commit(), 'machine': machine(),
            'date': time.strftime('%Y-%m-%dT%H:%M:%S')}


def figure(width: float, height: float) -> Any:
    """A matplotlib ``Figure`` at 120 dpi on an Agg canvas (no pyplot, no display): the experiments' plots."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), dpi=120)
    FigureCanvasAgg(fig)
    return fig


def log2_axes(ax: Any, labels: tuple[str, str, str], reference: Optional[tuple[float, str]] = None) -> None:
    """The experiments' curves against a key dim or a step count: log2 x axis, ``labels`` (x, y, title), a dashed
    horizontal ``reference`` (value, label), grid and legend."""
    if reference is not None:
        ax.axhline(reference[0], color="0.4", ls="--", lw=1, label=reference[1])
    ax.set_xscale("log", base=2)
    ax.set_xlabel(labels[0])
    ax.set_ylabel(labels[1])
    ax.set_title(labels[2])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix('.json.tmp')
    tmp.write_text(json.dumps(obj, indent=1) + '\n')
    os.replace(tmp, path)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def difference(values: Sequence[float], reference: Sequence[float]) -> str:
    """Difference of the means with its standard error ``sqrt(s1^2/n1 + s2^2/n2)``, as '+0.12 ± 0.34'."""
    (m, s), (mr, sr) = mean_std(values), mean_std(reference)
    return f'{m - mr:+.2f} ± {math.sqrt(s ** 2 / len(values) + sr ** 2 / len(reference)):.2f}'


def initial_state(config: dict[str, Any], seed: int) -> dict[str, Any]:
    """The weights a training run of ``config`` (a resolved config: model, model_kwargs, num_classes, img_size,
    in_chans) starts from at ``seed``: seeded and built as the trainer does (timm's ``random_seed``, then the
    package's ``build_model``)."""
    from timm.utils import random_seed
    sys.path.insert(0, str(ROOT))
    from collab_vit.training.build import build_model
    kwargs = dict(config['model_kwargs'])
    if config.get('in_chans', 3) != 3:
        kwargs['in_chans'] = config['in_chans']
    random_seed(seed, 0)
    return build_model(config['model'], config['num_classes'], config['img_size'], config.get('drop_path', 0.0),
                       kwargs).state_dict()
