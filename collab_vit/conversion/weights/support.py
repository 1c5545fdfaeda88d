"""Which attention layers of a timm model convert to collaborative attention (section 3.3), and why others do not.

The conversion rewrites the per-head bilinear forms ``x_n^T Wq_i Wk_i^T x_m`` of a self-attention layer in one
shared key space (eq. 5). It covers timm's ``Attention`` (fused qkv, with or without qkv bias, ``scale_norm``), in
whatever model it sits: everything around it (layer scale, register tokens, class token or none, average or
attention pooling, pre-norm, depth and width) is left as it is, so the conversion is exact at full rank.

Checked before any work (:func:`check_model`), with a one-line ``ValueError`` naming the first layer that cannot be
converted and the reason:

* ``qk_norm``: each head's queries and keys are normalised token by token, so a logit is no longer a bilinear form
  of the two tokens;
* rotary attention (``AttentionRope``, EVA's attention with rope) converts exactly at full rank (``rotary.py``); refused
  there: mixed rope (frequencies learned per head), ``qk_norm``, grouped-query attention;
* differential attention, gated outputs, ``attn_head_dim x heads != dim``, and attention classes other than timm's
  (EVA, ...): not covered;
* no self-attention layer at all (a CNN, say).

BEiT's attention (relative position bias, additive to the logits) and EVA's without rope (fused or separate q/k/v)
convert too: ``forms.py`` rewrites them as timm's ``Attention`` first. Parts that are not self-attention stay as they are and are reported (``kept``): SigLIP's attention-pool head
(``AttentionPoolLatent``: a learned latent query cross-attends to the tokens).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch.nn as nn
from timm.layers import Attention, AttentionPoolLatent

from ...layers.attention import CollaborativeAttention, ConcatAttention
from ...layers.construction import conversion_reason
from ...layers.forms import EvaFormAttention, RelPosAttention
from ...layers.weight_decay import exclude_mixing_from_decay
from . import forms
from .forms import is_beit_attention, is_eva_attention, prepare
from .rotary import rotary_reason

ATTENTION_LIKE = re.compile(r"attention|attn", re.IGNORECASE)
REASONS_BY_CLASS = {  # class name -> why it does not convert
    "DiffAttention": "differential attention subtracts two softmax maps: no single collaborative softmax",
}
KEPT_BY_CLASS = {
    AttentionPoolLatent: "attention-pool head (a learned latent query cross-attends to the tokens; not "
                         "self-attention): kept as it is",
}


@dataclass
class Support:
    """What a conversion of a model touches: the layers it converts and the attention-like parts it keeps."""

    layers: list[tuple[str, nn.Module]] = field(default_factory=list)  # timm Attention; BEiT's until ``prepare``
    kept: dict[str, str] = field(default_factory=dict)  # module name -> why it stays as it is


def attention_reason(attn: nn.Module) -> Optional[str]:
    """Why a timm ``Attention`` (or subclass) does not convert exactly (a subclass with its own forward, or
    ``construction.conversion_reason``); None when it does."""
    if type(attn).forward is not Attention.forward and not isinstance(attn, (RelPosAttention, EvaFormAttention)):
        return f"{type(attn).__name__} subclasses timm's Attention with its own forward: not known to be convertible"
    return conversion_reason(attn)


def _other_reason(module: nn.Module, model: nn.Module) -> Optional[str]:
    """Why an attention-like module that is not timm's ``Attention`` does not convert; None if it is no attention."""
    name = type(module).__name__
    if name in REASONS_BY_CLASS:
        return REASONS_BY_CLASS[name]
    if hasattr(module, "relative_position_bias_table") and not isinstance(module, RelPosAttention):
        return f"{type(module).__module__}.{name} (relative position bias): not timm's Attention, not covered"
    child_names = {n for n, _ in module.named_children()}
    if ATTENTION_LIKE.search(name) or child_names & {"qkv", "q_proj", "in_proj", "qkv_proj"}:
        return f"{type(module).__module__}.{name} is not timm's Attention: not covered"
    return None


