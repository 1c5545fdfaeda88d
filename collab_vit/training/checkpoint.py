"""Training checkpoints: atomic ``torch.save``, ``weights_only`` loading, RNG state capture, run-dir guard.

A training checkpoint is a dict of tensors and plain Python types only, so it loads with
``torch.load(weights_only=True)``: ``model``, ``model_ema`` (state dicts), ``optimizer``, ``scheduler``, ``scaler``,
``epoch`` (last finished), ``batches_done`` (batches already trained of the next epoch when a stop request
interrupted it, else 0), ``step`` (optimizer updates so far), ``best_top1``, ``best_epoch``, ``rng`` (one entry per
rank: the state at the start of the next epoch, or of the interrupted one), ``rng_at_stop`` (only when interrupted:
the states at the stop), ``config`` (resolved config dict), ``model_name``, ``model_kwargs``, ``data_config`` and
``metrics``.
"""
from __future__ import annotations

import os
import random
from typing import Any, Dict, List

import numpy as np
import torch

from ..weights_io import atomic_write
from .errors import ConfigError

RESULT_FILES = ('last.pth', 'log.jsonl', 'model.safetensors', 'best.pth')


def save_checkpoint(state: Dict[str, Any], path: str) -> None:
    """Atomically ``torch.save`` a checkpoint dict."""
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def load_checkpoint(path: str, map_location: str | torch.device = 'cpu') -> Dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (``weights_only=True``)."""
    return torch.load(path, map_location=map_location, weights_only=True)


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


def prepare_run_dir(output: str, resume: bool) -> None:
    """Create the run directory; refuse to reuse one that already holds results unless resuming."""
    existing: List[str] = [f for f in RESULT_FILES if os.path.exists(os.path.join(output, f))]
    if resume:
        if not os.path.isfile(os.path.join(output, 'last.pth')):
            raise ConfigError(f'--resume: no last.pth in run directory {os.path.abspath(output)}')
    elif existing:
        raise ConfigError(f'run directory {os.path.abspath(output)} already holds results ({existing[0]}); '
                          f'pass --resume to continue it or --output NEW_DIR')
    os.makedirs(output, exist_ok=True)
