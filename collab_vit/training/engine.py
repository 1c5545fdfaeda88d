"""The engine: one training epoch and one evaluation pass (as DeiT's engine.py; the run around them is
:mod:`.trainer`'s, its parts are built in :mod:`.build`).

What is synchronised when (a sync: a device-to-host read in this code, or a blocking collective):

* per batch: nothing. Losses, their sample count and a non-finite flag accumulate on the device
  (:class:`DeviceTally`); DDP's gradient all-reduce is asynchronous and overlaps the backward pass.
* every ``log_interval`` optimizer updates, at the last update of a pass and before any checkpoint: one read
  (:meth:`DeviceTally.read`), which when distributed is one all-reduce of (loss sum, count, non-finite batches,
  stop wanted, samples) followed by one ``.tolist()``. A non-finite loss stops the run there, naming the first
  bad update; a stop request is agreed there by all ranks (at most ``log_interval`` updates after it was asked for;
  in one process it is answered at the next update, with no collective).
* by design, outside this rule: ``skip_nonfinite_loss: true`` reads every loss (one ``.item()`` and, distributed,
  one all-reduce per batch: it must know before the backward pass whether to skip it); timm's ``NativeScaler``
  (fp16 AMP) reads ``found_inf`` at every update; an EMA kept on the CPU (``model_ema_force_cpu``) copies the
  weights to the host at every update.
* evaluation: nothing per batch; one all-reduce and one read at the end of the pass.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from timm.utils import ModelEmaV3, NativeScaler, dispatch_clip_grad, unwrap_model
from tqdm import tqdm

from .config import DataError
from .distributed import DistInfo, all_gather_rows, all_reduce_sum, any_rank

if TYPE_CHECKING:
    from .stop import StopRequest


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or inf (or too many such batches in a row were skipped); one-line message."""


def _nonfinite_on_any_rank(loss: torch.Tensor, device: torch.device) -> bool:
    """True on every rank when the loss of any rank is NaN/inf (a host read and, distributed, an all-reduce: only
    ``skip_nonfinite_loss`` uses it, per batch)."""
    return any_rank(not math.isfinite(loss.item()), device)


def autocast_context(device: torch.device, amp: bool, amp_dtype: str) -> Callable[[], Any]:
    """Factory of autocast contexts: mixed precision on GPU when asked, plain float32 on CPU."""
    if amp and device.type == 'cuda':
        dtype = torch.bfloat16 if amp_dtype in ('bfloat16', 'bf16') else torch.float16
        return lambda: torch.autocast(device_type='cuda', dtype=dtype)
    return contextlib.nullcontext


def on_terminal() -> bool:
    """Whether progress goes to a terminal (tqdm writes to stderr); in a log file it is plain lines instead."""
    return sys.stderr.isatty()


@dataclass
class StepParts:
    """What the training pass uses besides the model and the loader: the objects it steps and the settings of a
    step (built once by :func:`~.build.assemble`)."""

    optimizer: torch.optim.Optimizer
    loss_fn: torch.nn.Module
    dist_info: DistInfo
    scheduler: Any = None
    sched_on_updates: bool = False
    accum_steps: int = 1
    clip_grad: float = 0.0
    clip_mode: str = 'norm'
    mixup_fn: Any = None
    autocast: Callable[[], Any] = contextlib.nullcontext
    loss_scaler: Optional[NativeScaler] = None
    model_ema: Optional[ModelEmaV3] = None
    stop_request: Optional[StopRequest] = None
    progress: bool = True
    log_interval: int = 50
    skip_nonfinite: bool = False
    max_nonfinite_skips: int = 5


