"""The calibrated conversion's guard: a candidate replaces the weight-only fit only when it wins beyond what the
held-out images resolve.

Each candidate is scored per held-out image by the conversion's objective (:func:`per_image_scores`,
``objective.scores``: ``KL(softmax(source) || softmax(candidate))`` of a classifier's logits; for a model whose
output is features, their ``1 - cosine`` or relative squared error to the source's, ``objective.FEATURE_OBJECTIVE``).
The guard compares a candidate with the weight-only fit on the same images: the per-image gains ``d_n =
score_weight,n - score_candidate,n``, their mean, and a percentile bootstrap interval of that mean (``resamples``
resamplings of the images, seeded). The candidate is kept only when the interval's lower end is above zero;
otherwise the weight-only fit is returned. With one held-out image the interval is that image's gain.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import torch
import torch.nn as nn
from torch import Tensor

from .objective import scores

RESAMPLES = 2000


@torch.no_grad()
def per_image_scores(model: nn.Module, images: Tensor, source: Tensor, batch_size: int, objectives: Sequence[str]
                     ) -> list[Tensor]:
    """Each of ``objectives``' score of every image (``objective.scores``: float64 on the CPU) against the source's
    outputs on ``images`` (``source``), from one pass of ``model`` batch by batch."""
    device = next(model.parameters()).device
    parts: list[list[Tensor]] = [[] for _ in objectives]
    for start in range(0, images.shape[0], batch_size):
        outputs = model(images[start:start + batch_size].to(device))
        for part, name in zip(parts, objectives):
            part.append(scores(outputs, source[start:start + batch_size], name))
    return [torch.cat(part) for part in parts]


def held_out_split(n: int, seed: int) -> Tensor:
    """A seeded order of ``n`` calibration images (the first ones are fitted, the rest held out (the guard's
    choice is then reproducible by seed, whatever order the images came in))."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


@dataclass
class Verdict:
    """A candidate against the weight-only fit on the held-out images."""

    candidate: str
    gain: float  # mean per-image score gain over the weight-only fit (positive: the candidate is closer to the source)
    low: float  # the bootstrap interval of the gain
    high: float
    confidence: float
    kept: bool  # low > 0: the candidate wins beyond the interval

    def as_dict(self) -> dict:
        return asdict(self)


def judge(candidate: str, weight_scores: Tensor, candidate_scores: Tensor, confidence: float, seed: int) -> Verdict:
    """The verdict on ``candidate`` from the per-image scores of the weight-only fit and of the candidate (module
    docstring): a two-sided ``confidence`` percentile interval of the mean gain, ``RESAMPLES`` resamplings seeded
    by ``seed``."""
    gains = (weight_scores - candidate_scores).double()
    n = gains.numel()
    draws = torch.randint(n, (RESAMPLES, n), generator=torch.Generator().manual_seed(seed))
    means = gains[draws].mean(dim=1)
    tail = (1 - confidence) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return Verdict(candidate, float(gains.mean()), low, high, confidence, low > 0)
