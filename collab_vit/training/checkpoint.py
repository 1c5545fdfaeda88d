"""Checkpoints: what they hold, writing and loading them, and resuming from one (a stop request, :mod:`.stop`, writes
one inside an epoch).

A training checkpoint is a dict of tensors and plain Python types only, so it loads with
``torch.load(weights_only=True)``: ``model``, ``model_ema`` (state dicts), ``optimizer``, ``scheduler``, ``scaler``,
``epoch`` (last finished), ``batches_done`` (batches already trained of the next epoch when a stop request
interrupted it, else 0), ``step`` (optimizer updates so far), ``best_top1``, ``best_epoch``, ``rng`` (one entry per
rank: the state at the start of the next epoch, or of the interrupted one), ``rng_at_stop`` (only when interrupted:
the states at the stop), ``config`` (resolved config dict), ``model_name``, ``model_kwargs``, ``geometry``
(``batch_size``, ``world_size``, ``accum_steps``: what a resume checks), ``data_config`` and ``metrics``.

Crash safety: every file is written atomically, and ``last.pth`` is the commit point of an epoch: it is written
first, then ``best.pth``, ``epoch_NNNN.pth`` and the ``log.jsonl`` record, which :func:`repair_run_dir` re-derives
from ``last.pth`` when a run killed between those writes is resumed. Temp files of writes cut short by a kill are
removed at the next start (:func:`prepare_run_dir`).

Resuming (:func:`restore`): a checkpoint written inside an epoch (after a stop request) continues that epoch by
skipping the batches already trained, which is exact only with the batch size, world size and accumulation it was
written with: other values are refused (:func:`check_geometry`). At an epoch end they may change (that is how a run
grows to more GPUs); then the learning rate is the configured one for the *new* global batch (``lr x batch x world x
accum / lr_base_batch``), the schedule is rebuilt for the new updates per epoch and placed at the epoch reached, and
the update counter becomes ``epochs done x updates per epoch`` (as timm's train.py counts it); optimizer moments, EMA
and best top-1 carry over. Checkpoints written before the geometry was recorded resume with one warning, their
geometry read from their config and the number of their RNG states.
"""
from __future__ import annotations

import functools
import json
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
import yaml

from ..weights_io import WeightsError, atomic_write, remove_stale_temps, torch_load
from .config import ConfigError, TrainConfig

if TYPE_CHECKING:
    from .data import SkipFirstSampler
    from .distributed import DistInfo
    from .engine import StepParts

RESULT_FILES = ('last.pth', 'log.jsonl', 'model.safetensors', 'best.pth')
# what a run directory may hold besides hidden files: this package's files, the Slurm scripts' logs/, wandb's folder
RUN_FILES = re.compile(r'^(config\.yaml|log\.jsonl|STOP|logs|wandb|(last|best|epoch_\d+)\.pth|'
                       r'model(_ema)?\.safetensors)$')
WRITTEN_FILES = ('last.pth', 'best.pth', 'epoch_', 'log.jsonl', 'config.yaml', 'model.safetensors',
                 'model_ema.safetensors')
# config keys that make a run what it is: another value means another run (other keys may change on resume)
IDENTITY_KEYS = ('model', 'model_kwargs', 'num_classes', 'img_size', 'in_chans')
GEOMETRY_KEYS = ('batch_size', 'world_size', 'accum_steps')
SAMPLE_ORDER = 'epoch_seeded'  # marks mid-epoch checkpoints whose single-process order is EpochSeededSampler's


def save_checkpoint(state: Dict[str, Any], path: str) -> None:
    """Atomically ``torch.save`` a checkpoint dict."""
    atomic_write(path, lambda f: torch.save(state, f))


def _copy(source: str, f) -> None:
    with open(source, 'rb') as src:
        shutil.copyfileobj(src, f)


