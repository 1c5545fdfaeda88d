"""Weights on disk: atomic writes and loading that never executes code.

* :func:`atomic_write` writes through a temporary file in the same directory and ``os.replace``: a reader sees the
  old file or the new one, never a partial one.
* :func:`read_weights` loads ``.safetensors`` (model name and kwargs in the metadata) or ``.pth`` with
  ``torch.load(weights_only=True)``: a pickle that would run code is refused, never executed.
* :func:`export_safetensors` writes final weights with the model name and kwargs (JSON) in the metadata.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Dict, Optional, Tuple

import torch
from safetensors.torch import load_file, safe_open, save_file


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
