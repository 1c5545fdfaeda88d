"""The tokens each attention layer sees on the calibration images, from the source model.

``source``: one pass of the unconverted model with a forward pre-hook on every timm ``Attention`` (the input of the
attention, i.e. the output of ``block.norm1`` in a ViT); the moments of the fitting images are streamed batch by
batch (nothing but D x D sums is kept) and only the held-out images' tokens are stored.
(Sequential capture, from the partially converted model, was measured within noise of it and removed: RESULTS.md
(b).) :func:`calibration_images` turns a tensor or a loader into checked image batches; :func:`peek` counts them
and decodes the first few before the rest (the cost line comes first), and :class:`Pixels` keeps a folder's images
as their uint8 pixels, normalised where they enter the model (:func:`normalising`).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch
import torch.nn as nn
from timm.layers import Attention
from torch import Tensor

from ... import console
from ..weights.whitening import TokenMoments
from .state import allocate


@dataclass
class Pixels:
    """Calibration images kept as their pixels, a quarter of float32's bytes: ``loader`` yields uint8 (B, C, H, W)
    batches (or ``(images, labels)``) of the evaluation transform up to ``ToTensor``, and ``mean`` / ``std`` are the
    ``Normalize`` that follows, applied where the images enter the model (:class:`Normalise`)."""

    loader: Any
    mean: Sequence[float]
    std: Sequence[float]


Calibration = Union[Tensor, Iterable, Pixels]


def tensor_bytes(t: Tensor) -> int:
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
    return moments, held, sum(tensor_bytes(t) for t in held if t is not None), torch.cat(outputs)


class Normalise(nn.Module):
    """uint8 pixels to the model's input: ``ToTensor``'s division by 255, then ``Normalize``, in float32 with tensor
    operands, the operations torchvision runs (so the same values, bit for bit; a tensor divisor also keeps CUDA from
    multiplying by a rounded reciprocal). Its buffers are part of the model's state while it is installed, so the
    conversion's resume key covers the normalisation."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((1, 1, 1), 255.0))
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(-1, 1, 1))

    def forward(self, pixels: Tensor) -> Tensor:
        return pixels.to(torch.float32).div(self.scale).sub(self.mean).div(self.std)


NORMALISE = "calibration_pixels"  # the model's submodule while a conversion reads uint8 calibration images


@contextmanager
def normalising(model: nn.Module, calibration: Calibration) -> Iterator[None]:
    """Inside the block, ``model`` takes :class:`Pixels`' uint8 images as it takes their normalised floats (a forward
    pre-hook and a :class:`Normalise` submodule, both gone after the block); nothing for other calibration."""
    if not isinstance(calibration, Pixels):
        yield
        return
    model.add_module(NORMALISE, Normalise(calibration.mean, calibration.std).to(next(model.parameters()).device))

    def normalise(module: nn.Module, args: tuple) -> Optional[tuple]:
        if args and isinstance(args[0], Tensor) and args[0].dtype == torch.uint8:
            return (getattr(module, NORMALISE)(args[0]), *args[1:])
        return None

    handle = model.register_forward_pre_hook(normalise)
    try:
        yield
    finally:
        handle.remove()
        delattr(model, NORMALISE)


@dataclass
class Pending:
    """Calibration images before they are decoded (:func:`peek`): how many, the first few, and ``read()``, all of
    them (uint8 for :class:`Pixels`, else float)."""

    count: int
    first: Tensor
    read: Callable[[], Tensor]


PEEK = 8  # images decoded before the others: the cost's one timed forward pass and its sizes