def load_checkpoint(path: str, map_location: str | torch.device = 'cpu') -> Any:
    """Load a checkpoint written by :func:`save_checkpoint` (``weights_only=True``; a missing, truncated or unsafe
    file is a one-line WeightsError)."""
    return torch_load(str(path), map_location=map_location)


def load_training_checkpoint(path: str) -> Dict[str, Any]:
    """:func:`load_checkpoint` of a checkpoint to resume from; one that lacks the training state is a WeightsError."""
    obj = load_checkpoint(path)
    needed = ('model', 'optimizer', 'scheduler', 'epoch', 'step', 'best_top1', 'best_epoch', 'rng')
    missing = [k for k in needed if not isinstance(obj, dict) or k not in obj]
    if missing:
        raise WeightsError(f'{os.path.abspath(path)} is not a training checkpoint of this package '
                           f'(no {", ".join(missing)})')
    return obj


def rng_state() -> Dict[str, Any]:
    """This process's torch / CUDA / numpy / python RNG states, as tensors and plain types."""
    np_state = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    state = {
        'torch': torch.get_rng_state(),
        'numpy': {'keys': torch.from_numpy(np_state[1].astype(np.int64)), 'pos': int(np_state[2]),
                  'has_gauss': int(np_state[3]), 'cached_gaussian': float(np_state[4])},
        'python': {'version': py_version, 'internal': torch.tensor(py_internal, dtype=torch.int64),
                   'gauss_next': py_gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    torch.set_rng_state(state['torch'].cpu())
    n = state['numpy']
    np.random.set_state(('MT19937', n['keys'].numpy().astype(np.uint32), n['pos'], n['has_gauss'],
                         n['cached_gaussian']))
    p = state['python']
    random.setstate((p['version'], tuple(int(x) for x in p['internal'].tolist()), p['gauss_next']))
    if 'cuda' in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state['cuda']])


def _identity(config: Dict[str, Any]) -> Dict[str, Any]:
    return {k: config.get(k) for k in IDENTITY_KEYS}


def identity_difference(recorded: Dict[str, Any], config: Dict[str, Any]) -> Optional[str]:
    """How the run recorded in ``recorded`` (a config dict) differs from ``config`` in what makes a run, or None."""
    a, b = _identity(recorded), _identity(config)
    diffs = [f'{k}: {a[k]!r} there, {b[k]!r} now' for k in IDENTITY_KEYS if a[k] != b[k]]
    return '; '.join(diffs) or None


def check_run_dir(output: str, resume: bool, config: Dict[str, Any]) -> None:
    """Refuse, without writing anything, a run directory this run must not write into: one without ``last.pth``
    when resuming, one that holds results (without resuming), files that are not a run's, or another run's config."""
    path = os.path.abspath(output)
    if resume:
        if not os.path.isfile(os.path.join(output, 'last.pth')):
            raise ConfigError(f'--resume: no last.pth in run directory {path} (use --auto-resume to start when '
                              f'there is none)')
        return
    if os.path.exists(output) and not os.path.isdir(output):
        raise ConfigError(f'output {path} is a file, not a directory')
    existing: List[str] = [f for f in RESULT_FILES if os.path.exists(os.path.join(output, f))]
    if existing:
        raise ConfigError(f'run directory {path} already holds results ({existing[0]}); '
                          f'pass --resume to continue it or --output NEW_DIR')
    if not os.path.isdir(output):
        return
    foreign = sorted(f for f in os.listdir(output) if not (f.startswith('.') or RUN_FILES.match(f)))
    if foreign:
        raise ConfigError(f'output directory {path} holds files that are not from a run ({", ".join(foreign[:3])}'
                          f'{" ..." if len(foreign) > 3 else ""}): choose an empty or new --output')
    config_file = os.path.join(output, 'config.yaml')
    if os.path.isfile(config_file):
        try:
            with open(config_file) as f:
                recorded = yaml.safe_load(f)
        except (OSError, yaml.YAMLError):
            recorded = None
        if not isinstance(recorded, dict):
            raise ConfigError(f'output directory {path} has a config.yaml that is not a run config: choose an '
                              f'empty or new --output')
        difference = identity_difference(recorded, config)
        if difference:
            raise ConfigError(f'output directory {path} holds another run ({difference}): choose another --output')


