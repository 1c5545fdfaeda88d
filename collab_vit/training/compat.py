"""Work-arounds for incompatibilities between pinned upstream packages (each one small, dated and testable).

* Pillow >= 13 rejects ``ImageOps.posterize(img, 0)``; timm's RandAugment ``PosterizeIncreasing`` (DeiT's
  ``rand-m9-mstd0.5-inc1``) asks for 0 bits whenever the sampled magnitude reaches 10, which crashes a data worker.
  Keeping 0 bits meant an all-black image before Pillow 13, so that is what :func:`posterize` returns.
"""
from __future__ import annotations

from PIL import Image, ImageOps
from timm.data import auto_augment


def posterize(img: Image.Image, bits_to_keep: int, **kwargs) -> Image.Image:
    """timm's posterize op, with ``bits_to_keep <= 0`` giving the black image older Pillow produced."""
    if bits_to_keep <= 0:
        return ImageOps.posterize(img, 1).point(lambda _: 0)
    return auto_augment.posterize(img, bits_to_keep, **kwargs)


def patch_timm_posterize() -> None:
    """Route timm's Posterize* RandAugment ops through :func:`posterize` (idempotent)."""
    for name, fn in list(auto_augment.NAME_TO_OP.items()):
        if fn is auto_augment.posterize:
            auto_augment.NAME_TO_OP[name] = posterize
