"""The tokens each attention layer sees on the calibration images: from the source model, or sequentially.

``source``: one pass of the unconverted model with a forward pre-hook on every timm ``Attention`` (the input of the
attention, i.e. the output of ``block.norm1`` in a ViT); the moments of the fitting images are streamed batch by
batch (nothing but D x D sums is kept) and only the held-out images' tokens are stored.

``sequential`` (as GPTQ does): layer j is fitted on the tokens the *partially converted* model produces, i.e. with
layers ``0 .. j-1`` already replaced (``block_tokens``; with ``sequential=False`` the same pass carries the source's
tokens, for a layer-wise refinement that needs every fitting token of a layer rather than its moments). One tensor of block inputs for the calibration set is pushed block by block
(``block.norm1`` of it feeds layer j's moments, then the converted block makes the next one), so memory holds two
layers' tokens for the calibration set at most. Needs a ViT-like ``model.blocks`` with ``norm1`` and ``attn``.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from timm.layers import Attention
from torch import Tensor

from .calibration import TokenMoments

CAPTURES = ("source", "sequential")


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
    return TokenMoments(attn.qkv.in_features, prefix_tokens(model))


@torch.no_grad()
def source_tokens(model: nn.Module, layers: list[tuple[str, Attention]], images: Tensor, fit: int,
                  batch_size: int) -> tuple[list[TokenMoments], list[Tensor], int]:
    """Moments of the first ``fit`` images' tokens per layer, the held-out images' tokens per layer, peak bytes held.

    The peak counts the stored held-out tokens (the moments are D x D per layer).
    """
    moments = [new_moments(model, attn) for _, attn in layers]
    held: list[list[Tensor]] = [[] for _ in layers]
    start = [0]

    def hook(index: int):
        def record(module: nn.Module, args: tuple) -> None:
            x = args[0].detach()
            cut = max(0, min(fit - start[0], x.shape[0]))
            if cut:
                moments[index].update(x[:cut])
            if cut < x.shape[0]:
                held[index].append(_kept(x[cut:]))
        return record

    handles = [attn.register_forward_pre_hook(hook(i)) for i, (_, attn) in enumerate(layers)]
    try:
        device = next(model.parameters()).device
        for chunk in images.split(batch_size):
            model(chunk.to(device))
            start[0] += chunk.shape[0]
    finally:
        for handle in handles:
            handle.remove()
    tokens = [torch.cat(h) if h else None for h in held]
    return moments, tokens, sum(_bytes(t) for t in tokens if t is not None)


class _Stop(Exception):
    pass


@torch.no_grad()
def block_inputs(model: nn.Module, images: Tensor, batch_size: int) -> Tensor:
    """What ``model.blocks[0]`` receives for ``images`` (patch embedding, position embedding, pre-norm)."""
    seen: list[Tensor] = []

    def stop(module: nn.Module, args: tuple) -> None:
        seen.append(args[0].detach())
        raise _Stop

    handle = model.blocks[0].register_forward_pre_hook(stop)
    device = next(model.parameters()).device
    try:
        for chunk in images.split(batch_size):
            try:
                model(chunk.to(device))
            except _Stop:
                pass
    finally:
        handle.remove()
    return torch.cat(seen).to(torch.promote_types(seen[0].dtype, torch.float32))


def check_sequential(model: nn.Module, layers: list[tuple[str, Attention]]) -> None:
    """Sequential capture needs ``model.blocks[j].attn`` to be the j-th attention layer and a ``norm1``."""
    blocks = getattr(model, "blocks", None)
    if blocks is None or len(blocks) != len(layers) or any(
            getattr(b, "attn", None) is not attn or not hasattr(b, "norm1") for b, (_, attn) in zip(blocks, layers)):
        raise ValueError("capture='sequential' needs a ViT-like model.blocks (one attn and norm1 per block); "
                         "use capture='source'")


@torch.no_grad()
def block_tokens(model: nn.Module, layers: list[tuple[str, Attention]], images: Tensor, fit: int, batch_size: int,
                 convert: Callable[[int, TokenMoments, Tensor], None], sequential: bool = True
                 ) -> tuple[list[Tensor], int]:
    """Fit the layers one after the other, pushing the block inputs of the calibration images block by block.

    ``convert(j, moments, inputs)`` replaces ``model.blocks[j].attn`` (``inputs``: block j's inputs for the fitting
    images, for a layer-wise refinement). ``sequential``: the next block's inputs come from the converted block (the
    partially converted model's tokens); otherwise from the source block, computed before the swap (the source's
    tokens, as ``source_tokens``, but held). Returns the held-out tokens per layer and the peak bytes of tokens held.
    """
    check_sequential(model, layers)
    hidden = block_inputs(model, images, batch_size)
    held, peak = [], _bytes(hidden)

    def push(block: nn.Module) -> Tensor:
        following = torch.empty_like(hidden)
        for offset in range(0, hidden.shape[0], batch_size):
            following[offset:offset + batch_size] = block(hidden[offset:offset + batch_size])
        return following

    for index, block in enumerate(model.blocks):
        moments = new_moments(model, layers[index][1])
        parts = []
        for offset in range(0, hidden.shape[0], batch_size):
            x = block.norm1(hidden[offset:offset + batch_size])
            cut = max(0, min(fit - offset, x.shape[0]))
            if cut:
                moments.update(x[:cut])
            if cut < x.shape[0]:
                parts.append(_kept(x[cut:]))
        held.append(torch.cat(parts) if parts else None)
        last = index + 1 == len(model.blocks)
        if not (sequential or last):
            following = push(block)  # through the source block, before it is swapped
        convert(index, moments, hidden[:fit])
        if not last:
            if sequential:
                following = push(block)  # through the converted block
            peak = max(peak, 2 * _bytes(hidden) + sum(_bytes(t) for t in held if t is not None))
            hidden = following
    return held, peak

