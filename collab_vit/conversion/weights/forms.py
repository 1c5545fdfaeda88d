"""Other timm attention forms rewritten as timm's ``Attention`` so that they convert (``layers/forms.py``).

* BEiT (``timm.models.beit.Attention``: fused qkv weight, separate query and value biases, key bias zero, relative
  position bias): the bias is additive to the logits, so it carries over unchanged (``RelPosAttention``).
* EVA without rotary embeddings (``timm.models.eva.EvaAttention`` in a model whose ``rope`` is None, no qk_norm,
  no gate): fused qkv or separate q/k/v projections, biases, scale norm (``EvaFormAttention``).

``prepare(model)`` swaps each such layer for the equal rewritten one, which the conversion then handles as any timm
``Attention``; ``keeps_form`` gives the collaborative layer fitted from it the same form (bias, call signature)
before its error is measured.
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from timm.layers import Attention

from ...layers.construction import conversion_reason, replace_submodule
from ...layers.forms import (CollaborativeEvaFormAttention, CollaborativeRelPosAttention, EvaFormAttention,
                             RelPosAttention)

COLLABORATIVE_FORM = {RelPosAttention: CollaborativeRelPosAttention, EvaFormAttention: CollaborativeEvaFormAttention}


def is_beit_attention(module: nn.Module) -> bool:
    return type(module).__name__ == "Attention" and type(module).__module__ == "timm.models.beit"


def is_eva_attention(module: nn.Module) -> bool:
    return type(module).__name__ == "EvaAttention" and type(module).__module__ == "timm.models.eva"


def from_eva(attn: nn.Module) -> EvaFormAttention:
    """The ``EvaFormAttention`` computing what EVA's ``attn`` (without rope) computes."""
    dim = attn.proj.out_features
    if attn.qkv is not None:
        weight = attn.qkv.weight
        bias = None if attn.q_bias is None else torch.cat([attn.q_bias, torch.zeros_like(attn.q_bias), attn.v_bias])
    else:
        weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        bias = None if attn.q_proj.bias is None else torch.cat(
            [attn.q_proj.bias, torch.zeros_like(attn.q_proj.bias), attn.v_proj.bias])
    layer = EvaFormAttention(dim, attn.num_heads, qkv_bias=bias is not None, attn_drop=attn.attn_drop.p,
                             proj_drop=attn.proj_drop.p, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        layer.qkv.weight.copy_(weight)
        if bias is not None:
            layer.qkv.bias.copy_(bias)
        layer.proj.load_state_dict(attn.proj.state_dict())
    layer.norm = copy.deepcopy(attn.norm)  # scale_norm
    layer.fused_attn = attn.fused_attn
    return layer.train(attn.training)


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


def rewrite(module: nn.Module, model: nn.Module) -> Optional[Attention]:
    """The timm-``Attention`` form of ``module`` if it is a BEiT layer or a convertible EVA one, else None."""
    if is_beit_attention(module) and conversion_reason(module) is None:
        return from_beit(module)
    if is_eva_attention(module) and getattr(model, "rope", None) is None and conversion_reason(module) is None:
        return from_eva(module)
    return None


def prepare(model: nn.Module) -> int:
    """Swap every BEiT / rope-free EVA attention layer of ``model`` for its timm-``Attention`` form (in place);
    returns how many."""
    found = [(name, form) for name, module in model.named_modules()
             if (form := rewrite(module, model)) is not None]
    for name, form in found:
        replace_submodule(model, name, form)
    return len(found)


def keeps_form(fit: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``fit(attn, ...) -> LayerFit``: a layer fitted from a rewritten form keeps that form (BEiT's bias,
    EVA's call signature)."""

    @functools.wraps(fit)
    def wrapper(attn: nn.Module, *args: Any, **kwargs: Any) -> Any:
        fitted = fit(attn, *args, **kwargs)
        form = COLLABORATIVE_FORM.get(type(attn))
        if form is not None:
            fitted.layer.__class__ = form
            if isinstance(attn, RelPosAttention):
                fitted.layer.adopt_rel_pos(attn)
        return fitted

    return wrapper
