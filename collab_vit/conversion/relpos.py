"""BEiT-style relative position bias through the conversion: additive to the logits, so it carries over unchanged.

``prepare(model)`` rewrites each BEiT attention layer (``timm.models.beit.Attention``: fused qkv weight, separate
query and value biases, key bias zero) as the equal ``RelPosAttention`` (timm's ``Attention`` plus the bias), which
the conversion then handles as any timm ``Attention``; ``adopts_rel_pos`` gives the collaborative layer fitted from
such a layer the same bias (``CollaborativeRelPosAttention``), before its error is measured.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn as nn

from ..layers.relpos import CollaborativeRelPosAttention, RelPosAttention


def is_beit_attention(module: nn.Module) -> bool:
    return type(module).__name__ == "Attention" and type(module).__module__ == "timm.models.beit"


def from_beit(attn: nn.Module) -> RelPosAttention:
    """The ``RelPosAttention`` computing what BEiT's ``attn`` computes (same parameters' values, its train flag)."""
    dim, attn_dim = attn.qkv.in_features, attn.qkv.out_features // 3
    ref = attn.qkv.weight
    layer = RelPosAttention(dim, attn.num_heads, attn_head_dim=attn_dim // attn.num_heads,
                            qkv_bias=attn.q_bias is not None, attn_drop=attn.attn_drop.p, proj_drop=attn.proj_drop.p,
                            device=ref.device, dtype=ref.dtype)
    with torch.no_grad():
        layer.qkv.weight.copy_(attn.qkv.weight)
        if attn.q_bias is not None:
            layer.qkv.bias.copy_(torch.cat([attn.q_bias, torch.zeros_like(attn.q_bias), attn.v_bias]))
        layer.proj.load_state_dict(attn.proj.state_dict())
    layer.adopt_rel_pos(attn)
    layer.fused_attn = attn.fused_attn
    return layer.train(attn.training)


def prepare(model: nn.Module) -> int:
    """Swap every BEiT attention layer of ``model`` for its ``RelPosAttention`` (in place); how many."""
    found = [(name, module) for name, module in model.named_modules() if is_beit_attention(module)]
    for name, module in found:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, from_beit(module))
    return len(found)


def adopts_rel_pos(fit: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``fit(attn, ...) -> LayerFit``: a layer fitted from a ``RelPosAttention`` keeps its bias."""

    @functools.wraps(fit)
    def wrapper(attn: nn.Module, *args: Any, **kwargs: Any) -> Any:
        fitted = fit(attn, *args, **kwargs)
        if isinstance(attn, RelPosAttention):
            fitted.layer.__class__ = CollaborativeRelPosAttention
            fitted.layer.adopt_rel_pos(attn)
        return fitted

    return wrapper
