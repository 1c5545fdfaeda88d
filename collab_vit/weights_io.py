"""Weights on disk: atomic writes and loading that never executes code.

* :func:`atomic_write` writes through a temporary file in the same directory and ``os.replace``: a reader sees the
  old file or the new one, never a partial one (a process killed mid-write leaves only a hidden ``.NAME.*.tmp``,
  which :func:`remove_stale_temps` clears).
* :func:`torch_load` / :func:`read_weights` load ``.pth`` with ``torch.load(weights_only=True)`` (a pickle that would
  run code is refused, never executed) and ``.safetensors`` (model name and kwargs in the metadata); a missing,
  truncated or unsafe file is a :class:`WeightsError` with a one-line message.
* :func:`check_fit` compares a state dict with a model and names every missing, unexpected and mis-shaped key.
* :func:`export_safetensors` writes final weights with the model name and kwargs (JSON) in the metadata.
* A folder in timm's hub layout (``collab_vit.save_pretrained``: ``config.json`` + ``model.safetensors``) reads as
  its weights with ``model_name`` = the config's ``architecture``, ``model_kwargs`` = its ``model_args`` and
  ``data_config`` = the evaluation pipeline of its ``pretrained_cfg``.
"""
from __future__ import annotations

import glob
import json
import os
import pickle
import re
import tempfile
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

TEMP_SUFFIX = '.tmp'


class WeightsError(ValueError):
    """A weights file is missing, truncated, unsafe to unpickle or does not fit the model (one-line message)."""