def check_same_run(ckpt: Dict[str, Any], config: Dict[str, Any], path: str) -> None:
    """A checkpoint to resume must come from a run of the same model (IDENTITY_KEYS); ConfigError otherwise."""
    difference = identity_difference(ckpt.get('config') or {}, config)
    if difference:
        raise ConfigError(f'{os.path.abspath(path)} is from another run ({difference}): resume it with its own '
                          f'config, or choose another --output')


def prepare_run_dir(output: str) -> List[str]:
    """Create the run directory (checked first by :func:`check_run_dir`) and remove the temp files that a writer
    killed mid-write left there; returns the removed paths."""
    os.makedirs(output, exist_ok=True)
    return remove_stale_temps(output, WRITTEN_FILES)


def _log_records(path: str) -> List[Dict[str, Any]]:
    records = []
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut short by a kill
                    continue
    return records


def repair_run_dir(output: str, ckpt: Dict[str, Any], checkpoint_every: int) -> List[str]:
    """Make the files derived from ``last.pth`` agree with it after a kill between the writes of an epoch's end:
    ``log.jsonl`` keeps one record per finished epoch up to the checkpoint's (re-adding its record, dropping later or
    cut-short lines), and ``best.pth`` / ``epoch_NNNN.pth`` of that epoch are copied from ``last.pth`` when missing.
    Returns what was changed (for the log)."""
    changed = []
    epoch, at_boundary = ckpt['epoch'], not ckpt.get('batches_done', 0)
    log_path = os.path.join(output, 'log.jsonl')
    records = [r for r in _log_records(log_path) if isinstance(r, dict) and isinstance(r.get('epoch'), int)]
    kept = [r for r in records if r['epoch'] <= epoch]
    metrics = ckpt.get('metrics') or {}
    if at_boundary and epoch >= 0 and metrics.get('epoch') == epoch and not any(r['epoch'] == epoch for r in kept):
        kept.append(metrics)
    text = ''.join(json.dumps(r) + '\n' for r in kept)
    current = ''
    if os.path.isfile(log_path):
        with open(log_path) as f:
            current = f.read()
    if text != current and (kept or current):
        atomic_write(log_path, lambda f: f.write(text.encode()))
        changed.append(f'log.jsonl ({len(kept)} epoch records)')
    if not at_boundary or epoch < 0:
        return changed
    last = os.path.join(output, 'last.pth')
    wanted = []
    if ckpt.get('best_epoch') == epoch:
        wanted.append('best.pth')
    if checkpoint_every and (epoch + 1) % checkpoint_every == 0:
        wanted.append(f'epoch_{epoch:04d}.pth')
    for name in wanted:
        path = os.path.join(output, name)
        try:
            have = torch_load(path, mmap=True)['epoch'] if os.path.isfile(path) else None
        except (WeightsError, KeyError, TypeError):
            have = None
        if have != epoch:
            atomic_write(path, lambda f: _copy(last, f))
            changed.append(name)
    return changed


def geometry(batch_size: int, world_size: int, accum_steps: int) -> Dict[str, int]:
    """What a checkpoint records of how its samples were cut into batches and updates."""
    return {'batch_size': batch_size, 'world_size': world_size, 'accum_steps': accum_steps}


def recorded_geometry(ckpt: Dict[str, Any]) -> Tuple[Dict[str, Optional[int]], bool]:
    """The geometry a checkpoint was written with, and whether it had to be inferred (an older checkpoint)."""
    if isinstance(ckpt.get('geometry'), dict):
        return {k: ckpt['geometry'].get(k) for k in GEOMETRY_KEYS}, False
    config = ckpt.get('config') or {}
    return geometry(config.get('batch_size'), len(ckpt.get('rng') or []) or None, config.get('accum_steps')), True


