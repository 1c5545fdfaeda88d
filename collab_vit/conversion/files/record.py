"""What the file or folder of a converted model records, and how the model is rebuilt from it.

A timm model converted to collaborative attention (``reparametrize``, ``collab-vit convert``) is recorded as
its source: the source's timm name and keyword arguments and, for each converted layer, the collaborative class it
became and its key dim. ``collab_vit_converted`` (``models.py``) creates the source's
architecture without its weights, swaps those layers for collaborative ones (:func:`swap_layers`) and loads the
weights: any model that converts can be rebuilt (BEiT, EVA, rotary ViTs, distilled DeiT, parallel blocks). A
converted timm DeiT (``deit_{tiny,small,base}_patch16_224``) is recorded as the registered
``collab_deit_{size}_patch16_224`` with the source's arguments and one key dim per layer (the names:
:data:`COLLABORATIVE_NAMES`, which ``models.py`` fills as it registers them).
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import timm
import torch
import torch.nn as nn

from ...layers.attention import CollaborativeAttention
from ...layers.construction import full_rank, replace_submodule
from ...layers.forms import RelPosBias
from ...layers.weight_decay import exclude_mixing_from_decay
from ...weights_io import one_line
from ..weights.forms import COLLABORATIVE_FORM
from ..weights.rotary import is_rotary, rotary_like
from ..weights.support import attention_forms

COLLABORATIVE_NAMES: dict[str, str] = {}  # timm source name -> the registered model its conversion is recorded as
CONVERTED_MODEL = "collab_vit_converted"
SOURCE, LAYERS = "source_model", "collaborative_layers"  # the two keywords collab_vit_converted adds to the source's


def layer_record(model: nn.Module) -> dict[str, dict[str, Any]]:
    """``{layer name: {"layer": class name, "key_dim": k}}`` of every collaborative layer of ``model``."""
    return {name: {"layer": type(module).__name__, "key_dim": module.key_dim}
            for name, module in model.named_modules() if isinstance(module, CollaborativeAttention)}


def converted_record(model: nn.Module, source: str, args: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The registered entry point and keyword arguments that rebuild ``model``, converted from timm's ``source``
    created with ``args`` (see the module docstring)."""
    layers = layer_record(model)
    deit = COLLABORATIVE_NAMES.get(source)
    if deit and all(entry["layer"] == CollaborativeAttention.__name__ for entry in layers.values()):
        return deit, {**args, "key_dim": [entry["key_dim"] for entry in layers.values()]}
    return CONVERTED_MODEL, {**args, SOURCE: source, LAYERS: layers}


def _collaborative_like(form: nn.Module, cls: type, key_dim: int) -> CollaborativeAttention:
    """An untrained ``cls`` layer of ``key_dim`` shaped as the converted ``form`` (a timm ``Attention``): its
    biases, dropouts, scale norm, kernel choice and (BEiT) relative position bias."""
    ref = form.qkv.weight
    layer = cls(form.qkv.in_features, form.num_heads, key_dim=key_dim, qkv_bias=form.qkv.bias is not None,
                proj_bias=form.proj.bias is not None, attn_drop=form.attn_drop.p, proj_drop=form.proj_drop.p,
                device=ref.device, dtype=ref.dtype)
    layer.norm = form.norm
    layer.fused_attn = form.fused_attn
    if isinstance(layer, RelPosBias):
        layer.adopt_rel_pos(form)
    return layer.train(form.training)


def full_rank_record(model: nn.Module) -> dict[str, dict[str, Any]]:
    """The record of ``model`` (a timm model) with every attention layer collaborative at its full rank
    (heads x head dim): what ``collab_vit_converted`` builds when no record is given."""
    return {name: {"layer": COLLABORATIVE_FORM.get(type(form), CollaborativeAttention).__name__,
                   "key_dim": full_rank(form)} for name, form in attention_forms(model)}


def swap_layers(model: nn.Module, layers: Optional[dict[str, dict[str, Any]]]) -> nn.Module:
    """Swap the attention layers of ``model`` (a timm model built as the source) for the recorded collaborative
    ones (untrained: the weights are loaded after), in place; a one-line ``ValueError`` where the record does not
    fit the model. ``layers=None``: every attention layer at full rank (:func:`full_rank_record`)."""
    forms = dict(attention_forms(model))
    layers = full_rank_record(model) if layers is None else layers
    if set(forms) != set(layers):
        raise ValueError(f"the record names the attention layers {sorted(layers)[:3]}..., the source has "
                         f"{sorted(forms)[:3]}... ({len(layers)} vs {len(forms)})")
    for name, entry in layers.items():
        rotary = is_rotary(forms[name], model)  # ``rotary.py``
        layer = rotary_like(forms[name], entry["key_dim"]) if rotary else None
        cls = type(layer) if rotary else COLLABORATIVE_FORM.get(type(forms[name]), CollaborativeAttention)
        if entry.get("layer") != cls.__name__:
            raise ValueError(f"the record makes {name} a {entry.get('layer')}, the source's layer becomes a "
                             f"{cls.__name__}")
        replace_submodule(model, name, layer or _collaborative_like(forms[name], cls, entry["key_dim"]))
    return exclude_mixing_from_decay(model)


def rebuild_problem(model: nn.Module, name: str, args: dict[str, Any]) -> Optional[str]:
    """Why the model ``timm.create_model(name, **args)`` given ``model``'s weights is not ``model`` (None when it
    computes bit-identical outputs on a probe batch)."""
    source = copy.deepcopy(model).float().cpu().eval()
    try:
        rebuilt = timm.create_model(name, **args).eval()
    except (TypeError, ValueError, KeyError, AssertionError, RuntimeError) as e:
        return f"{name} does not take the recorded arguments ({one_line(e)})"
    own, recorded = source.state_dict(), rebuilt.state_dict()
    wrong = [k for k in own.keys() | recorded.keys() if k not in own or k not in recorded
             or own[k].shape != recorded[k].shape]
    if wrong:
        return f"rebuilt as {name} its weights differ at {sorted(wrong)[:4]}"
    rebuilt.load_state_dict(own)
    for a, b in zip(source.modules(), rebuilt.modules()):  # same kernels: the check is of the architecture
        if hasattr(a, "fused_attn") and hasattr(b, "fused_attn"):
            b.fused_attn = a.fused_attn
    size = tuple(source.patch_embed.img_size)
    x = torch.randn(2, source.patch_embed.proj.in_channels, *size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if not torch.equal(source(x), rebuilt(x)):
            return f"rebuilt as {name} it computes other outputs"
    return None
