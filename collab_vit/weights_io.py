"""Weights on disk: atomic writes and loading that never executes code.

* :func:`atomic_write` writes through a temporary file in the same directory and ``os.replace``: a reader sees the
  old file or the new one, never a partial one (a process killed mid-write leaves only a hidden ``.NAME.*.tmp``,
  which :func:`remove_stale_temps` clears); :func:`write_together` does it for files that belong together,
  :func:`write_folder` for a folder, :func:`append_line` for a log. Every writer writes through a file object this
  module controls, so a full disk is seen by its errno whatever the library (``torch.save`` reports it as
  ``RuntimeError: ... unexpected pos``), and is a one-line :class:`WriteError` naming the path; every file gets the
  mode the umask gives after its write (a library's own chmod or file replacement cannot change it).
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

import errno
import glob
import json
import os
import pickle
import re
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager
from typing import Any, BinaryIO, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save as safetensors_bytes

TEMP_SUFFIX = '.tmp'


class WeightsError(ValueError):
    """A weights file is missing, truncated, unsafe to unpickle or does not fit the model (one-line message)."""


class WriteError(RuntimeError):
    """A file or folder could not be written (full disk, quota, permissions): one line naming the path and why. The
    previous file, if any, is as it was, and nothing of the failed write is left behind."""

    def __init__(self, reason: str, path: str, kept: bool = False) -> None:
        self.reason, self.path = reason, os.path.abspath(path)
        super().__init__(f'{reason} writing {self.path}' + (' (the previous file is kept)' if kept else ''))


NO_SPACE = {errno.ENOSPC: 'no space left on device', errno.EDQUOT: 'disk quota exceeded'}


def write_error(error: OSError, path: str, kept: bool = False) -> WriteError:
    """The :class:`WriteError` of an OSError raised while writing ``path`` (ENOSPC / EDQUOT: the lack of space);
    ``kept``: the message says that the previous file at ``path`` is kept."""
    reason = NO_SPACE.get(error.errno) or (error.strerror or one_line(error)).lower()
    return WriteError(reason, path, kept)


def one_line(error: BaseException) -> str:
    """The user-facing line of an error: its message's first line (an error re-raised from a data-loader worker
    carries the worker's traceback in its message, whose last line is the original one)."""
    text = str(error).strip()
    if 'Original Traceback' in text:
        last = text.splitlines()[-1]
        text = last.split(': ', 1)[1] if ': ' in last else last
    return text.splitlines()[0] if text else type(error).__name__


