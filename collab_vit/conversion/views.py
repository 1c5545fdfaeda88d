"""Augmented views of the calibration images, the refinement's inputs (``recipe.py``).

The label-free refinement matches the source model's outputs, not labels, so any image becomes a training pair once
the source has scored it: each fitting image gives ``count`` views, itself first and then ``count - 1`` random views
of one ``kind``, and the source's outputs on every view are the refinement's targets. The calibration images then
give ``count`` times as many distinct token sets at no cost in refinement steps (RESULTS.md (b) measures the kinds
against the images alone at equal steps). The views are drawn from ``seed`` with torch's CPU generator forked, so a
conversion is reproducible by its seed and leaves the global random state as it found it.

Kinds (torchvision's transforms on the model-ready tensors: a crop resized back is linear in the pixels, so it
commutes with the normalisation): ``"light"``, a random-resized crop of 80-100 % of the area and a horizontal flip
(the Fashion-MNIST sources' own training pipeline); ``"crop"``, the same down to 25 % of the area (DeiT's pipeline
crops down to 8 %); ``"cutmix"``, light views with a box of another fitting image pasted in (CutMix without labels:
every token of the view is a real image's).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor
from torchvision.transforms import v2

from ..checks import positive_int

KINDS: dict[str, tuple[float, float]] = {"light": (0.8, 1.0), "crop": (0.25, 1.0), "cutmix": (0.8, 1.0)}  # crop areas


def check_kind(kind: object) -> str:
    if kind not in KINDS:
        raise ValueError(f"views must be one of {tuple(KINDS)}, got {kind!r}")
    return str(kind)


def _cutmix(batch: Tensor) -> Tensor:
    """Each view with a box of another view of the batch pasted in; the box covers ``1 - lam`` of the image with
    ``lam ~ U(0, 1)`` (CutMix's Beta(1, 1)), placed uniformly where it fits."""
    n, _, height, width = batch.shape
    partner = torch.randperm(n)
    out = batch.clone()
    for i in range(n):
        side = math.sqrt(1.0 - float(torch.rand(())))
        h, w = int(height * side), int(width * side)
        top = int(torch.randint(height - h + 1, ()))
        left = int(torch.randint(width - w + 1, ()))
        out[i, :, top:top + h, left:left + w] = batch[partner[i], :, top:top + h, left:left + w]
    return out


@torch.no_grad()
def augmented_views(images: Tensor, count: int, kind: str, seed: int) -> Tensor:
    """``(count x N, C, H, W)``: the N ``images`` as given, then ``count - 1`` seeded random views of each
    (``kind``: module docstring), view by view."""
    count = positive_int(count, "views")
    kind = check_kind(kind)
    if count == 1:
        return images
    transform = v2.Compose([v2.RandomResizedCrop(tuple(images.shape[-2:]), scale=KINDS[kind], antialias=True),
                            v2.RandomHorizontalFlip()])
    views = [images]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(count - 1):
            batch = torch.stack([transform(image) for image in images.cpu()]).to(images.device)
            views.append(_cutmix(batch) if kind == "cutmix" else batch)
    return torch.cat(views)