def geometry_change(old: Dict[str, Optional[int]], new: Dict[str, int]) -> Optional[str]:
    """'batch_size 4 there, 2 now; ...' for the values that differ (unknown old values are not compared)."""
    diffs = [f'{k} {old[k]} there, {new[k]} now' for k in GEOMETRY_KEYS if old.get(k) is not None and old[k] != new[k]]
    return '; '.join(diffs) or None


def geometry_text(values: Dict[str, Optional[int]]) -> str:
    """'batch_size 4, world_size 1, accum_steps 1' (for the log)."""
    return ', '.join(f'{k} {"unknown" if values[k] is None else values[k]}' for k in GEOMETRY_KEYS)


def check_geometry(ckpt: Dict[str, Any], new: Dict[str, int], path: str) -> Optional[str]:
    """Refuse (ConfigError, one line) a mid-epoch checkpoint whose geometry differs from ``new``; return the change
    at an epoch end (or None)."""
    change = geometry_change(recorded_geometry(ckpt)[0], new)
    if change and ckpt.get('batches_done'):
        raise ConfigError(f'{os.path.abspath(path)} was stopped inside epoch {ckpt["epoch"] + 1} (after batch '
                          f'{ckpt["batches_done"]}) with other values ({change}): that epoch can only continue '
                          f'exactly with the values it was written with; resume with those')
    return change


@dataclass
class Progress:
    """Where a run stands, advanced by the trainer's epoch loop: what checkpoints record of it and :func:`restore`
    sets back (``bad_images`` and ``epoch_rng`` are this invocation's)."""

    start_epoch: int = 0  # the first epoch this invocation trains
    num_updates: int = 0  # optimizer updates so far
    batches_done: int = 0  # > 0: batches of the current epoch already trained (a stop inside it)
    best_top1: float = -1.0
    best_epoch: int = -1
    metrics: Dict[str, float] = field(default_factory=dict)  # the last evaluation's
    bad_images: int = 0  # unreadable images skipped so far, over all ranks (skip_bad_images)
    epoch_rng: Optional[Dict[str, Any]] = None  # this rank's RNG states at the start of the epoch being trained


def checkpoint_state(model: torch.nn.Module, step: StepParts, progress: Progress, epoch: int, rng_all: list,
                     metrics: Dict[str, Any], about: Dict[str, Any]) -> Dict[str, Any]:
    """The training checkpoint (keys in the module docstring): ``model``'s weights, the state of what ``step``
    steps (optimizer, schedule, loss scaler, EMA), where the run stands (``epoch`` is the last finished one,
    ``progress.batches_done`` the batches already trained of the next: 0 at an epoch boundary), every rank's RNG
    states, the epoch's ``metrics`` and what run it is (``about``, :func:`run_record`)."""
    return {
        'model': model.state_dict(), 'optimizer': step.optimizer.state_dict(),
        'scheduler': step.scheduler.state_dict(), 'scaler': step.loss_scaler.state_dict() if step.loss_scaler else None,
        'model_ema': step.model_ema.module.state_dict() if step.model_ema is not None else None,
        'epoch': epoch, 'batches_done': progress.batches_done, 'step': progress.num_updates,
        'best_top1': progress.best_top1, 'best_epoch': progress.best_epoch, 'rng': rng_all, **about,
        'metrics': metrics,
    }


def run_record(cfg: TrainConfig, world_size: int, model_kwargs: Dict[str, Any],
               data_cfg: Dict[str, Any]) -> Dict[str, Any]:
    """What a checkpoint records of the run it comes from: its config, model, geometry and evaluation pipeline."""
    return {'config': cfg.to_dict(), 'model_name': cfg.model, 'model_kwargs': model_kwargs,
            'geometry': run_geometry(cfg, world_size), 'data_config': plain(data_cfg)}