class DeviceTally:
    """Loss sum, finite-sample count, non-finite batches and the first non-finite batch of a pass, on the device.

    :meth:`add` launches a few element-wise kernels and reads nothing; :meth:`read` is the one host sync (and,
    distributed, the one all-reduce), which also carries this rank's stop wish and sample count.
    """

    def __init__(self, device: torch.device) -> None:
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss x samples, finite samples, bad batches
        self.first = torch.full((3,), -1.0, dtype=torch.float64, device=device)  # update, batch, loss of first bad
        self.device = device

    def add(self, loss: torch.Tensor, n: int, update: int, batch: int) -> None:
        loss = loss.detach().double()
        finite = torch.isfinite(loss)
        self.sums += torch.stack((torch.where(finite, loss * n, 0.0), finite.double() * n, (~finite).double()))
        new = (~finite) & (self.first[0] < 0)
        self.first[0:1].masked_fill_(new, float(update))  # scalars go in as kernel arguments: no copy, no read
        self.first[1:2].masked_fill_(new, float(batch))
        self.first[2:3].copy_(torch.where(new, loss, self.first[2]))

    def read(self, stop_wanted: bool, samples: int) -> Dict[str, float]:
        """Totals over all ranks (one all-reduce when distributed, one host read)."""
        extra = torch.tensor([float(stop_wanted), float(samples)], dtype=torch.float64).to(self.device)
        loss, n, bad, stop, total = all_reduce_sum(torch.cat((self.sums, extra))).tolist()
        return {'loss_sum': loss, 'count': n, 'bad': bad, 'stop': stop > 0, 'samples': total}

    def first_bad(self) -> List[float]:
        """(update, batch, loss) of the earliest non-finite batch over all ranks (read only after a failed read)."""
        rows = [r for r in all_gather_rows(self.first) if r[0] >= 0]
        return min(rows, key=lambda r: (r[0], r[1]))


def _backward_and_step(model, loss: torch.Tensor, parts: StepParts, window: int, update: bool) -> None:
    """Backward of ``loss / window`` (the mean over the window's samples, batches being equal), and at the end of a
    window the optimizer step (clipping; timm's NativeScaler under fp16)."""
    if parts.loss_scaler is not None:  # fp16: the scaler reads found_inf at every update (a host sync, by design)
        parts.loss_scaler(loss / window, parts.optimizer, clip_grad=parts.clip_grad or None,
                          clip_mode=parts.clip_mode, parameters=model.parameters(), need_update=update)
        return
    (loss / window).backward()
    if update:
        if parts.clip_grad:
            dispatch_clip_grad(model.parameters(), parts.clip_grad, mode=parts.clip_mode)
        parts.optimizer.step()


def _after_update(model, parts: StepParts, num_updates: int) -> None:
    parts.optimizer.zero_grad(set_to_none=True)
    if parts.model_ema is not None:  # kept on the CPU (model_ema_force_cpu): a device-to-host copy per update
        parts.model_ema.update(unwrap_model(model), step=num_updates)  # DDP and torch.compile off
    if parts.scheduler is not None and parts.sched_on_updates:
        parts.scheduler.step_update(num_updates=num_updates)


class _Skips:
    """Batches skipped for a non-finite loss (``skip_nonfinite``): in the pass, in a row, and whether the current
    accumulation window has one (it then makes no update)."""

    def __init__(self) -> None:
        self.total = self.in_a_row = 0
        self.in_window = False


def _forward_backward(model, images: torch.Tensor, targets: torch.Tensor, parts: StepParts, window: int,
                      need_update: bool, skips: _Skips) -> Optional[torch.Tensor]:
    """The loss of one batch, its backward pass and, at the end of a window, the optimizer step; None when the batch
    is skipped for a non-finite loss (``skip_nonfinite``: checked at once, a read per batch)."""
    with (contextlib.nullcontext() if need_update or not hasattr(model, 'no_sync') else model.no_sync()):
        with parts.autocast():
            loss = parts.loss_fn(model(images), targets)
        if parts.skip_nonfinite and _nonfinite_on_any_rank(loss, parts.dist_info.device):
            skips.total, skips.in_a_row, skips.in_window = skips.total + 1, skips.in_a_row + 1, True
            return None
        skips.in_a_row = 0
        _backward_and_step(model, loss, parts, window, need_update and not skips.in_window)
        return loss


def _end_window(model, parts: StepParts, skips: _Skips, num_updates: int) -> bool:
    """At the end of a window: the update's follow-up (EMA, schedule), or, when the window had a skipped batch, its
    other gradients dropped with it. Returns whether an update was made."""
    updated, skips.in_window = not skips.in_window, False
    if updated:
        _after_update(model, parts, num_updates + 1)
    else:
        parts.optimizer.zero_grad(set_to_none=True)
    return updated


@dataclass
class EpochResult:
    """What one training pass did, reduced over ranks where it is a mean or a rate."""

    train_loss: float  # mean over the pass's finite-loss samples
    lr: float  # of the first param group, at the end of the pass
    img_per_s: float
    train_time: float  # seconds
    batches: int  # batches this rank trained in the pass
    stopped: bool  # the ranks agreed on a stop request inside the pass
    nonfinite_skipped: int  # batches skipped for a non-finite loss (skip_nonfinite)
    num_updates: int  # optimizer updates so far (of the run: the count the pass started from, advanced)

    def record(self) -> Dict[str, Any]:
        """The training entries of the epoch's record (``log.jsonl``); ``nonfinite_skipped`` only when not 0."""
        record = {'train_loss': self.train_loss, 'lr': self.lr, 'img_per_s': self.img_per_s,
                  'train_time': self.train_time}
        if self.nonfinite_skipped:
            record['nonfinite_skipped'] = self.nonfinite_skipped
        return record


