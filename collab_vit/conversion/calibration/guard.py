"""The calibrated conversion's guard: a candidate replaces the weight-only fit only when it wins beyond what the
held-out images resolve.

Each candidate is scored per held-out image by ``KL(softmax(source) || softmax(candidate))`` (:func:`per_image_kl`:
of the model's outputs, logits or features for a model without a head). The guard compares a
candidate with the weight-only fit on the same images: the per-image gains ``d_n = KL_weight,n - KL_candidate,n``,
their mean, and a percentile bootstrap interval of that mean (``resamples`` resamplings of the images, seeded). The
candidate is kept only when the interval's lower end is above zero; otherwise the weight-only fit is returned. With
one held-out image the interval is that image's gain.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

RESAMPLES = 2000


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


def held_out_split(n: int, seed: int) -> Tensor:
    """A seeded order of ``n`` calibration images (the first ones are fitted, the rest held out (the guard's
    choice is then reproducible by seed, whatever order the images came in))."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


@dataclass
class Verdict:
    """A candidate against the weight-only fit on the held-out images."""

    candidate: str
    gain: float  # mean per-image KL gain over the weight-only fit (positive: the candidate is closer to the source)
    low: float  # the bootstrap interval of the gain
    high: float
    confidence: float
    kept: bool  # low > 0: the candidate wins beyond the interval

    def as_dict(self) -> dict:
        return asdict(self)


def judge(candidate: str, weight_kl: Tensor, candidate_kl: Tensor, confidence: float, seed: int) -> Verdict:
    """The verdict on ``candidate`` from the per-image KLs of the weight-only fit and of the candidate (module
    docstring): a two-sided ``confidence`` percentile interval of the mean gain, ``RESAMPLES`` resamplings seeded
    by ``seed``."""
    gains = (weight_kl - candidate_kl).double()
    n = gains.numel()
    draws = torch.randint(n, (RESAMPLES, n), generator=torch.Generator().manual_seed(seed))
    means = gains[draws].mean(dim=1)
    tail = (1 - confidence) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return Verdict(candidate, float(gains.mean()), low, high, confidence, low > 0)
