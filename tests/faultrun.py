"""``python tests/faultrun.py [train.py flags]``: train.py's main with a ``kill -9`` injected (the crash tests' hook).

``KILL_AT`` says where the process SIGKILLs itself:

* ``update:N`` -- at the N-th optimizer update (the loop asks ``StopRequest.requested`` once per update): mid-epoch;
* ``write:NAME:N`` -- inside the N-th atomic write of the file NAME, with the temp file complete, before its
  ``os.replace``: a checkpoint write cut short;
* ``after:NAME:N`` -- right after the N-th ``os.replace`` of NAME: between the writes of an epoch's end.

``KILL_SIGNAL`` (default ``SIGKILL``) names the signal sent instead, e.g. ``SIGINT`` for a Ctrl-C at that point.
``KILL_RANK`` limits the kill to one rank and ``KILL_ATTEMPT`` to one torchrun attempt (``TORCHELASTIC_RESTART_COUNT``).
Nothing here changes the package: it wraps ``os.replace`` (as ``collab_vit.weights_io.atomic_write`` calls it) and
``StopRequest.requested`` in this process only.
"""
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from collab_vit import weights_io  # noqa: E402
from collab_vit.training import stop  # noqa: E402
from collab_vit.training.trainer import main  # noqa: E402


def _kill() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), getattr(signal, os.environ.get('KILL_SIGNAL', 'SIGKILL')))


def install(spec: str) -> None:
    """Arm the kill described by ``spec`` (see the module docstring)."""
    kind, *rest = spec.split(':')
    if kind == 'update':
        target, calls = int(rest[0]), [0]
        original = stop.StopRequest.requested

        def requested(self):
            calls[0] += 1
            if calls[0] == target:
                _kill()
            return original(self)

        stop.StopRequest.requested = requested
    elif kind in ('write', 'after'):
        name, target, calls = rest[0], int(rest[1]), [0]
        real_replace = os.replace

        class _Os:  # weights_io's view of the os module, with os.replace wrapped
            def __getattr__(self, attr):
                return getattr(os, attr)

            @staticmethod
            def replace(src, dst, *args, **kwargs):
                if os.path.basename(dst) != name:
                    return real_replace(src, dst, *args, **kwargs)
                calls[0] += 1
                if calls[0] == target and kind == 'write':
                    _kill()
                result = real_replace(src, dst, *args, **kwargs)
                if calls[0] == target:
                    _kill()
                return result

        weights_io.os = _Os()
    else:
        raise ValueError(f'unknown KILL_AT {spec!r}')


if __name__ == '__main__':
    spec = os.environ.get('KILL_AT', '')
    rank_ok = os.environ.get('KILL_RANK') in (None, os.environ.get('RANK', '0'))
    attempt_ok = os.environ.get('KILL_ATTEMPT') in (None, os.environ.get('TORCHELASTIC_RESTART_COUNT', '0'))
    if spec and rank_ok and attempt_ok:
        install(spec)
    sys.exit(main(sys.argv[1:]))