def train_one_epoch(model: torch.nn.Module, loader, parts: StepParts, epoch: int, num_updates: int) -> EpochResult:
    """Train for one pass over ``loader``, starting at ``num_updates`` optimizer updates; returns what it did.

    Accumulation: every window of ``accum_steps`` batches (the last one of a pass may be shorter) makes one update
    from the mean loss over its batches, so its gradient is that of one batch of the window's samples.
    With ``stop_request``, all ranks leave together after the update at which they agreed on a stop (see the
    module docstring for when); the result then says ``stopped`` and ``batches`` counts the batches trained.
    A NaN/inf loss (on any rank) raises :class:`NonFiniteLossError` naming the epoch and the first bad update, at
    the next read; the weights in memory may then be non-finite, and are never saved. With ``skip_nonfinite`` the
    batch is checked at once, gets no backward pass and its window no update (``nonfinite_skipped`` counts them);
    more than ``max_nonfinite_skips`` of them in a row still stop the run.
    """
    model.train()
    dist_info, accum = parts.dist_info, parts.accum_steps
    device, num_batches = dist_info.device, len(loader)
    tally, skips = DeviceTally(device), _Skips()
    samples = batches = 0
    totals, read_at, i = None, None, -1
    start = time.perf_counter()
    bar, lines = _progress_bar(loader, parts, epoch)
    parts.optimizer.zero_grad(set_to_none=True)
    for i, (images, targets) in enumerate(bar):
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        if parts.mixup_fn is not None:
            images, targets = parts.mixup_fn(images, targets)
        window = min(accum, num_batches - i // accum * accum)  # the last window of a pass may be short
        need_update = (i + 1) % accum == 0 or i + 1 == num_batches
        loss = _forward_backward(model, images, targets, parts, window, need_update, skips)
        if loss is not None:
            tally.add(loss, images.shape[0], num_updates + 1, i + 1)
        elif skips.in_a_row > parts.max_nonfinite_skips:
            bar.close()
            raise NonFiniteLossError(
                f'{skips.in_a_row} batches in a row with a non-finite loss, the last at epoch {epoch}, update '
                f'{num_updates + 1} (batch {i + 1} of {num_batches} in this pass) (max_nonfinite_skips '
                f'{parts.max_nonfinite_skips})')
        samples, batches = samples + images.shape[0], batches + 1
        if not need_update:
            continue
        updated = _end_window(model, parts, skips, num_updates)
        num_updates += int(updated)
        stop_here = parts.stop_request is not None and parts.stop_request.requested()
        at_interval = updated and num_updates % max(parts.log_interval, 1) == 0
        if at_interval or i + 1 == num_batches or (stop_here and not dist_info.distributed):
            totals, read_at = _checked_read(tally, stop_here, samples, epoch, num_batches, bar), i
            if (lines and at_interval) or not bar.disable:  # a log file: one line per log_interval updates
                _show_progress(bar, lines, epoch, i, num_batches, totals, parts.optimizer, start)
            if totals['stop']:
                parts.stop_request.agree(stop_here)
                break
    bar.close()
    if read_at != i:  # the loader ended before len(loader) batches (an iterable set): read before any save
        totals = _checked_read(tally, False, samples, epoch, num_batches, bar)
    return _epoch_result(totals, parts, start, batches, skips.total, num_updates)


def _progress_bar(loader, parts: StepParts, epoch: int) -> Tuple[Any, bool]:
    """The pass's progress on rank 0: a tqdm bar on a terminal, or (``lines``: True) plain lines in a log file."""
    show = parts.progress and parts.dist_info.is_main
    lines = show and not on_terminal()
    bar = tqdm(loader, total=len(loader), desc=f'epoch {epoch}', leave=False, dynamic_ncols=True,
               disable=not show or lines)
    return bar, lines


def _epoch_result(totals: Dict[str, float], parts: StepParts, start: float, batches: int, nonfinite_skipped: int,
                  num_updates: int) -> EpochResult:
    """The pass's result from its last read (the time taken once the device is done)."""
    device = parts.dist_info.device
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    return EpochResult(train_loss=totals['loss_sum'] / max(totals['count'], 1),
                       lr=parts.optimizer.param_groups[0]['lr'], img_per_s=totals['samples'] / elapsed,
                       train_time=elapsed, batches=batches, stopped=bool(totals['stop']),
                       nonfinite_skipped=nonfinite_skipped, num_updates=num_updates)


def _checked_read(tally: DeviceTally, stop_here: bool, samples: int, epoch: int, num_batches: int,
                  bar) -> Dict[str, float]:
    """The tally's read; a non-finite loss on any rank raises, naming the first bad update (batches skipped by
    ``skip_nonfinite`` never reach the tally)."""
    totals = tally.read(stop_here, samples)
    if totals['bad']:
        update, batch, loss = tally.first_bad()
        bar.close()
        raise NonFiniteLossError(f'non-finite loss ({loss}) at epoch {epoch}, update {int(update)} (batch '
                                 f'{int(batch)} of {num_batches} in this pass)')
    return totals


def _show_progress(bar, lines: bool, epoch: int, i: int, num_batches: int, totals: Dict[str, float],
                   optimizer, start: float) -> None:
    loss, lr = totals['loss_sum'] / max(totals['count'], 1), optimizer.param_groups[0]['lr']
    if lines:
        print(f"epoch {epoch} [{i + 1}/{num_batches}] loss {loss:.4f} lr {lr:.2e} "
              f"{totals['samples'] / (time.perf_counter() - start):.0f} img/s", flush=True)
    else:
        bar.set_postfix(loss=f'{loss:.4f}', lr=f'{lr:.2e}')


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, dist_info: DistInfo, num_samples: Optional[int],
             autocast=contextlib.nullcontext, progress: bool = False) -> Dict[str, float]:
    """Top-1 / top-5 (percent; top-5 None for 5 classes or fewer, where it is always 100), mean cross-entropy and
    throughput over the whole eval set, reduced over ranks.

    ``num_samples`` is the real number of samples on this rank (the distributed sampler's padding is dropped), or
    None where the loader yields each sample once already (an iterable data set). Counts stay on the device: one
    all-reduce and one read at the end.
    """
    model.eval()
    device = dist_info.device
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top-1 hits, top-5 hits, labels outside
    seen, classes = 0, 0
    start = time.perf_counter()
    show = progress and dist_info.is_main and on_terminal()  # evaluation is short: no lines in a log file
    for images, targets in tqdm(loader, desc='eval', leave=False, disable=not show):
        keep = images.shape[0] if num_samples is None else min(images.shape[0], num_samples - seen)
        if keep <= 0:
            break
        images, targets = images[:keep].to(device, non_blocking=True), targets[:keep].to(device, non_blocking=True)
        with autocast():
            logits = model(images)
        logits = logits.float()
        classes = logits.shape[1]
        outside = (targets < 0) | (targets >= classes)  # counted, reported once every rank has reduced them
        hits = logits.topk(min(5, logits.shape[1]), dim=1).indices.eq(targets[:, None])
        sums += torch.stack((F.cross_entropy(logits, targets.clamp(0, classes - 1), reduction='sum').double(),
                             hits[:, 0].sum().double(), hits.any(dim=1).sum().double(), outside.sum().double()))
        seen += keep
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    extra = torch.tensor([float(seen)], dtype=torch.float64).to(device)
    loss_sum, correct1, correct5, outside, seen = all_reduce_sum(torch.cat((sums, extra))).tolist()
    if outside:
        raise DataError(f'{int(outside)} of {int(seen)} labels are outside the model\'s {classes} classes '
                        f'(0-{classes - 1}): the data is not what its head was trained for')
    n = max(seen, 1)
    top5 = 100 * correct5 / n if classes > 5 else None  # with 5 classes or fewer every label is in the top 5
    return {'top1': 100 * correct1 / n, 'top5': top5, 'loss': loss_sum / n, 'num_samples': int(seen),
            'img_per_s': seen / elapsed if elapsed > 0 else 0.0}


def accuracy_text(metrics: Dict[str, Any], prefix: str = '') -> str:
    """``top-1 X | top-5 Y`` of :func:`evaluate`'s metrics (``prefix``: e.g. ``ema_``); top-5 only where it says
    something (more than 5 classes)."""
    top5 = metrics.get(f'{prefix}top5')
    return f"top-1 {metrics[f'{prefix}top1']:.2f}" + ('' if top5 is None else f' | top-5 {top5:.2f}')
