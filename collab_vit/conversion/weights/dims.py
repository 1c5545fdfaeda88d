"""Key dims per layer (section 3.3): one for every layer, one per layer, or None (each layer's full rank: exact).

:func:`check_spec` reads a ``key_dim`` once where it enters (``reparametrize``'s argument, ``collab-vit convert
--key-dim``); :func:`layer_dims` gives one key dim per layer from it, for standard and rotary layers alike, and is the
only resolver the conversion paths call.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch.nn as nn

from ...checks import positive_ints
from ...layers.construction import full_rank

KeyDimSpec = Union[None, int, Sequence[int]]


def check_spec(spec: object) -> KeyDimSpec:
    """``spec`` as None, a positive int or a list of them."""
    if spec is None:
        return None
    return positive_ints(spec, "key_dim", "an int, a list of ints (one per attention layer) or None")


def layer_dims(spec: KeyDimSpec, layers: Sequence[tuple[str, nn.Module]], even: bool = False,
               beyond: Optional[str] = None) -> list[int]:
    """One key dim per layer of ``layers`` from a checked ``spec`` (None: each layer's full rank); ``even``: rotary
    layers (pairs of dims), an odd one refused naming its layer; ``beyond`` (the flag's name): a key dim above a
    layer's full rank refused (the conversion is exact there, a larger one only adds zero columns: docs/math.md).
    Works on meta layers (no weight is read)."""
    if spec is None:
        return [full_rank(attn) for _, attn in layers]
    dims = list(spec) if isinstance(spec, list) else [spec] * len(layers)
    if len(dims) != len(layers):
        raise ValueError(f"key_dim list has {len(dims)} entries but the model has {len(layers)} attention layers")
    for (name, attn), dim in zip(layers, dims):
        if even and dim % 2:
            raise ValueError(f"rotary attention needs an even key_dim (pairs of dims), got {dim} for {name}")
        if beyond is not None and dim > (most := full_rank(attn)):
            raise ValueError(f"{beyond} {dim} is beyond the full rank {most} of {name} (num_heads x head_dim): the "
                             f"conversion is exact at {most}, a larger key dim only adds zero columns")
    return dims