def plain(data_cfg: Dict[str, Any]) -> Dict[str, Any]:
    """A data config with tuples as lists (as a checkpoint, an export and the results JSON record it)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in data_cfg.items()}


def gather_rng(state: Dict[str, Any]) -> list:
    """Every rank's ``state`` (an RNG state), in rank order (a list of one on a single process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [state]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


def run_geometry(cfg: TrainConfig, world_size: int) -> Dict[str, int]:
    """The geometry of a run of ``cfg`` on ``world_size`` processes."""
    return geometry(cfg.batch_size, world_size, cfg.accum_steps)


def restore(ckpt: Dict[str, Any], path: str, step: StepParts, skipper: SkipFirstSampler, now: Dict[str, int],
            updates_per_epoch: int) -> Tuple[Progress, List[str]]:
    """Where ``ckpt`` stopped, and lines for the log. Its optimizer, scheduler and scaler states are loaded into the
    freshly built ``step`` (the model and EMA weights were loaded at build time); a stop inside an epoch also sets
    ``skipper`` to restore the RNG states at the stop. ``now``: the geometry the run resumes with, at
    ``updates_per_epoch``."""
    notes = []
    fresh_lrs = [g.get('initial_lr', g['lr']) for g in step.optimizer.param_groups]
    step.optimizer.load_state_dict(ckpt['optimizer'])
    if step.loss_scaler is not None and ckpt.get('scaler'):
        step.loss_scaler.load_state_dict(ckpt['scaler'])
    progress = Progress(start_epoch=ckpt['epoch'] + 1, num_updates=ckpt['step'],
                        batches_done=ckpt.get('batches_done', 0), best_top1=ckpt['best_top1'],
                        best_epoch=ckpt['best_epoch'])
    old, inferred = recorded_geometry(ckpt)
    if inferred:
        notes.append(f'warning: {path} was written before checkpoints recorded batch size, world size and '
                     f'accumulation: taken from its config and RNG states ({geometry_text(old)})')
    change = check_geometry(ckpt, now, path)
    if change:  # at an epoch end: the new global batch's lr, the schedule rebuilt and placed at the epoch reached
        for group, lr in zip(step.optimizer.param_groups, fresh_lrs):
            group['initial_lr'] = lr
        progress.num_updates = progress.start_epoch * updates_per_epoch
        notes.append(f'resuming with other values ({change}): lr {fresh_lrs[0]:.3g} for the new global batch, '
                     f'schedule at epoch {progress.start_epoch} = update {progress.num_updates} '
                     f'({updates_per_epoch} per epoch)')
    else:
        step.scheduler.load_state_dict(ckpt['scheduler'])
    notes += _restore_inside_epoch(ckpt, path, progress, skipper, step.dist_info)
    if step.sched_on_updates:
        step.scheduler.step_update(progress.num_updates)
    else:
        step.scheduler.step(progress.start_epoch)
    return progress, notes


def _restore_inside_epoch(ckpt: Dict[str, Any], path: str, progress: Progress, skipper: SkipFirstSampler,
                          dist_info: DistInfo) -> List[str]:
    """A stop inside an epoch: the RNG states at the stop, restored once the trained batches are skipped. At an
    epoch end: the last metrics (the final summary of a run killed after its last checkpoint, before its export)."""
    if not progress.batches_done:
        progress.metrics = {k: v for k, v in (ckpt.get('metrics') or {}).items() if k in ('top1', 'top5')}
        return []
    if len(ckpt['rng_at_stop']) == dist_info.world_size:
        skipper.after_skip = functools.partial(set_rng_state, ckpt['rng_at_stop'][dist_info.rank])
    if not dist_info.distributed and ckpt.get('sample_order') != SAMPLE_ORDER:
        return [f'warning: {path} was written inside an epoch by an older version whose sample order differs: the '
                f'rest of epoch {progress.start_epoch} may repeat or miss some samples']
    return []
