"""One layer's weight-only conversion at a key dim: reads the layer's weights (nothing else), returns its ``LayerFit``.

The one entry of every weight-only path (``reparametrize`` without images, the calibrated recipe's weight-only
candidate, timm's DeiT weights converted on load): a rotary layer per frequency (``rotary_fit.fit_rotary``), a
standard one by the Tucker decomposition of its bilinear forms (``fit.fit_attention``, section 3.3).
"""
from __future__ import annotations

import torch.nn as nn

from .fit import LayerFit, fit_attention
from .rotary_fit import fit_rotary


def convert_layer(attn: nn.Module, key_dim: int, rotary: bool = False, **options) -> LayerFit:
    """``attn`` at ``key_dim`` from its weights alone; ``rotary``: a rotary layer of its model (``rotary.is_rotary``);
    ``options``: the Tucker decomposition's (``max_iter, tol, dtype``) of a standard layer."""
    return fit_rotary(attn, key_dim) if rotary else fit_attention(attn, key_dim, **options)
