"""The tokens each attention layer sees on the calibration images, from the source model.

``source``: one pass of the unconverted model with a forward pre-hook on every timm ``Attention`` (the input of the
attention, i.e. the output of ``block.norm1`` in a ViT); the moments of the fitting images are streamed batch by
batch (nothing but D x D sums is kept) and only the held-out images' tokens are stored.
(Sequential capture, from the partially converted model, was measured within noise of it and removed: RESULTS.md
(b).) :func:`calibration_images` turns a tensor or a loader into checked image batches.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional, Sequence, Union

import torch
import torch.nn as nn
from timm.layers import Attention
from torch import Tensor

from ... import console
from ..weights.whitening import TokenMoments
from .state import allocate

Calibration = Union[Tensor, Iterable]


def _bytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _kept(t: Tensor) -> Tensor:
    """Tokens as held: on the CPU, at least float32 (bfloat16 under ``amp`` autocast)."""
    return t.to("cpu", torch.promote_types(t.dtype, torch.float32))


@torch.no_grad()
def model_outputs(model: nn.Module, images: Tensor, batch_size: int) -> Tensor:
    """The model's outputs (logits) on ``images`` in eval mode, batch by batch."""
    device = next(model.parameters()).device
    return torch.cat([model(chunk.to(device)) for chunk in images.split(batch_size)])


def prefix_tokens(model: nn.Module) -> int:
    """The model's prefix tokens (timm's ``num_prefix_tokens``: class token, registers); 0 if it has none."""
    return int(getattr(model, "num_prefix_tokens", 0) or 0)


def new_moments(model: nn.Module, attn: Attention) -> TokenMoments:
    """Empty moments for one layer, the model's prefix tokens kept apart (``TokenMoments.prefix``)."""
    qkv = attn.qkv if getattr(attn, "qkv", None) is not None else attn.q_proj  # EVA's separate q/k/v
    return TokenMoments(qkv.in_features, prefix_tokens(model))


@torch.no_grad()
def source_tokens(model: nn.Module, layers: list[tuple[str, Attention]], images: Tensor, fit: int,
                  batch_size: int, show: bool = False) -> tuple[list[TokenMoments], list[Tensor], int, Tensor]:
    """Moments of the first ``fit`` images' tokens per layer, the held-out images' tokens per layer, peak bytes held,
    and the model's outputs on all ``images`` (the same forward passes; ``show``: a progress bar over the images).

    The peak counts the stored held-out tokens (the moments are D x D per layer).
    """
    moments = [new_moments(model, attn) for _, attn in layers]
    held: list[Optional[Tensor]] = [None for _ in layers]
    start = [0]

    def hook(index: int):
        def record(module: nn.Module, args: tuple) -> None:
            x = args[0].detach()
            cut = max(0, min(fit - start[0], x.shape[0]))
            if cut:
                moments[index].update(x[:cut])
            if cut < x.shape[0]:
                kept = _kept(x[cut:])
                if held[index] is None:  # the active store's file (``state.allocate``), in memory without one
                    held[index] = allocate(f"held-{index}", (images.shape[0] - fit, *kept.shape[1:]), kept.dtype)
                at = start[0] + cut - fit
                held[index][at:at + kept.shape[0]] = kept
        return record

    handles = [attn.register_forward_pre_hook(hook(i)) for i, (_, attn) in enumerate(layers)]
    bar = console.progress(images.shape[0], "token statistics (images)", show)
    try:
        device = next(model.parameters()).device
        outputs = []
        for chunk in images.split(batch_size):
            outputs.append(model(chunk.to(device)))
            start[0] += chunk.shape[0]
            bar.update(chunk.shape[0])
    finally:
        bar.close()
        for handle in handles:
            handle.remove()
    return moments, held, sum(_bytes(t) for t in held if t is not None), torch.cat(outputs)


def calibration_images(calibration: Calibration, input_size: Sequence[int], batch_size: int = 64) -> Tensor:
    """The calibration images as one (B, C, H, W) float tensor, checked against the model's ``input_size``.

    ``calibration``: a (B, C, H, W) tensor, or an iterable of batches (a ``DataLoader`` yielding ``(images,
    labels)`` or images). One-line ``ValueError`` for an empty input, a wrong shape (channels, size) or non-finite
    pixels.
    """
    batches = calibration.split(batch_size) if isinstance(calibration, Tensor) else calibration
    try:
        iterator: Iterator = iter(batches)
    except TypeError:
        raise ValueError(f"calibration must be an image tensor or an iterable of batches, got "
                         f"{type(calibration).__name__}") from None
    kept = []
    for batch in iterator:
        images = batch[0] if isinstance(batch, (tuple, list)) else batch
        _check_images(images, input_size)
        kept.append(images.detach())
    if not kept or sum(images.shape[0] for images in kept) == 0:
        raise ValueError("calibration data is empty: no images")
    return torch.cat(kept)


def _check_images(images: object, input_size: Sequence[int]) -> None:
    channels, height, width = input_size
    if not isinstance(images, Tensor) or images.dim() != 4 or not images.is_floating_point():
        raise ValueError(f"calibration images must be floating (B, C, H, W) tensors, got "
                         f"{getattr(images, 'shape', type(images).__name__)}")
    if images.shape[1] != channels:
        raise ValueError(f"calibration images have {images.shape[1]} channels, the model takes {channels}")
    if tuple(images.shape[2:]) != (height, width):
        raise ValueError(f"calibration images are {images.shape[2]}x{images.shape[3]} px, the model takes "
                         f"{height}x{width}")
    if not bool(torch.isfinite(images).all()):
        raise ValueError("calibration images contain NaN or infinite values")