def atomic_write(path: str, write_fn) -> None:
    """Call ``write_fn(tmp_path)`` on a temp file in ``path``'s directory, then ``os.replace`` it into place.

    On any failure the temp file is removed and ``path`` is left as it was (absent or the previous version).
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix='.' + os.path.basename(path) + '.', suffix=TEMP_SUFFIX, dir=directory)
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp's 0600 would make results unreadable to a group
        write_fn(tmp)
        with open(tmp, 'rb') as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    try:  # make the rename itself durable (a power cut after this returns keeps the new file)
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def current_umask() -> int:
    """The process's umask (read by setting and restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def remove_stale_temps(directory: str, prefixes: Iterable[str]) -> List[str]:
    """Delete the temp files that :func:`atomic_write` left in ``directory`` for files whose names start with one of
    ``prefixes`` when its process was killed mid-write (``.NAME.<random>.tmp``); returns the removed paths. Call it
    only when no writer is running."""
    removed = []
    for prefix in prefixes:
        pattern = os.path.join(glob.escape(directory), '.' + glob.escape(prefix) + '*' + TEMP_SUFFIX)
        for path in sorted(glob.glob(pattern)):
            if os.path.isfile(path):
                os.remove(path)
                removed.append(path)
    return removed


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def torch_load(path: str, map_location: Any = 'cpu', mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``; a missing, truncated or code-carrying file is a WeightsError."""
    if not os.path.isfile(path):
        raise WeightsError(f'checkpoint not found: {os.path.abspath(path)}')
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        found = re.search(r'GLOBAL (\S+)', str(e))
        what = f'would call {found.group(1)}' if found else f'is not a weights file ({_first_line(e)})'
        raise WeightsError(f'refusing to load {os.path.abspath(path)}: its pickle {what} on load '
                           f'(torch.load weights_only=True); nothing in it was run') from None
    except (RuntimeError, EOFError, KeyError, ValueError, OSError) as e:
        raise WeightsError(f'cannot read {os.path.abspath(path)}: truncated or not a torch checkpoint '
                           f'({type(e).__name__}: {_first_line(e)[:160]})') from None


def load_safetensors(path: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """Tensors and raw metadata of a ``.safetensors`` file; a missing or truncated file is a WeightsError."""
    if not os.path.isfile(path):
        raise WeightsError(f'checkpoint not found: {os.path.abspath(path)}')
    try:
        with safe_open(path, framework='pt') as f:
            raw = f.metadata() or {}
        return load_file(path), raw
    except (SafetensorError, OSError) as e:
        raise WeightsError(f'cannot read {os.path.abspath(path)}: truncated or not a safetensors file '
                           f'({_first_line(e)})') from None


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


JSON_METADATA = ('model_kwargs', 'data_config', 'metrics')
HUB_CONFIG, HUB_WEIGHTS = 'config.json', 'model.safetensors'
EVAL_KEYS = ('input_size', 'crop_pct', 'crop_mode', 'interpolation', 'mean', 'std')  # a pretrained_cfg's pipeline


def model_pipeline(model: Any, pretrained_cfg: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The evaluation pipeline ``model`` carries (its ``pretrained_cfg``, or the one given: timm's cfg of the weights
    it was created with, kept through a conversion), at its own input size, as JSON-able lists: what a converted
    file records."""
    cfg = dict(pretrained_cfg or getattr(model, 'pretrained_cfg', None) or {})
    patch_embed = getattr(model, 'patch_embed', None)
    if patch_embed is not None and getattr(patch_embed, 'img_size', None):
        cfg['input_size'] = (patch_embed.proj.in_channels, *patch_embed.img_size)
    return {k: list(cfg[k]) if isinstance(cfg[k], tuple) else cfg[k] for k in EVAL_KEYS if cfg.get(k) is not None}


def parse_metadata(raw: Dict[str, str], path: str) -> Dict[str, Any]:
    """A safetensors file's metadata with its JSON entries decoded; a WeightsError where one is not JSON."""
    meta = {}
    for key, value in raw.items():
        try:
            meta[key] = json.loads(value) if key in JSON_METADATA else value
        except json.JSONDecodeError:
            raise WeightsError(f"metadata '{key}' of {os.path.abspath(path)} is not JSON: {value[:80]!r}") from None
    if not isinstance(meta.get('model_kwargs', {}), dict):
        raise WeightsError(f"metadata 'model_kwargs' of {os.path.abspath(path)} is not a mapping")
    return meta


def safetensors_metadata(path: Optional[str]) -> Dict[str, Any]:
    """The decoded metadata of a ``.safetensors`` file without reading its tensors ({} for any other file)."""
    if not path or not str(path).endswith('.safetensors') or not os.path.isfile(path):
        return {}
    try:
        with safe_open(str(path), framework='pt') as f:
            raw = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise WeightsError(f'cannot read {os.path.abspath(path)}: truncated or not a safetensors file '
                           f'({_first_line(e)})') from None
    return parse_metadata(raw, str(path))


def read_hub_folder(path: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Weights and metadata of a folder in timm's hub layout (see the module docstring)."""
    config_path = os.path.join(path, HUB_CONFIG)
    if not os.path.isfile(config_path):
        raise WeightsError(f'{os.path.abspath(path)} is a folder without {HUB_CONFIG} (not a timm hub folder)')
    try:
        with open(config_path) as f:
            config = json.load(f)
        architecture = config['architecture']
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise WeightsError(f'{os.path.abspath(config_path)} is not a timm model config ({_first_line(e)})') from None
    weights = os.path.join(path, HUB_WEIGHTS)
    if not os.path.isfile(weights) and os.path.isfile(os.path.join(path, 'pytorch_model.bin')):
        state = extract_state_dict(torch_load(os.path.join(path, 'pytorch_model.bin')))  # timm's other layout
    else:
        state, _ = load_safetensors(weights)
    pretrained_cfg = config.get('pretrained_cfg') or {}
    meta = {'model_name': architecture, 'model_kwargs': dict(config.get('model_args') or {}),
            'data_config': {k: pretrained_cfg[k] for k in EVAL_KEYS if pretrained_cfg.get(k) is not None}}
    if 'num_classes' in config:
        meta['num_classes'] = config['num_classes']
    return state, meta


def read_weights(path: str, use_ema: bool = False) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Weights and metadata (``model_name``, ``model_kwargs``, ``data_config``, ... when recorded) from a file.

    ``.safetensors`` files carry the model name and kwargs in their metadata; ``.pth`` files are loaded with
    ``weights_only=True``; a folder is read by :func:`read_hub_folder`.
    """
    if os.path.isdir(path):
        if use_ema:
            raise WeightsError(f'{path} holds one set of weights; --use-ema applies to training checkpoints (.pth)')
        return read_hub_folder(path)
    if not os.path.isfile(path):
        raise WeightsError(f'checkpoint not found: {os.path.abspath(path)}')
    if path.endswith('.safetensors'):
        if use_ema:
            raise WeightsError(f'{path} holds one set of weights; --use-ema applies to training checkpoints (.pth)')
        state, raw = load_safetensors(path)
        return state, parse_metadata(raw, path)
    obj = torch_load(path)
    if not isinstance(obj, dict):
        raise WeightsError(f'{os.path.abspath(path)} holds a {type(obj).__name__}, not a state dict or checkpoint')
    meta = {k: obj[k] for k in ('model_name', 'model_kwargs', 'data_config', 'num_classes', 'epoch', 'metrics')
            if k in obj}
    try:
        return extract_state_dict(obj, use_ema), meta
    except ValueError as e:
        raise WeightsError(f'{os.path.abspath(path)}: {e}') from None


def check_fit(model_state: Dict[str, torch.Tensor], state: Dict[str, torch.Tensor], source: str,
              ignore_missing: Iterable[str] = (), limit: int = 6) -> None:
    """Raise a one-line WeightsError naming every key of ``state`` that does not fit ``model_state`` (missing,
    unexpected, or another shape, as torch's ``load_state_dict`` reports them); ``limit`` entries per kind."""
    ignore = tuple(ignore_missing)
    missing = [k for k in model_state if k not in state and not (ignore and k.startswith(ignore))]
    unexpected = [k for k in state if k not in model_state]
    shapes = [f'{k} {tuple(state[k].shape)} in file vs {tuple(model_state[k].shape)} in model'
              for k in model_state if k in state and state[k].shape != model_state[k].shape]
    if not (missing or unexpected or shapes):
        return

    def listing(kind: str, items: List[str]) -> str:
        more = f' (+{len(items) - limit} more)' if len(items) > limit else ''
        return f'{kind}: ' + ', '.join(items[:limit]) + more

    parts = [listing(kind, items) for kind, items in
             (('shape mismatch', shapes), ('missing', missing), ('unexpected', unexpected)) if items]
    raise WeightsError(f'weights in {source} do not fit the model: ' + '; '.join(parts))


def export_safetensors(state_dict: Dict[str, torch.Tensor], path: str, model_name: str,
                       model_kwargs: Dict[str, Any], extra: Optional[Dict[str, Any]] = None) -> None:
    """Write final weights as safetensors with the model name and kwargs (JSON) in the metadata."""
    meta = {'model_name': model_name, 'model_kwargs': json.dumps(model_kwargs)}
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in (extra or {}).items()})
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))