class _RecordingFile:
    """The file a writer writes into (binary), keeping the OSError of a failed write, flush or sync.

    Libraries that write through a file object report a full disk in their own words (``torch.save``:
    ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos``); the errno is only seen here.
    """

    def __init__(self, fd: int) -> None:
        self._file = os.fdopen(fd, 'wb')
        self.error: Optional[OSError] = None

    def _record(self, fn, *args):
        try:
            return fn(*args)
        except OSError as e:
            self.error = self.error or e
            raise

    def write(self, data) -> int:
        return self._record(self._file.write, data)

    def flush(self) -> None:
        self._record(self._file.flush)

    def commit(self) -> None:
        """Flush, fsync, give the mode a plain ``open`` would (after the write: whatever the writer did to the file's
        mode is overruled), close."""
        self.flush()
        self._record(os.fsync, self._file.fileno())
        self._record(os.fchmod, self._file.fileno(), 0o666 & ~current_umask())
        self._record(self._file.close)

    def discard(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass

    def __getattr__(self, name: str) -> Any:  # tell, seekable, ... of the underlying file
        return getattr(self._file, name)


WriteFn = Callable[[BinaryIO], Any]


def write_file(path: str, write_fn: WriteFn, fd: Optional[int] = None, shown: Optional[str] = None) -> None:
    """``write_fn(f)`` into ``path`` (or the file already open on ``fd``) in place, committed
    (:meth:`_RecordingFile.commit`): for a file in a hidden staging folder, or :func:`atomic_write`'s temp file. On a
    failure ``path`` is removed, and an OSError of the file itself is a WriteError naming ``shown`` (default
    ``path``)."""
    if fd is None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as e:
            raise write_error(e, shown or path) from None
    file = _RecordingFile(fd)
    try:
        write_fn(file)
        file.commit()
    except BaseException as e:
        file.discard()
        _remove(path)
        if file.error is not None and isinstance(e, Exception):
            raise write_error(file.error, shown or path, shown is not None and os.path.isfile(shown)) from None
        raise


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _temp(path: str) -> Tuple[int, str]:
    """An open temp file beside ``path`` (its directory created), or a WriteError naming ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
        return tempfile.mkstemp(prefix='.' + os.path.basename(path) + '.', suffix=TEMP_SUFFIX, dir=directory)
    except OSError as e:
        raise write_error(e, path) from None


@contextmanager
def _signals_held(hold: bool = True) -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block is done (several renames that belong together; main thread only)."""
    if not hold or threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def atomic_write(path: str, write_fn: WriteFn) -> None:
    """``write_fn(f)`` writes the file's bytes into ``f`` (a binary file object: a temp file in ``path``'s
    directory), then the temp file is synced, given the umask's mode and ``os.replace``d into place.

    On any failure the temp file is removed and ``path`` is left as it was (absent or the previous version); a full
    disk or quota (ENOSPC / EDQUOT), or any other OSError of the write, is a one-line :class:`WriteError`.
    """
    write_together({path: write_fn})


def write_together(writes: Dict[str, WriteFn]) -> None:
    """:func:`atomic_write` of several files (a weights file and its JSON sidecar), all or none: every temp file is
    written before the first rename, and the renames run with SIGINT / SIGTERM held back."""
    temps: Dict[str, str] = {}
    try:
        for path, write_fn in writes.items():
            fd, temps[path] = _temp(path)
            write_file(temps[path], write_fn, fd, path)
        with _signals_held(len(writes) > 1):
            for path, tmp in temps.items():
                try:
                    os.replace(tmp, path)
                except OSError as e:
                    raise write_error(e, path) from None
    except BaseException:
        for tmp in temps.values():
            if os.path.exists(tmp):
                _remove(tmp)
        raise
    for directory in {os.path.dirname(os.path.abspath(p)) for p in writes}:
        _sync_directory(directory)


def _sync_directory(directory: str) -> None:
    """Make renames into ``directory`` durable (a power cut after this returns keeps the new files)."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def append_line(path: str, line: str) -> None:
    """Append ``line`` and a newline to a text file (created with the umask's mode). A failed append (a full disk)
    cuts the file back to what it was and is a :class:`WriteError`: no half line is left for the next one."""
    data = memoryview((line + '\n').encode())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    except OSError as e:
        raise write_error(e, path) from None
    try:
        size = os.fstat(fd).st_size
        try:
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        except OSError as e:
            os.ftruncate(fd, size)
            raise write_error(e, path) from None
    finally:
        os.close(fd)


def write_folder(directory: str, fill: Callable[[str], Any], ours: Iterable[str] = ()) -> None:
    """Write a folder all or none: ``fill(staging)`` writes its files into a hidden sibling folder (the umask's
    mode; :func:`write_file` for bytes, or any writer that raises OSError), which is then renamed to ``directory``.
    Into an existing ``directory`` (allowed to hold only files named in ``ours``: an earlier output of the same kind,
    see :func:`check_output_folder`) the files are moved one by one with SIGINT / SIGTERM held back, and the files of
    ``ours`` not written this time are removed. On any failure the hidden folder is removed and ``directory`` is as
    it was; an OSError of the write is a :class:`WriteError` naming ``directory``.
    """
    check_output_folder(directory, ours)
    parent = os.path.dirname(os.path.abspath(directory))
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix='.' + os.path.basename(os.path.abspath(directory)) + '.', suffix='.partial',
                                   dir=parent)
    except OSError as e:
        raise write_error(e, directory) from None
    try:
        os.chmod(staging, 0o777 & ~current_umask())  # as os.makedirs would create it, not mkdtemp's 0700
        fill(staging)
        _commit_folder(staging, directory, ours)
    except WriteError as e:
        raise WriteError(e.reason, directory) from None
    except OSError as e:
        raise write_error(e, directory) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _commit_folder(staging: str, directory: str, ours: Iterable[str]) -> None:
    for name in os.listdir(staging):  # the files of writers other than write_file
        fd = os.open(os.path.join(staging, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if not os.path.exists(directory):
        os.rename(staging, directory)
    else:
        written = set(os.listdir(staging))
        with _signals_held():
            for name in sorted(written):
                os.replace(os.path.join(staging, name), os.path.join(directory, name))
            for name in sorted(set(ours) - written):
                if os.path.isfile(os.path.join(directory, name)):
                    os.remove(os.path.join(directory, name))
    _sync_directory(os.path.dirname(os.path.abspath(directory)))


def check_output_folder(directory: str, ours: Iterable[str]) -> None:
    """A ValueError (one line) unless ``directory`` is absent, an empty folder, or holds only files named in
    ``ours`` (an earlier output of the same kind, which a new one replaces): other files are never mixed in or
    overwritten."""
    if not os.path.exists(directory):
        return
    if not os.path.isdir(directory):
        raise ValueError(f'{os.path.abspath(directory)} exists and is not a folder')
    foreign = sorted(set(os.listdir(directory)) - set(ours))
    if foreign:
        raise ValueError(f'{os.path.abspath(directory)} holds files that are not an earlier output '
                         f'({", ".join(foreign[:3])}{" ..." if len(foreign) > 3 else ""}): choose an empty or new '
                         f'folder')


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


def torch_load(path: str, map_location: Any = 'cpu', mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``; a missing, truncated or code-carrying file is a WeightsError."""
    if not os.path.isfile(path):
        raise WeightsError(f'checkpoint not found: {os.path.abspath(path)}')
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        found = re.search(r'GLOBAL (\S+)', str(e))
        what = f'would call {found.group(1)}' if found else f'is not a weights file ({one_line(e)})'
        raise WeightsError(f'refusing to load {os.path.abspath(path)}: its pickle {what} on load '
                           f'(torch.load weights_only=True); nothing in it was run') from None
    except (RuntimeError, EOFError, KeyError, ValueError, OSError) as e:
        raise WeightsError(f'cannot read {os.path.abspath(path)}: truncated or not a torch checkpoint '
                           f'({type(e).__name__}: {one_line(e)[:160]})') from None


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
                           f'({one_line(e)})') from None


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
HUB_OUTPUT = (HUB_CONFIG, HUB_WEIGHTS, 'conversion.json')  # what save_pretrained / collab-vit convert write
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
                           f'({one_line(e)})') from None
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
        raise WeightsError(f'{os.path.abspath(config_path)} is not a timm model config ({one_line(e)})') from None
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
    atomic_write(path, export_writer(state_dict, model_name, model_kwargs, extra))


def export_writer(state_dict: Dict[str, torch.Tensor], model_name: str, model_kwargs: Dict[str, Any],
                  extra: Optional[Dict[str, Any]] = None) -> WriteFn:
    """The write of :func:`export_safetensors`, for :func:`write_together` (a file and its sidecar)."""
    meta = {'model_name': model_name, 'model_kwargs': json.dumps(model_kwargs)}
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in (extra or {}).items()})
    return safetensors_writer(state_dict, meta)


def safetensors_writer(state_dict: Dict[str, torch.Tensor], metadata: Optional[Dict[str, str]] = None) -> WriteFn:
    """What :func:`atomic_write` calls to write ``state_dict`` as safetensors: the bytes are made in memory and
    written through the file object (``save_file`` writes from Rust: a full disk would be a SafetensorError, not an
    OSError)."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    return lambda f: f.write(safetensors_bytes(tensors, metadata=metadata))
