"""Label-free refinement of converted layers: match what the source model computes on the calibration images.

Only the collaborative query/key projections and mixing (``W~q, W~k, M``, eq. 5) of the converted layers are
trained; content bias and everything outside attention stay fixed. The loss, no labels:
``KL(softmax(source outputs) || softmax(converted outputs))`` of the model's outputs (logits, or features for a model
without a head), averaged over images (``refine_logits``); ``mean_kl`` is the same measure, which the calibrated
recipe also uses to pick its candidate on held-out images. (Layer-wise losses and refining the values too were
measured and lost: RESULTS.md (b).)

Adam on random minibatches drawn from a seeded generator, so a run is deterministic given its seed on one device.
The mean KL over all the refinement's images is evaluated before and after; if the steps made it worse (seen where the
closed form is already close, e.g. key dim D/4 on Fashion-MNIST: RESULTS.md), the starting weights are restored.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from ..checks import nonnegative_int, positive_real
from ..layers.attention import CollaborativeAttention


@dataclass
class RefineResult:
    steps: int
    seconds: float
    first_loss: float
    last_loss: float
    kl_before: float  # mean KL over all the refinement's images, before the steps
    kl_after: float  # and after them
    kept_start: bool  # the steps made the mean loss worse: the starting weights were restored
    losses: list[float] = field(default_factory=list)


class _Trainable:
    """Only ``params`` get gradients inside the block; flags and train/eval mode are put back after it."""

    def __init__(self, modules: list[nn.Module], params: list[nn.Parameter]) -> None:
        self.modules, self.params = modules, params

    def __enter__(self) -> None:
        self.flags = {p: p.requires_grad for m in self.modules for p in m.parameters()}
        self.modes = [m.training for m in self.modules]
        for m in self.modules:
            m.eval()
            for p in m.parameters():
                p.requires_grad_(False)
        for p in self.params:
            p.requires_grad_(True)

    def __exit__(self, *exc: object) -> None:
        for p, flag in self.flags.items():
            p.requires_grad_(flag)
        for m, mode in zip(self.modules, self.modes):
            m.train(mode)


@torch.no_grad()
def per_image_kl(model: nn.Module, images: Tensor, target: Tensor, batch_size: int) -> Tensor:
    """``KL(source || model)`` of each image (``target``: the source's log-probabilities), float64 on the CPU."""
    device = next(model.parameters()).device
    parts = []
    for start in range(0, images.shape[0], batch_size):
        logits = model(images[start:start + batch_size].to(device))
        kl = F.kl_div(F.log_softmax(logits.float(), dim=-1), target[start:start + batch_size].to(device),
                      log_target=True, reduction="none")
        parts.append(kl.flatten(1).sum(1).detach().double().cpu())
    return torch.cat(parts)


def mean_kl(model: nn.Module, images: Tensor, target: Tensor, batch_size: int) -> float:
    """``KL(source || model)`` averaged over ``images`` (``target``: the source's log-probabilities)."""
    return float(per_image_kl(model, images, target, batch_size).mean())


def refine_logits(model: nn.Module, layers: list[CollaborativeAttention], images: Tensor, targets: Tensor,
                  steps: int, lr: float = 1e-3, batch_size: int = 64, seed: int = 0, progress: bool = True,
                  on_step: Optional[Callable[[int], None]] = None) -> RefineResult:
    """``steps`` Adam steps on the ``W~q, W~k, M`` of ``layers`` so that ``model(images)`` matches ``targets`` (KL).

    ``model`` runs in eval mode (no dropout); the other parameters get no gradient and are left unchanged. Each step
    takes ``batch_size`` images drawn by a generator seeded with ``seed`` at the constant learning rate ``lr`` (a
    cosine decay was measured no better: RESULTS.md (b)); ``on_step(k)`` is called after step ``k`` (the experiments
    read the model there). The mean KL over all ``images`` before and
    after the steps decides whether the starting weights are restored (module docstring). Returns the loss of every
    step (the minibatch's, before its update).
    """
    steps = nonnegative_int(steps, "refine_steps")
    lr = positive_real(lr, "refine_lr")
    params = [p for layer in layers for p in (layer.query.weight, layer.key.weight, layer.mixing)]
    device = params[0].device
    target = F.log_softmax(targets.float(), dim=-1)
    generator = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    with _Trainable([model], params):
        start = time.perf_counter()
        before = mean_kl(model, images, target, batch_size)
        start_weights = [p.detach().clone() for p in params]
        optimizer = torch.optim.Adam(params, lr=lr)
        for step in tqdm(range(steps), desc="refine (KL to the source logits)", disable=not progress):
            index = torch.randperm(images.shape[0], generator=generator)[:batch_size]
            logits = model(images[index].to(device))
            loss = F.kl_div(F.log_softmax(logits.float(), dim=-1), target[index].to(device), log_target=True,
                            reduction="batchmean")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if on_step is not None:
                on_step(step + 1)
        after = mean_kl(model, images, target, batch_size)
        if after > before:
            with torch.no_grad():
                for p, start_weight in zip(params, start_weights):
                    p.copy_(start_weight)
        seconds = time.perf_counter() - start
    return RefineResult(steps, seconds, losses[0] if losses else float("nan"),
                        losses[-1] if losses else float("nan"), before, after, after > before, losses)
