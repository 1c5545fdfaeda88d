"""Checkpoints: atomic writes, ``weights_only`` loading, RNG state capture, safetensors export, run-dir guard.

A training checkpoint is a dict of tensors and plain Python types only, so it loads with
``torch.load(weights_only=True)``: ``model``, ``model_ema`` (state dicts), ``optimizer``, ``scheduler``, ``scaler``,
``epoch`` (last finished), ``batches_done`` (batches already trained of the next epoch when a stop request
interrupted it, else 0), ``step`` (optimizer updates so far), ``best_top1``, ``best_epoch``, ``rng`` (one entry per
rank: the state at the start of the next epoch, or of the interrupted one), ``rng_at_stop`` (only when interrupted:
the states at the stop), ``config`` (resolved config dict), ``model_name``, ``model_kwargs``, ``data_config`` and
``metrics``.
"""
from __future__ import annotations

import json
import os
import random
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from safetensors.torch import load_file, safe_open, save_file

from .config import ConfigError

RESULT_FILES = ('last.pth', 'log.jsonl', 'model.safetensors', 'best.pth')


def atomic_write(path: str, write_fn) -> None:
    """Call ``write_fn(tmp_path)`` on a temp file in ``path``'s directory, then ``os.replace`` it into place.

    On any failure the temp file is removed and ``path`` is left as it was (absent or the previous version).
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix='.' + os.path.basename(path) + '.', suffix='.tmp', dir=directory)
    os.close(fd)
    try:
        write_fn(tmp)
        with open(tmp, 'rb') as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


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


def extract_state_dict(obj: Dict[str, Any], use_ema: bool = False) -> Dict[str, torch.Tensor]:
    """The model weights inside a loaded file: our checkpoint (``model`` / ``model_ema``), a timm/DeiT ``.pth``
    (``model`` or ``state_dict`` key, or a bare state dict); a ``module.`` prefix from DDP is stripped."""
    if use_ema:
        for key in ('model_ema', 'state_dict_ema'):
            if obj.get(key) is not None:
                obj = obj[key]
                break
        else:
            raise ValueError('checkpoint holds no EMA weights (no model_ema / state_dict_ema key)')
    else:
        for key in ('model', 'state_dict'):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    return {k[7:] if k.startswith('module.') else k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}


def read_weights(path: str, use_ema: bool = False) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Weights and metadata (``model_name``, ``model_kwargs``, ``data_config``, ... when recorded) from a file.

    ``.safetensors`` files carry the model name and kwargs in their metadata; ``.pth`` files are loaded with
    ``weights_only=True``.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f'checkpoint not found: {os.path.abspath(path)}')
    if path.endswith('.safetensors'):
        if use_ema:
            raise ValueError(f'{path} holds one set of weights; --use-ema applies to training checkpoints (.pth)')
        with safe_open(path, framework='pt') as f:
            raw = f.metadata() or {}
        meta = {k: json.loads(v) if k in ('model_kwargs', 'data_config', 'metrics') else v for k, v in raw.items()}
        return load_file(path), meta
    obj = torch.load(path, map_location='cpu', weights_only=True)
    meta = {k: obj[k] for k in ('model_name', 'model_kwargs', 'data_config', 'num_classes', 'epoch', 'metrics')
            if isinstance(obj, dict) and k in obj}
    return extract_state_dict(obj, use_ema), meta


def export_safetensors(state_dict: Dict[str, torch.Tensor], path: str, model_name: str,
                       model_kwargs: Dict[str, Any], extra: Optional[Dict[str, Any]] = None) -> None:
    """Write final weights as safetensors with the model name and kwargs (JSON) in the metadata."""
    meta = {'model_name': model_name, 'model_kwargs': json.dumps(model_kwargs)}
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in (extra or {}).items()})
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))


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
