"""Where the calibrated conversion keeps what grows with the images, and what lets a stopped one resume.

As the post-training compressors of LLMs do (GPTQ holds one layer boundary of activations; AQLM and exllamav2 commit
each finished layer), every tensor of the blockwise refinement that grows with the number of images (the source's
output sensitivities of every layer, the carried block inputs, a layer's tokens and its source outputs) lives in a
memory-mapped file of a state folder, not in the process's memory: resident memory is the model and one batch,
whatever the number of images, and the page cache that backs the files is the kernel's to drop. The folder is
``<out>.partial/`` beside the command's output (``beside``), else a temporary one (the Python API); its disk use is
checked before the first image (``blockwise.check_space``).

Each refined layer is committed atomically (its weights as safetensors, then ``state.json``), keyed by a hash of
everything that determines the result (the source's weights, the starting layers, the fitting images, the seed and
the recipe): the same command run again after a stop (Ctrl-C, SIGTERM, ``kill -9``, a requeued job) loads the finished
layers, rebuilds the tokens by replaying them and continues with the next, ending with the same weights; a changed
command finds another key and starts afresh. The folder is removed when the output is written.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
import tempfile
import weakref
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.nn as nn
from torch import Tensor

from ...weights_io import atomic_write, load_safetensors, safetensors_writer

STATE = "state.json"
_BESIDE: ContextVar[Optional[Path]] = ContextVar("collab_vit_state_folder", default=None)
_ACTIVE: ContextVar[Optional["Store"]] = ContextVar("collab_vit_store", default=None)


def active() -> Optional["Store"]:
    """The store of the refinement under way (``Store.use``), or None."""
    return _ACTIVE.get()


def allocate(name: Optional[str], shape: Iterable[int], dtype: torch.dtype = torch.float32) -> Tensor:
    """An uninitialised tensor: backed by the file ``name`` of the active store, in memory without one (or without a
    name: a batch-sized tensor)."""
    store = _ACTIVE.get()
    if store is None or name is None:
        return torch.empty(tuple(shape), dtype=dtype)
    return store.empty(name, shape, dtype)


def folder_for(out: Path) -> Path:
    """The state folder of a conversion written to ``out``: ``<out>.partial`` beside it."""
    return out.with_name(out.name + ".partial")


@contextlib.contextmanager
def beside(out: Path) -> Iterator[Path]:
    """Conversions inside the block keep their state in ``folder_for(out)`` (resumable); it is removed when the block
    ends without an error (the output written), kept otherwise (the next run resumes from it)."""
    folder = folder_for(out)
    token = _BESIDE.set(folder)
    try:
        yield folder
    finally:
        _BESIDE.reset(token)
    shutil.rmtree(folder, ignore_errors=True)


def fingerprint(*parts: Any) -> str:
    """SHA-256 of tensors (their dtype, shape and bytes), modules (their state dicts) and JSON-able values."""
    digest = hashlib.sha256()

    def add(part: Any) -> None:
        if isinstance(part, nn.Module):
            for name, t in part.state_dict().items():
                digest.update(name.encode())
                add(t)
        elif isinstance(part, Tensor):
            t = part.detach().cpu().contiguous()
            digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
            digest.update(t.view(torch.uint8).numpy() if t.numel() else b"")
        elif isinstance(part, (list, tuple)):
            for p in part:
                add(p)
        else:
            digest.update(json.dumps(part, sort_keys=True, default=str).encode())

    for part in parts:
        add(part)
    return digest.hexdigest()


class Store:
    """Disk-backed tensors (``empty``) and the committed layers of one refinement (``layer``, ``commit``), in a state
    folder: ``beside``'s where set, else a temporary one. A folder holding another key's state is cleared first."""

    def __init__(self, key: str) -> None:
        chosen = _BESIDE.get()
        self.temporary = chosen is None
        self.folder = Path(tempfile.mkdtemp(prefix="collab-vit-")) if chosen is None else chosen
        self.folder.mkdir(parents=True, exist_ok=True)
        self.key, self.files = key, set()
        self.state: dict = {"key": key, "done": [], "layers": {}}
        found = self.read()
        if found.get("key") == key:
            self.state = found
        else:
            self.clear()
        if self.temporary:  # removed with the store at the latest (an experiment's run that never finished)
            weakref.finalize(self, shutil.rmtree, str(self.folder), True)

    def refining(self, key: str) -> bool:
        """The refinement about to run (its start layers and settings): the layers committed for another are
        dropped. Whether layers of this one were committed (a stopped run resumed)."""
        if self.state.get("refine") != key:
            self.state["refine"], self.state["layers"] = key, {}
        return bool(self.state["layers"])

    @contextlib.contextmanager
    def use(self) -> Iterator["Store"]:
        """``allocate`` and the refinement's commits go to this store inside the block."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def read(self) -> dict:
        try:
            return json.loads((self.folder / STATE).read_text())
        except (OSError, ValueError):
            return {}

    def clear(self) -> None:
        """Remove every file of the folder (another key's state, stale scratch files)."""
        for path in self.folder.iterdir():
            if path.is_file():
                path.unlink()

    def empty(self, name: str, shape: Iterable[int], dtype: torch.dtype = torch.float32) -> Tensor:
        """A new tensor of ``shape`` backed by the file ``name`` of the folder (its pages are the page cache's)."""
        shape = tuple(shape)
        count = math.prod(shape)
        path = self.folder / f"{name}.bin"
        path.unlink(missing_ok=True)  # a tensor still mapped from it keeps the old file
        with open(path, "wb") as f:  # created with the umask's mode; sparse until written
            f.truncate(count * torch.empty((), dtype=dtype).element_size())
        self.files.add(path)
        return mapped(path, shape, dtype)

    def kept(self, name: str, shape: Iterable[int], dtype: torch.dtype = torch.float32) -> Optional[Tensor]:
        """The tensor ``name`` as a finished run of this key left it (``done(name)``), else None."""
        path = self.folder / f"{name}.bin"
        if name not in self.state["done"] or not path.is_file():
            return None
        self.files.add(path)
        return mapped(path, shape, dtype)

    def done(self, name: str) -> None:
        """``name``'s tensor is complete: a resumed run of this key reads it instead of computing it again."""
        self.state["done"].append(name)
        self.write_state()

    def drop(self, name: str) -> None:
        path = self.folder / f"{name}.bin"
        self.files.discard(path)
        path.unlink(missing_ok=True)

    def layer(self, index: int) -> Optional[tuple[dict[str, Tensor], dict]]:
        """The committed weights and summary of refined layer ``index``, or None."""
        info = self.state["layers"].get(str(index))
        if info is None:
            return None
        return load_safetensors(str(self.folder / f"layer-{index:03d}.safetensors"))[0], info

    def commit(self, index: int, weights: dict[str, Tensor], info: dict) -> None:
        """Layer ``index`` finished: its weights, then the state naming it, each written atomically."""
        atomic_write(str(self.folder / f"layer-{index:03d}.safetensors"), safetensors_writer(weights))
        self.state["layers"][str(index)] = info
        self.write_state()

    def write_state(self) -> None:
        text = json.dumps(self.state).encode()
        atomic_write(str(self.folder / STATE), lambda f: f.write(text))

    def close(self) -> None:
        """The scratch files removed (tensors still mapped from them stay readable; a temporary folder goes whole);
        the committed layers and state stay for a resumed run until ``beside`` removes the folder."""
        if self.temporary:
            shutil.rmtree(self.folder, ignore_errors=True)
            return
        for path in self.files:
            path.unlink(missing_ok=True)
        self.files.clear()


def mapped(path: Path, shape: Iterable[int], dtype: torch.dtype) -> Tensor:
    """The file ``path`` as a tensor of ``shape``, memory-mapped (writes go to the file)."""
    shape = tuple(shape)
    return torch.from_file(str(path), shared=True, size=math.prod(shape), dtype=dtype).view(shape)


def disk_free() -> int:
    """Free bytes where the state folder will be (``beside``'s, else the temporary directory)."""
    where = _BESIDE.get() or Path(tempfile.gettempdir())
    while not where.exists() and where != where.parent:
        where = where.parent
    return shutil.disk_usage(where).free
