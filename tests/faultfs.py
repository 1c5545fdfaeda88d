"""Full-disk helpers for the write tests: a small tmpfs (mounting needs root: elsewhere the test skips, saying so),
a tmpfs filled up to a few bytes, and an injected ``OSError(ENOSPC)`` / ``OSError(EDQUOT)`` at the write."""
import contextlib
import errno
import os
import subprocess
from pathlib import Path
from unittest import mock

import pytest


@contextlib.contextmanager
def small_tmpfs(path, size: str):
    """A tmpfs of ``size`` (``1m``, ``12m``) mounted at ``path`` for the block."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    try:
        result = subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', str(path)],
                                capture_output=True, text=True)
    except FileNotFoundError:
        result = subprocess.CompletedProcess([], 1, '', 'no mount command')
    if result.returncode:
        pytest.skip(f'cannot mount a tmpfs here ({result.stderr.strip() or "mount failed"}); the injected-ENOSPC '
                    f'cases cover the same writers')
    try:
        yield path
    finally:
        subprocess.run(['umount', '-l', str(path)], capture_output=True)


def fill(folder, leave: int = 8192) -> None:
    """Fill ``folder``'s file system, then free ``leave`` bytes (a hidden filler file stays)."""
    filler = os.path.join(folder, '.filler')
    with open(filler, 'wb', buffering=0) as f:
        for size in (1 << 16, 4096, 1):
            try:
                while True:
                    f.write(b'\0' * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC
    os.truncate(filler, max(os.path.getsize(filler) - leave, 0))


class _Limited:
    """A file that fails with ``code`` once ``budget`` (shared by all files of the block) is spent."""

    def __init__(self, file, budget: list, code: int) -> None:
        self._file, self._budget, self._code = file, budget, code

    def spend(self, data) -> None:
        size = len(memoryview(data).cast('B'))
        if size > self._budget[0]:
            raise OSError(self._code, os.strerror(self._code))
        self._budget[0] -= size

    def write(self, data) -> int:
        self.spend(data)
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.__exit__(*exc)


@contextlib.contextmanager
def disk_full_after(nbytes: int, code: int = errno.ENOSPC, folder=None):
    """Writes to files under ``folder`` (all files when None) through ``os.fdopen`` or ``os.write`` (how
    ``weights_io`` writes) fail with ``code`` after ``nbytes`` in all."""
    real_fdopen, real_write, budget = os.fdopen, os.write, [nbytes]

    def on_disk(fd: int) -> bool:
        return folder is None or os.readlink(f'/proc/self/fd/{fd}').startswith(str(folder))

    def fdopen(fd, *args, **kwargs):
        file = real_fdopen(fd, *args, **kwargs)
        return _Limited(file, budget, code) if on_disk(fd) else file

    def write(fd, data):
        if on_disk(fd):
            _Limited(None, budget, code).spend(data)
        return real_write(fd, data)

    with mock.patch.object(os, 'fdopen', fdopen), mock.patch.object(os, 'write', write):
        yield


def listing(folder) -> dict:
    """Every path under ``folder`` (hidden ones too, but the filler) with its bytes, to compare before / after."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in files + dirs:
            path = os.path.join(root, name)
            if name != '.filler':
                out[os.path.relpath(path, folder)] = open(path, 'rb').read() if os.path.isfile(path) else None
    return out
