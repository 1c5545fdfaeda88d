"""Stopping early and cleanly (:class:`StopRequest`): on a signal or a ``STOP`` file, every rank leaves at the same
optimizer update, with a checkpoint.

Slurm (``--signal``), ``scancel --signal`` or a user sends SIGUSR1 / SIGTERM to the trainer, or anyone creates
``<output>/STOP`` (the Slurm scripts do this when the batch shell is signalled: it reaches every node through the
shared run directory). The training loop asks :meth:`StopRequest.requested` at each update boundary (host only) and
the ranks agree on the answer at the loop's next read (every ``log_interval`` updates and at the end of a pass, see
:mod:`.engine`; in one process at once), so they checkpoint after the same step and exit. The longest delay between a
request and the stop is thus ``log_interval`` updates plus the checkpoint write: Slurm's ``--signal`` lead time must
cover it. Repeated signals change nothing (under Slurm a worker gets SIGTERM both from slurmstepd and from its
torchrun agent); SIGINT (Ctrl-C) still ends a run at once.
"""
from __future__ import annotations

import os
import signal
from typing import Optional, Sequence

STOP_FILE = 'STOP'
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequest:
    """Collects stop requests (signals, ``<output>/STOP``) and turns them into one decision shared by all ranks."""

    def __init__(self, output: str, is_main: bool, signals: Sequence[signal.Signals] = STOP_SIGNALS) -> None:
        self.stop_file = os.path.join(output, STOP_FILE)
        self.is_main = is_main
        self.received: Optional[str] = None
        self.decided: Optional[str] = None  # why the ranks agreed to stop ('another rank' where this one had none)
        self.pending: Optional[str] = None  # this rank's reason, kept until the ranks agree
        self._previous = {}
        for sig in signals:
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread (e.g. a test runner): files still work
                pass

    def _on_signal(self, signum: int, frame) -> None:
        self.received = signal.Signals(signum).name

    def reason(self) -> Optional[str]:
        """Why this rank wants to stop (a signal name or the stop file), or None."""
        if self.received:
            return self.received
        if self.is_main and os.path.exists(self.stop_file):
            return STOP_FILE
        return None

    def requested(self) -> bool:
        """Whether this rank has a reason to stop (asked once per optimizer update; host only, no collective). The
        reason is kept until the ranks agree (:meth:`agree`), which the training loop does at its next read."""
        self.pending = self.pending or self.reason()
        return self.pending is not None

    def agree(self, wanted_here: bool) -> None:
        """Record that the ranks agreed to stop (``wanted_here``: this rank had a reason itself)."""
        self.decided = (self.pending if wanted_here else None) or 'another rank'
        self.pending = None

    def acknowledge(self) -> bool:
        """Remove the stop file (rank 0) once it is answered, or a stale one at start; True when there was one."""
        if self.is_main and os.path.exists(self.stop_file):
            os.remove(self.stop_file)
            return True
        return False

    def restore_handlers(self) -> None:
        """Put back the signal handlers that were there before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
