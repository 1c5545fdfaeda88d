"""The console entry of the three commands (``collab-vit``, ``train.py``, ``eval.py``): one line on stderr, no
traceback, and one exit code per cause.

=================================================  ====
cause                                              exit
=================================================  ====
bad input (the command's ``bad_input`` errors)      2
a run that failed (``failures``: a failed write)    1
SIGINT (Ctrl-C)                                     130
SIGTERM                                             143
=================================================  ====

While the command runs, SIGTERM raises :class:`Terminated` in the main thread (as SIGINT raises
``KeyboardInterrupt``); a command may answer it otherwise inside (``train.py``'s training loop turns it into a
checkpointed stop and exits 0). Every output is written all or none (``weights_io``), so no signal leaves one half
written.
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any, Callable, Optional

from tqdm import tqdm

from .weights_io import one_line

BAD_INPUT, FAILED, INTERRUPTED, TERMINATED = 2, 1, 130, 143
Errors = tuple[type[BaseException], ...]


class Terminated(BaseException):
    """SIGTERM, raised in the main thread as SIGINT raises KeyboardInterrupt (not an Exception: nothing swallows it)."""


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated()


def run_command(body: Callable[[], Any], bad_input: Errors, failures: Errors, name: Optional[str] = None,
                after_signal: str = "") -> int:
    """Run ``body``: 0 when it returns, else one line on stderr and the exit code of the cause (module docstring).

    The line starts with ``name`` where the command gives one (``collab-vit convert: error: ...``, ``collab-vit
    convert: interrupted (SIGINT)``), else with ``error:``; ``after_signal`` ends the line of a signal (what the
    interrupted command left). ``failures`` are looked at before ``bad_input``.
    """
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    named, lead = (f"{name}: ", f"{name}: ") if name else ("", "error: ")
    try:
        body()
    except failures as error:
        return fail(FAILED, f"{named}error: {one_line(error)}")
    except bad_input as error:
        return fail(BAD_INPUT, f"{named}error: {one_line(error)}")
    except KeyboardInterrupt:
        return fail(INTERRUPTED, f"{lead}interrupted (SIGINT){after_signal}")
    except Terminated:
        return fail(TERMINATED, f"{lead}terminated (SIGTERM){after_signal}")
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)
    return 0


def fail(code: int, line: str) -> int:
    """Print ``line`` on stderr; return ``code`` (the exit status of its cause)."""
    print(line, file=sys.stderr, flush=True)
    return code


LINE_SECONDS = 30.0  # a plain progress line at most this often (and at the end of each bar)


class Lines:
    """Progress as plain lines for a log file (``desc: n/total, elapsed, ETA``), at most every ``LINE_SECONDS``
    and once at the end: what a tqdm bar shows on a terminal."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.n = total, desc, 0
        self.start = self.shown = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self.shown >= LINE_SECONDS or self.n >= self.total:
            self.shown = now
            elapsed = now - self.start
            left = elapsed / self.n * (self.total - self.n) if self.n else float("nan")
            print(f"{self.desc}: {self.n}/{self.total}, {elapsed:.0f} s, ETA {left:.0f} s", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        pass


def progress(total: int, desc: str, show: bool = True) -> Any:
    """A progress bar of ``total`` updates: tqdm's on a terminal (stderr), ``Lines`` in a log file, nothing without
    ``show``."""
    if show and not sys.stderr.isatty():
        return Lines(total, desc)
    return tqdm(total=total, desc=desc, disable=not show, dynamic_ncols=True)
