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

One run per output: the calibrated conversion holds an exclusive ``flock`` on ``<out>.partial/lock`` (``hold``) from
before its first image until the output is written and the folder removed, so a second run on the same output is
refused in one line naming the holder (its pid and host, written into the lock file) and never reads, clears or
removes the first one's files; the kernel drops the lock with its process, so a run killed with ``kill -9`` leaves
nothing that blocks the next one, which resumes. Every file of the store has its blocks reserved when it is created
(``reserve``: ``posix_fallocate``), so a full disk is a one-line error there, never a ``SIGBUS`` on a page of a
mapping.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import shutil
import socket
import tempfile
import time
import weakref
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.nn as nn
from torch import Tensor

from ...weights_io import atomic_write, load_safetensors, safetensors_writer

STATE = "state.json"
LOCK = "lock"  # the file of ``hold``'s lock in the state folder: its holder's pid and host
_BESIDE: ContextVar[Optional["Beside"]] = ContextVar("collab_vit_state_folder", default=None)
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


class Beside:
    """The state folder of the conversion inside ``beside``, the lock on it once taken (``hold``) and the bytes the
    command's output takes (``expect_output``, for the disk estimate)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.output = folder, ([], [])
        self.lock_fd: Optional[int] = None

    def take(self) -> None:
        """The lock on the folder (created where missing), else a one-line ``ValueError`` naming its holder; the
        folder is not touched then. Retried where the file taken was removed meanwhile (by a holder that finished)."""
        path = self.folder / LOCK
        while self.lock_fd is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            except FileNotFoundError:  # the folder removed between the two calls
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                out = self.folder.with_name(self.folder.name[:-len(".partial")])
                raise ValueError(f"another conversion to {out} is running ({holder}; its lock: {path}): wait for it "
                                 f"to end, or choose another --out") from None
            if _same_file(fd, path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
                self.lock_fd = fd
            else:
                os.close(fd)

    def release(self, finished: bool) -> None:
        """The folder removed (``finished``: the output written; else only where it holds no committed layer to
        resume from), then the lock let go. Without the lock, a folder left by a stopped run is removed after a
        finished one only where its lock can be taken (no other run holds it)."""
        if self.lock_fd is None:
            if not finished or not self.folder.exists():
                return
            with contextlib.suppress(ValueError, OSError):  # another run's, or not ours to remove
                self.take()
            if self.lock_fd is None:
                return
        try:
            if finished or not _resumable(self.folder):
                shutil.rmtree(self.folder, ignore_errors=True)
        finally:
            os.close(self.lock_fd)
            self.lock_fd = None


def _holder(fd: int) -> str:
    """The holder of the lock file open as ``fd``, as it wrote itself there (waited for a moment after its lock)."""
    for _ in range(20):
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.05)
    return "a process that has not yet written its pid"


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` is still the file open as ``fd`` (not removed, nor replaced, since it was opened)."""
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _resumable(folder: Path) -> bool:
    """Whether ``folder`` holds a refined layer that a run of the same command resumes from."""
    try:
        return bool(json.loads((folder / STATE).read_text()).get("layers"))
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def beside(out: Path) -> Iterator[Path]:
    """Conversions inside the block keep their state in ``folder_for(out)`` (resumable), locked by the first
    ``hold`` (a calibrated conversion's) until the block ends: then it is removed where the block ends without an
    error (the output written), kept otherwise where it holds a refined layer (the next run resumes from it)."""
    where = Beside(folder_for(out))
    token = _BESIDE.set(where)
    finished = False
    try:
        yield where.folder
        finished = True
    finally:
        _BESIDE.reset(token)
        where.release(finished)


def hold() -> None:
    """Inside ``beside``: its state folder locked for this run (once; refused in one line where another run holds it:
    ``Beside.take``). Outside: nothing (a temporary folder is this run's alone)."""
    where = _BESIDE.get()
    if where is not None:
        where.take()


def expect_output(files: list[int], layers: list[int]) -> None:
    """Inside ``beside``: the command's output files will take ``files`` bytes beside the state folder, and each
    refined layer's committed weights ``layers`` bytes in it (``Store.commit``)."""
    where = _BESIDE.get()
    if where is not None:
        where.output = (list(files), list(layers))


def output_bytes() -> tuple[list[int], list[int]]:
    """``expect_output``'s bytes (none outside ``beside``)."""
    where = _BESIDE.get()
    return ([], []) if where is None else where.output


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
    folder: ``beside``'s where set (locked first: ``hold``), else a temporary one. A folder holding another key's state
    is cleared first."""

    def __init__(self, key: str) -> None:
        chosen = _BESIDE.get()
        self.temporary = chosen is None
        hold()
        self.folder = Path(tempfile.mkdtemp(prefix="collab-vit-")) if chosen is None else chosen.folder
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
        """Remove every file of the folder (another key's state, stale scratch files) but the lock."""
        for path in self.folder.iterdir():
            if path.is_file() and path.name != LOCK:
                path.unlink()

    def empty(self, name: str, shape: Iterable[int], dtype: torch.dtype = torch.float32) -> Tensor:
        """A new tensor of ``shape`` backed by the file ``name`` of the folder (its pages are the page cache's), its
        blocks reserved (``reserve``)."""
        shape = tuple(shape)
        path = self.folder / f"{name}.bin"
        path.unlink(missing_ok=True)  # a tensor still mapped from it keeps the old file
        try:
            reserve(path, math.prod(shape) * torch.empty((), dtype=dtype).element_size())
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise OSError(f"{os.strerror(error.errno).lower()} creating {path}: the disk beside the output filled "
                          f"after the check before the first image; {self.left()}") from None
        self.files.add(path)
        return mapped(path, shape, dtype)

    def left(self) -> str:
        """What a failed run leaves of the folder (``Beside.release``), said in its error."""
        if self.temporary:
            return "nothing is kept"
        done = len(self.state["layers"])
        if done:
            return (f"the {done} refined layer(s) stay in {self.folder}: free space there and run the same command "
                    f"again to resume")
        return f"{self.folder} is removed: free space there and run the command again"

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


def reserve(path: Path, size: int) -> None:
    """Create the file ``path`` (the umask's mode) of ``size`` bytes with its blocks allocated: ``posix_fallocate``,
    or zeros written where the file system has no fallocate, so that writes through a mapping of it never need a
    block the disk does not have (a full disk: the ``OSError`` here, the file removed)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        if size:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as error:
                if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                zeros = bytes(min(size, 2 ** 24))
                for at in range(0, size, len(zeros)):
                    os.pwrite(fd, zeros[:size - at], at)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


def mapped(path: Path, shape: Iterable[int], dtype: torch.dtype) -> Tensor:
    """The file ``path`` as a tensor of ``shape``, memory-mapped (writes go to the file)."""
    shape = tuple(shape)
    return torch.from_file(str(path), shared=True, size=math.prod(shape), dtype=dtype).view(shape)


def disk_free() -> int:
    """Free bytes where the state folder will be (``beside``'s, else the temporary directory)."""
    return shutil.disk_usage(_existing()).free


def block_bytes() -> int:
    """The allocation unit of the file system of the state folder: every file takes a whole number of them."""
    return os.statvfs(_existing()).f_frsize or 4096


def _existing() -> Path:
    """The state folder (``beside``'s, else the temporary directory), or its nearest existing parent."""
    where = _BESIDE.get()
    path = Path(tempfile.gettempdir()) if where is None else where.folder
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
