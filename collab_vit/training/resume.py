"""Resuming a run: the geometry a checkpoint records (batch size, world size, accumulation) and what it restores.

A checkpoint written inside an epoch (after a stop request) continues that epoch by skipping the batches already
trained, which is exact only with the batch size, world size and accumulation it was written with: other values
are refused (:func:`check_geometry`). At an epoch end they may change (that is how a run grows to more GPUs); then
the learning rate is the configured one for the *new* global batch (``lr x batch x world x accum /
lr_base_batch``), the schedule is rebuilt for the new updates per epoch and placed at the epoch reached, and the
update counter becomes ``epochs done x updates per epoch`` (as timm's train.py counts it); optimizer moments, EMA
and best top-1 carry over. Checkpoints written before the geometry was recorded resume with one warning, their
geometry read from their config and the number of their RNG states.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .errors import ConfigError
from .model_factory import fit_state
from .preemption import SAMPLE_ORDER

GEOMETRY_KEYS = ('batch_size', 'world_size', 'accum_steps')


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
class ResumePoint:
    """Where a run (re)starts and what it carries over."""

    start_epoch: int = 0
    num_updates: int = 0
    best_top1: float = -1.0
    best_epoch: int = -1
    rng_states: Optional[list] = None
    batches_done: int = 0  # > 0: stopped inside epoch start_epoch; rng_states are that epoch's start states
    metrics: Dict[str, float] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)  # lines for the run log


def restore(ckpt: Dict[str, Any], path: str, parts, scheduler, skipper, new: Dict[str, int],
            updates_per_epoch: int, sched_on_updates: bool, dist_info) -> ResumePoint:
    """Load optimizer, scheduler, scaler and EMA state from ``ckpt`` into the freshly built ``parts``
    (:class:`~.loops.StepParts`) and say where to start; the model weights were loaded at build time."""
    optimizer = parts.optimizer
    fresh_lrs = [g.get('initial_lr', g['lr']) for g in optimizer.param_groups]
    optimizer.load_state_dict(ckpt['optimizer'])
    if parts.loss_scaler is not None and ckpt.get('scaler'):
        parts.loss_scaler.load_state_dict(ckpt['scaler'])
    if parts.model_ema is not None and ckpt.get('model_ema') is not None:
        ema = parts.model_ema.module
        ema.load_state_dict(fit_state(ema, ckpt['model_ema'], path + ' (EMA)'))
    point = ResumePoint(ckpt['epoch'] + 1, ckpt['step'], ckpt['best_top1'], ckpt['best_epoch'], ckpt['rng'],
                        ckpt.get('batches_done', 0))
    old, inferred = recorded_geometry(ckpt)
    if inferred:
        point.notes.append(f'warning: {path} was written before checkpoints recorded batch size, world size and '
                           f'accumulation: taken from its config and RNG states ({geometry_text(old)})')
    change = check_geometry(ckpt, new, path)
    if change:  # at an epoch end: the new global batch's lr, the schedule rebuilt and placed at the epoch reached
        for group, lr in zip(optimizer.param_groups, fresh_lrs):
            group['initial_lr'] = lr
        point.num_updates = point.start_epoch * updates_per_epoch
        point.notes.append(f'resuming with other values ({change}): lr {fresh_lrs[0]:.3g} for the new global batch, '
                           f'schedule at epoch {point.start_epoch} = update {point.num_updates} '
                           f'({updates_per_epoch} per epoch)')
    else:
        scheduler.load_state_dict(ckpt['scheduler'])
    if point.batches_done and len(ckpt['rng_at_stop']) == dist_info.world_size:
        skipper.rng_after_skip = ckpt['rng_at_stop'][dist_info.rank]
    if point.batches_done and not dist_info.distributed and ckpt.get('sample_order') != SAMPLE_ORDER:
        point.notes.append(f'warning: {path} was written inside an epoch by an older version whose sample order '
                           f'differs: the rest of epoch {point.start_epoch} may repeat or miss some samples')
    if not point.batches_done:  # the final summary of a run killed after its last checkpoint, before its export
        point.metrics = {k: v for k, v in (ckpt.get('metrics') or {}).items() if k in ('top1', 'top5')}
    if sched_on_updates:
        scheduler.step_update(point.num_updates)
    else:
        scheduler.step(point.start_epoch)
    return point
