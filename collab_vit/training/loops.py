"""One training epoch and one evaluation pass (the two loops; everything else is assembled in ``trainer``)."""
from __future__ import annotations

import contextlib
import math
import sys
import time
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F
from timm.utils import AverageMeter, ModelEmaV3, NativeScaler, accuracy, dispatch_clip_grad
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from .distributed import DistInfo, all_reduce_sum
from .preemption import StopRequest


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or inf (or too many such batches in a row were skipped); one-line message."""


def _nonfinite_on_any_rank(loss_value: float, device: torch.device) -> bool:
    """True on every rank when the loss of any rank is NaN/inf, so that all ranks skip or stop together."""
    bad = not math.isfinite(loss_value)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        flag = torch.tensor([1.0 if bad else 0.0], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        bad = bool(flag.item())
    return bad


def autocast_context(device: torch.device, amp: bool, amp_dtype: str) -> Callable[[], Any]:
    """Factory of autocast contexts: mixed precision on GPU when asked, plain float32 on CPU."""
    if amp and device.type == 'cuda':
        dtype = torch.bfloat16 if amp_dtype in ('bfloat16', 'bf16') else torch.float16
        return lambda: torch.autocast(device_type='cuda', dtype=dtype)
    return contextlib.nullcontext


def on_terminal() -> bool:
    """Whether progress goes to a terminal (tqdm writes to stderr); in a log file it is plain lines instead."""
    return sys.stderr.isatty()


def train_one_epoch(
        model: torch.nn.Module,
        loader,
        optimizer: torch.optim.Optimizer,
        loss_fn: torch.nn.Module,
        dist_info: DistInfo,
        epoch: int,
        num_updates: int,
        scheduler=None,
        sched_on_updates: bool = False,
        accum_steps: int = 1,
        clip_grad: float = 0.0,
        clip_mode: str = 'norm',
        mixup_fn=None,
        autocast=contextlib.nullcontext,
        loss_scaler: Optional[NativeScaler] = None,
        model_ema: Optional[ModelEmaV3] = None,
        progress: bool = True,
        stop_request: Optional[StopRequest] = None,
        log_interval: int = 50,
        skip_nonfinite: bool = False,
        max_nonfinite_skips: int = 5,
) -> tuple[Dict[str, float], int]:
    """Train for one pass over ``loader``; returns (epoch metrics reduced over ranks, optimizer updates so far).

    With ``stop_request``, all ranks leave together after the first optimizer update at which a stop was asked for;
    the metrics then say ``stopped: True`` and ``batches`` counts the batches trained in this pass. Progress (rank
    0, ``progress``): a tqdm bar on a terminal, else one plain line every ``log_interval`` updates.

    A NaN/inf loss (on any rank) raises :class:`NonFiniteLossError` naming the epoch and update, before its backward
    pass, so the weights stay as they were after the last good update. With ``skip_nonfinite`` the batch gets no
    backward pass and its accumulation window no optimizer update (``nonfinite_skipped`` counts such batches); more
    than ``max_nonfinite_skips`` of them in a row still stop the run.
    """
    model.train()
    device = dist_info.device
    loss_meter = AverageMeter()
    num_batches = len(loader)
    samples = batches = 0
    stopped = False
    skipped = in_a_row = 0
    window_skipped = False  # a batch of the current accumulation window was skipped: no update for this window
    start = time.perf_counter()
    show = progress and dist_info.is_main
    lines = show and not on_terminal()
    bar = tqdm(loader, total=num_batches, desc=f'epoch {epoch}', leave=False, dynamic_ncols=True,
               disable=not show or lines)
    optimizer.zero_grad(set_to_none=True)
    for i, (images, targets) in enumerate(bar):
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        if mixup_fn is not None:
            images, targets = mixup_fn(images, targets)
        need_update = (i + 1) % accum_steps == 0 or i + 1 == num_batches
        sync = need_update or not hasattr(model, 'no_sync')
        with (contextlib.nullcontext() if sync else model.no_sync()):
            with autocast():
                loss = loss_fn(model(images), targets)
            loss_value = loss.item()
            nonfinite = _nonfinite_on_any_rank(loss_value, device)
            if nonfinite:
                skipped += 1
                in_a_row += 1
                where = f'epoch {epoch}, update {num_updates + 1} (batch {i + 1} of {num_batches} in this pass)'
                if not skip_nonfinite or in_a_row > max_nonfinite_skips:
                    bar.close()
                    why = (f'{in_a_row} batches in a row with a non-finite loss, the last at {where} '
                           f'(max_nonfinite_skips {max_nonfinite_skips})') if skip_nonfinite else \
                        f'non-finite loss ({loss_value}) at {where}'
                    raise NonFiniteLossError(why)
                window_skipped = True
            else:
                in_a_row = 0
                if loss_scaler is not None:
                    loss_scaler(loss / accum_steps, optimizer, clip_grad=clip_grad or None, clip_mode=clip_mode,
                                parameters=model.parameters(), need_update=need_update and not window_skipped)
                else:
                    (loss / accum_steps).backward()
                    if need_update and not window_skipped:
                        if clip_grad:
                            dispatch_clip_grad(model.parameters(), clip_grad, mode=clip_mode)
                        optimizer.step()
        if need_update and window_skipped:
            optimizer.zero_grad(set_to_none=True)  # the window's other gradients are dropped with it
            window_skipped = False
        elif need_update:
            optimizer.zero_grad(set_to_none=True)
            num_updates += 1
            if model_ema is not None:
                model_ema.update(model.module if isinstance(model, DistributedDataParallel) else model,
                                 step=num_updates)
            if scheduler is not None and sched_on_updates:
                scheduler.step_update(num_updates=num_updates)
        if not nonfinite:
            loss_meter.update(loss_value, images.shape[0])
        samples += images.shape[0]
        batches += 1
        bar.set_postfix(loss=f'{loss_meter.avg:.4f}', lr=f"{optimizer.param_groups[0]['lr']:.2e}")
        if lines and need_update and num_updates % max(log_interval, 1) == 0:
            print(f"epoch {epoch} [{i + 1}/{num_batches}] loss {loss_meter.avg:.4f} "
                  f"lr {optimizer.param_groups[0]['lr']:.2e} {samples / (time.perf_counter() - start):.0f} img/s",
                  flush=True)
        if need_update and stop_request is not None and stop_request.should_stop(device):
            stopped = True
            break
    bar.close()
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    totals = all_reduce_sum(torch.tensor([loss_meter.sum, loss_meter.count, samples], dtype=torch.float64,
                                         device=device)).tolist()
    metrics = {'train_loss': totals[0] / max(totals[1], 1), 'lr': optimizer.param_groups[0]['lr'],
               'img_per_s': totals[2] / elapsed, 'train_time': elapsed, 'batches': batches, 'stopped': stopped,
               'nonfinite_skipped': skipped}
    return metrics, num_updates


@torch.no_grad()
def evaluate(
        model: torch.nn.Module,
        loader,
        dist_info: DistInfo,
        num_samples: int,
        autocast=contextlib.nullcontext,
        progress: bool = False,
) -> Dict[str, float]:
    """Top-1 / top-5 (percent), mean cross-entropy and throughput over the whole eval set, reduced over ranks.

    ``num_samples`` is the real number of samples on this rank; the distributed sampler's padding is dropped.
    """
    model.eval()
    device = dist_info.device
    loss_sum = correct1 = correct5 = seen = 0.0
    start = time.perf_counter()
    show = progress and dist_info.is_main and on_terminal()  # evaluation is short: no lines in a log file
    for images, targets in tqdm(loader, desc='eval', leave=False, disable=not show):
        keep = min(images.shape[0], num_samples - int(seen))
        if keep <= 0:
            break
        images, targets = images[:keep].to(device, non_blocking=True), targets[:keep].to(device, non_blocking=True)
        with autocast():
            logits = model(images)
        logits = logits.float()
        maxk = min(5, logits.shape[1])
        acc1, acc5 = accuracy(logits, targets, topk=(1, maxk))
        loss_sum += F.cross_entropy(logits, targets, reduction='sum').item()
        correct1 += round(acc1.item() * keep / 100)
        correct5 += round(acc5.item() * keep / 100)
        seen += keep
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    loss_sum, correct1, correct5, seen, _ = all_reduce_sum(torch.tensor(
        [loss_sum, correct1, correct5, seen, 0.0], dtype=torch.float64, device=device)).tolist()
    n = max(seen, 1)
    return {'top1': 100 * correct1 / n, 'top5': 100 * correct5 / n, 'loss': loss_sum / n, 'num_samples': int(seen),
            'img_per_s': seen / elapsed if elapsed > 0 else 0.0}
