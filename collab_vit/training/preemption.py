"""Stopping a run early and cleanly: on a signal or a ``STOP`` file, every rank leaves at the same optimizer update.

Slurm (``--signal``), ``scancel --signal`` or a user sends SIGUSR1 / SIGTERM to the trainer, or anyone creates
``<output>/STOP`` (the Slurm scripts do this when the batch shell is signalled: it reaches every node through the
shared run directory). The training loop asks :meth:`StopRequest.requested` at each update boundary (host only) and
the ranks agree on the answer at the loop's next read (every ``log_interval`` updates and at the end of a pass, see
:mod:`.loops`; in one process at once), so they checkpoint after the same step and exit. The longest delay between a
request and the stop is thus ``log_interval`` updates plus the checkpoint write: Slurm's ``--signal`` lead time must
cover it. Repeated signals change nothing (under Slurm a
worker gets SIGTERM both from slurmstepd and from its torchrun agent); SIGINT (Ctrl-C) still ends a run at once.

Mid-epoch resume: the sample order of an epoch is a function of (seed, epoch) alone (:class:`EpochSeededSampler` in
a single process, torch's / timm's distributed samplers otherwise), never of the global RNG, so a fresh data-loader
iterator (which first draws its workers' base seed from the global RNG) replays the same order.
:class:`SkipFirstSampler` wraps the training loader's sampler, skips the batches already trained without loading
them, and then restores the RNG state saved at the stop, so that what runs in the main process afterwards
(augmentation with ``num_workers=0``, mixup, drop path) draws the same numbers as an uninterrupted run. Data-loader
workers are restarted and reseeded, so with ``num_workers > 0`` their augmentations differ from the uninterrupted
run; the samples they load do not.
"""
from __future__ import annotations

import os
import signal
from typing import Any, Dict, Iterator, Optional, Sequence, Sized

import numpy as np
import torch

from .checkpoint import set_rng_state

STOP_FILE = 'STOP'
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
SAMPLE_ORDER = 'epoch_seeded'  # marks mid-epoch checkpoints whose single-process order is EpochSeededSampler's


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


def epoch_seed(seed: int, epoch: int) -> int:
    """A 64-bit seed from ``seed`` and ``epoch`` (numpy's SeedSequence: (s, e + 1) and (s + 1, e) differ)."""
    return int(np.random.SeedSequence([seed % 2 ** 64, epoch]).generate_state(1, np.uint64)[0])


class EpochSeededSampler(torch.utils.data.Sampler):
    """A random permutation of ``data_source`` drawn from its own generator seeded by (seed, epoch), like torch's
    ``DistributedSampler`` for one process: the order depends on nothing else (not the global RNG, not how often or
    when an iterator is created). ``set_epoch`` selects the epoch's permutation."""

    def __init__(self, data_source: Sized, seed: int = 0) -> None:
        self.data_source = data_source
        self.seed = seed
        self.epoch = 0

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(epoch_seed(self.seed, self.epoch))
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()

    def __len__(self) -> int:
        return len(self.data_source)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class SkipFirstSampler(torch.utils.data.Sampler):
    """``sampler`` with its first ``skip`` indices dropped; ``set_epoch`` passes through.

    The wrapped sampler draws its whole permutation as before (its order must not depend on the global RNG: see
    :class:`EpochSeededSampler`). When ``rng_after_skip`` is set, that RNG state is restored once the skipped
    indices are drawn (before the first kept one is used), then forgotten.
    """

    def __init__(self, sampler: torch.utils.data.Sampler, skip: int = 0) -> None:
        self.sampler = sampler
        self.skip = skip
        self.rng_after_skip: Optional[Dict[str, Any]] = None

    def __iter__(self) -> Iterator[int]:
        for i, index in enumerate(self.sampler):
            if i < self.skip:
                continue
            if self.rng_after_skip is not None:
                set_rng_state(self.rng_after_skip)
                self.rng_after_skip = None
            yield index

    def __len__(self) -> int:
        return max(len(self.sampler) - self.skip, 0)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, 'set_epoch'):
            self.sampler.set_epoch(epoch)


def make_skippable(loader) -> SkipFirstSampler:
    """Wrap the sampler of a timm training loader (DataLoader or timm's PrefetchLoader) in a SkipFirstSampler."""
    inner = getattr(loader, 'loader', loader)  # timm's PrefetchLoader keeps the DataLoader in .loader
    batch_sampler = inner.batch_sampler
    wrapped = SkipFirstSampler(batch_sampler.sampler)
    batch_sampler.sampler = wrapped
    return wrapped