def peek(calibration: Calibration, input_size: Sequence[int], batch_size: int = 64) -> Pending:
    """The number of calibration images and the first ``PEEK`` decoded (checked), before the others are: a
    :class:`Pixels` loader over a sized dataset counts its files' list and decodes its first items; other
    calibration is read whole first."""
    dataset = getattr(getattr(calibration, "loader", None), "dataset", None)
    if isinstance(calibration, Pixels) and hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        count = len(dataset)
        if count == 0:
            raise ValueError("calibration data is empty: no images")
        first = torch.stack([_image(dataset[i]) for i in range(min(PEEK, count))])
        _check_pixels(first, input_size)
        return Pending(count, first, lambda: pixel_images(calibration, input_size, count))
    images = calibration_images(calibration, input_size, batch_size)
    return Pending(images.shape[0], images[:PEEK], lambda: images)


def pixel_images(pixels: Pixels, input_size: Sequence[int], count: Optional[int] = None) -> Tensor:
    """:class:`Pixels`' images as one uint8 (B, C, H, W) tensor (filled batch by batch where ``count`` is known)."""
    return _gather(pixels.loader, lambda images: _check_pixels(images, input_size), count)


def calibration_images(calibration: Calibration, input_size: Sequence[int], batch_size: int = 64) -> Tensor:
    """The calibration images as one (B, C, H, W) float tensor, checked against the model's ``input_size``.

    ``calibration``: a (B, C, H, W) tensor, an iterable of batches (a ``DataLoader`` yielding ``(images,
    labels)`` or images), or :class:`Pixels` (normalised here). One-line ``ValueError`` for an empty input, a wrong
    shape (channels, size) or non-finite pixels.
    """
    if isinstance(calibration, Pixels):
        return Normalise(calibration.mean, calibration.std)(pixel_images(calibration, input_size))
    batches = calibration.split(batch_size) if isinstance(calibration, Tensor) else calibration
    return _gather(batches, lambda images: _check_images(images, input_size))


def _image(item: Any) -> Tensor:
    """The image of a batch or a dataset item (``(image, label)`` or the image)."""
    return item[0] if isinstance(item, (tuple, list)) else item


def _gather(batches: Iterable, check: Callable[[Tensor], None], count: Optional[int] = None) -> Tensor:
    """``batches``' images, each checked, in one tensor: preallocated for ``count`` images where it is known (no
    second copy), else concatenated."""
    try:
        iterator: Iterator = iter(batches)
    except TypeError:
        raise ValueError(f"calibration must be an image tensor or an iterable of batches, got "
                         f"{type(batches).__name__}") from None
    kept, out, at = [], None, 0
    for batch in iterator:
        images = _image(batch)
        check(images)
        images = images.detach()
        if count is None:
            kept.append(images)
        else:
            out = images.new_empty((count, *images.shape[1:])) if out is None else out
            out[at:at + images.shape[0]] = images
        at += images.shape[0]
    if at == 0:
        raise ValueError("calibration data is empty: no images")
    return torch.cat(kept) if out is None else out[:at]


def _check_pixels(images: Tensor, input_size: Sequence[int]) -> None:
    if not isinstance(images, Tensor) or images.dim() != 4 or images.dtype != torch.uint8:
        raise ValueError(f"calibration pixels must be uint8 (B, C, H, W) tensors (the transform up to ToTensor), got "
                         f"{getattr(images, 'dtype', type(images).__name__)} {tuple(getattr(images, 'shape', ()))}")
    _check_shape(images, input_size)


def _check_images(images: object, input_size: Sequence[int]) -> None:
    if not isinstance(images, Tensor) or images.dim() != 4 or not images.is_floating_point():
        raise ValueError(f"calibration images must be floating (B, C, H, W) tensors, got "
                         f"{getattr(images, 'shape', type(images).__name__)}")
    _check_shape(images, input_size)
    if not bool(torch.isfinite(images).all()):
        raise ValueError("calibration images contain NaN or infinite values")


def _check_shape(images: Tensor, input_size: Sequence[int]) -> None:
    channels, height, width = input_size
    if images.shape[1] != channels:
        raise ValueError(f"calibration images have {images.shape[1]} channels, the model takes {channels}")
    if tuple(images.shape[2:]) != (height, width):
        raise ValueError(f"calibration images are {images.shape[2]}x{images.shape[3]} px, the model takes "
                         f"{height}x{width}")
