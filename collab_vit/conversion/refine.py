"""What the refinements of converted layers share (``blockwise.py``): their result, the context that trains only
the collaborative query/key projections and mixing (``W~q, W~k, M``, eq. 5), and the per-image KL of the model's
outputs to the source's (logits, or features for a model without a head), which the calibrated recipe also uses to
pick its candidate on held-out images. No labels anywhere. (A whole-model refinement, layer-wise losses and refining
the values too were measured and lost: RESULTS.md (b).)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


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
