"""Label-free refinement of converted layers: match the source model's output logits on the calibration images.

Only the collaborative query/key projections and mixing (``W~q, W~k, M``, eq. 5) of the converted layers are
trained; values, output projection, content bias and everything outside attention stay fixed. The loss is
``KL(softmax(source logits) || softmax(converted logits))`` averaged over images (no labels), minimised by Adam on
random minibatches drawn from a seeded generator, so a run is deterministic given its seed on one device. The
mean KL over all calibration images is evaluated before and after; if the steps made it worse (seen where the
closed form is already close, e.g. key dim D/4 on Fashion-MNIST: RESULTS.md), the starting weights are restored.
"""
from __future__ import annotations

import numbers
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from ..layers.attention import CollaborativeAttention


@dataclass
class RefineResult:
    steps: int
    seconds: float
    first_loss: float
    last_loss: float
    kl_before: float  # mean KL over all the images, before the steps
    kl_after: float  # and after them
    kept_start: bool  # the steps made the mean KL worse: the starting weights were restored
    losses: list[float] = field(default_factory=list)


def check_steps(steps: object) -> int:
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
        raise ValueError(f"refine_steps must be an int >= 0, got {steps!r}")
    return int(steps)


@torch.no_grad()
def mean_kl(model: nn.Module, images: Tensor, target: Tensor, batch_size: int) -> float:
    """``KL(source || model)`` averaged over ``images`` (``target``: the source's log-probabilities)."""
    device = next(model.parameters()).device
    total = 0.0
    for start in range(0, images.shape[0], batch_size):
        logits = model(images[start:start + batch_size].to(device))
        total += float(F.kl_div(F.log_softmax(logits.float(), dim=-1), target[start:start + batch_size].to(device),
                                log_target=True, reduction="sum"))
    return total / images.shape[0]


def refine_logits(model: nn.Module, layers: list[CollaborativeAttention], images: Tensor, targets: Tensor,
                  steps: int, lr: float = 1e-3, batch_size: int = 64, seed: int = 0,
                  progress: bool = True) -> RefineResult:
    """``steps`` Adam steps on the ``W~q, W~k, M`` of ``layers`` so that ``model(images)`` matches ``targets`` (KL).

    ``model`` runs in eval mode (no dropout); the other parameters get no gradient and are left unchanged. Returns
    the loss of every step (the minibatch's, before its update).
    """
    steps = check_steps(steps)
    if not isinstance(lr, numbers.Real) or not lr > 0:
        raise ValueError(f"refine_lr must be a positive number, got {lr!r}")
    params = [p for layer in layers for p in (layer.query.weight, layer.key.weight, layer.mixing)]
    frozen = {p: p.requires_grad for p in model.parameters()}
    was_training = model.training
    device = params[0].device
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(params, lr=lr)
    target = F.log_softmax(targets.float(), dim=-1)
    losses: list[float] = []
    start = time.perf_counter()
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        model.eval()
        before = mean_kl(model, images, target, batch_size)
        start_weights = [p.detach().clone() for p in params]
        terminal = progress and sys.stderr.isatty()  # a tqdm bar on a terminal, plain lines in a log file
        every = max(1, steps // 10)
        for step in tqdm(range(steps), desc="refine (KL to the source logits)", disable=not terminal):
            index = torch.randperm(images.shape[0], generator=generator)[:batch_size]
            logits = model(images[index].to(device))
            loss = F.kl_div(F.log_softmax(logits.float(), dim=-1), target[index].to(device), log_target=True,
                            reduction="batchmean")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if progress and not terminal and ((step + 1) % every == 0 or step + 1 == steps):
                print(f"refine step {step + 1}/{steps}: KL {losses[-1]:.3g}", file=sys.stderr, flush=True)
        after = mean_kl(model, images, target, batch_size)
        if after > before:
            with torch.no_grad():
                for p, start_weight in zip(params, start_weights):
                    p.copy_(start_weight)
    finally:
        for p, flag in frozen.items():
            p.requires_grad_(flag)
        model.train(was_training)
    seconds = time.perf_counter() - start
    return RefineResult(steps, seconds, losses[0] if losses else float("nan"),
                        losses[-1] if losses else float("nan"), before, after, after > before, losses)