def _convertible_reason(module: nn.Module, model: nn.Module) -> Optional[str]:
    """For a layer of a kind the conversion handles (timm's ``Attention``, EVA's without rope, BEiT's, rotary ones):
    "" when it converts, else why not; None for any other module."""
    rotary = rotary_reason(module, model)  # rope: ``rotary.py``
    if rotary is not None:
        return rotary
    if isinstance(module, Attention):
        return attention_reason(module) or ""
    if (is_eva_attention(module) and getattr(model, "rope", None) is None) or is_beit_attention(module):
        return conversion_reason(module) or ""  # rewritten first (``forms.py``); BEiT's bias adds to the logits
    return None


def check_model(model: nn.Module) -> Support:
    """The convertible layers and kept parts of ``model``; a one-line ``ValueError`` (layer and reason) if any
    attention layer cannot be converted, or if there is none. Reads the module tree only (works on ``meta``)."""
    support, refused, inside = Support(), [], ()
    for name, module in model.named_modules():
        if inside and any(name.startswith(prefix + ".") for prefix in inside):
            continue  # submodules of a layer already classified
        convertible = _convertible_reason(module, model)
        if convertible is not None:
            if convertible:
                refused.append((name, type(module).__name__, convertible))
            else:
                support.layers.append((name, module))
        elif isinstance(module, (CollaborativeAttention, ConcatAttention)):
            refused.append((name, type(module).__name__, "already collaborative or cut attention"))
        elif type(module) in KEPT_BY_CLASS:
            support.kept[name] = KEPT_BY_CLASS[type(module)]
        else:
            why = _other_reason(module, model)
            if why is None:
                continue
            refused.append((name, type(module).__name__, why))
        inside = (*inside, name)
    if refused:
        name, cls, why = refused[0]
        more = {1: "", 2: " (and 1 more layer)"}.get(len(refused), f" (and {len(refused) - 1} more layers)")
        raise ValueError(f"cannot convert {name or 'the model'} ({cls}): {why}{more}; the model is left as it was")
    if not support.layers:
        raise ValueError(f"{type(model).__name__} has no timm Attention layer (self-attention) to convert")
    return support


def attention_forms(model: nn.Module) -> list[tuple[str, Attention]]:
    """:func:`check_model`'s layers, each in timm ``Attention``'s form: BEiT / EVA layers not yet swapped by
    ``forms.prepare`` are given as their rewritten copies (for reading, e.g. the spectrum; the model is unchanged)."""
    return [(name, forms.rewrite(module, model) or module) for name, module in check_model(model).layers]


def kept_text(kept: dict[str, str]) -> str:
    """One line per kept part, for the conversion report."""
    return "\n".join(f"{name}: {why}" for name, why in kept.items())


def all_or_nothing(convert: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``convert(model, ...)``: :func:`check_model` first (nothing is done to a model that cannot be
    converted), and if the conversion fails half way, every swapped submodule, the model's class and every
    module's train/eval flag are put back, so the model is never left partly converted. On success the mixing
    matrices leave weight decay (``exclude_mixing_from_decay``) and the report gets the kept parts
    (``report.kept``)."""

    @functools.wraps(convert)
    def wrapper(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        check_model(model)
        children = [(module, dict(module._modules), module.training) for module in model.modules()]
        cls = model.__class__
        try:
            prepare(model)  # BEiT's and EVA's layers in timm Attention's form (forms.py)
            support = check_model(model)
            report = convert(model, *args, **kwargs)
        except BaseException:
            for module, modules, training in children:
                module._modules.clear()
                module._modules.update(modules)
                module.training = training
            model.__class__ = cls
            raise
        exclude_mixing_from_decay(model)  # timm's create_optimizer_v2 keeps the mixing matrices out of decay
        report.kept = dict(support.kept)
        return report

    return wrapper
