"""Swap timm ``Attention`` layers of a model for collaborative ones (paper section 3.3)."""
from __future__ import annotations

from typing import Optional

import torch.nn as nn
from timm.layers import Attention

from .attention import CollaborativeAttention, check_key_dim

METHODS = ("tucker", "cp")


def reparametrize(model: nn.Module, key_dim: Optional[int] = None, method: str = "tucker") -> nn.Module:
    """Replace every timm ``Attention`` in ``model`` (in place) by a ``CollaborativeAttention`` and return ``model``.

    With ``key_dim=None`` or ``key_dim >= dim`` the swap is exact (concatenate construction, DESIGN.md section 1).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if key_dim is not None:
        check_key_dim(key_dim)
    targets = [(name, module) for name, module in model.named_modules() if type(module) is Attention]
    if not targets:
        raise ValueError(f"{type(model).__name__} has no timm Attention layer to re-parametrise")
    for name, attn in targets:
        dim = attn.qkv.in_features
        if key_dim is not None and key_dim < dim:
            raise NotImplementedError(f"compressed conversion (key_dim={key_dim} < dim={dim}) is not available yet")
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, CollaborativeAttention.from_attention(attn, key_dim))
    return model
