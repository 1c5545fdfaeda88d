"""timm registrations: collaborative rotary ViTs, the RoPE-ViT family (Heo et al. 2024) with collaborative attention.

``import collab_vit`` registers, in timm's naming of its ``vit_{size}_patch16_rope_224`` and
``vit_{size}_patch16_rope_ape_224`` (axial 2-D rope, without and with absolute position embedding):

* ``collab_vit_{small,base}_patch16_{rope,rope_ape}_224`` -- keywords ``key_dim`` (even; default: the embed dim)
  and ``mixing_init`` (``"concatenate"`` or ``"random"``);
* ``collab_vit_{size}_patch16_rope_224_k{N}`` -- the paper's grid (D, D/2, D/4), key dim fixed by the name, for
  the rope-only variant (the ``_ape`` one takes ``key_dim``: timm's model suite runs every registered name at 224 px,
  so the grid is registered once).

Each is timm's own ``Eva`` built by timm's builder with timm's RoPE-ViT arguments, every block's ``AttentionRope``
replaced by :class:`~collab_vit.layers.rotary.CollaborativeAttentionRope` (shared q/k projections whose pairs are
rotated by the model's rope, a complex mixing per head; docs/math.md, "Rotary attention"). At ``key_dim`` = D with
the concatenate init a model computes exactly what timm's RoPE-ViT with the same q/k weights computes. The mixing
matrices are out of timm's weight decay (``no_weight_decay()``), and a model built from scratch is evaluated with
DeiT's crop 0.875, as the collaborative DeiTs.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Type

import timm.models.eva as timm_eva
import torch.nn as nn
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.eva import Eva

from .checks import positive_int
from .layers.attention import attention_class
from .layers.rotary import CollaborativeAttentionRope
from .layers.weight_decay import exclude_mixing_from_decay
from .models import EVAL_CROP_PCT, file_architecture, model_cfg, rope_name

# timm's RoPE-ViT arguments (``timm.models.eva.vit_{size}_patch16_rope_224``): patch 16, depth 12, axial rope.
ROPE_VIT: dict[str, Any] = dict(patch_size=16, depth=12, mlp_ratio=4, attn_type="rope", qkv_bias=True,
                                init_values=1e-5, class_token=True, global_pool="token", use_rot_pos_emb=True,
                                rope_grid_indexing="xy", rope_temperature=100.0)
ROPE_SIZES: dict[str, dict[str, int]] = {"small": dict(embed_dim=384, num_heads=6),
                                         "base": dict(embed_dim=768, num_heads=12)}
ROPE_VARIANTS: dict[str, dict[str, bool]] = {"rope": dict(use_abs_pos_emb=False),  # rope only
                                             "rope_ape": dict(use_abs_pos_emb=True, no_embed_class=True)}
ROPE_GRID: dict[str, tuple[int, ...]] = {"small": (384, 192, 96), "base": (768, 384, 192)}  # D, D/2, D/4
_BUILDING = threading.Lock()  # timm's EvaBlock reads ``AttentionRope`` from its module while blocks are built


ROPE_MODELS: list[str] = [rope_name(s, v) for s in ROPE_SIZES for v in ROPE_VARIANTS] + [
    rope_name(s, "rope", k) for s in ROPE_SIZES for k in ROPE_GRID[s]]
default_cfgs = generate_default_cfgs({name: model_cfg() for name in ROPE_MODELS})


@contextmanager
def _rope_attention(layer: Type[nn.Module]) -> Iterator[None]:
    """Within the block, timm's Eva blocks build ``layer`` where they build ``AttentionRope`` (one build at a
    time)."""
    with _BUILDING:
        timm_rope = timm_eva.AttentionRope
        timm_eva.AttentionRope = layer
        try:
            yield
        finally:
            timm_eva.AttentionRope = timm_rope


def _create_rope(variant: str, size: str, rope: str, pretrained: bool, fixed_key_dim: Optional[int],
                 **kwargs: Any) -> Eva:
    """timm's RoPE-ViT ``size`` / ``rope`` built by timm's builder (``build_model_with_cfg(Eva, ...)``) with the
    collaborative rotary layer at ``key_dim`` in every block. ``kwargs``: timm's ``Eva`` arguments, ``key_dim`` and
    ``mixing_init``."""
    if pretrained:
        file_architecture(kwargs)  # a file this package wrote: the architecture it records
    elif kwargs.get("pretrained_cfg") is None:  # DeiT's evaluation for a model trained from scratch
        kwargs["pretrained_cfg_overlay"] = {"crop_pct": EVAL_CROP_PCT, **(kwargs.get("pretrained_cfg_overlay") or {})}
    key_dim = kwargs.pop("key_dim", fixed_key_dim)
    if fixed_key_dim is not None and key_dim != fixed_key_dim:
        raise ValueError(f"{variant} fixes key_dim={fixed_key_dim}; use {variant.rsplit('_k', 1)[0]} for "
                         f"key_dim={key_dim}")
    args = {**ROPE_VIT, **ROPE_SIZES[size], **ROPE_VARIANTS[rope], **kwargs}
    if args.get("rope_type", "cat") != "cat" or args.get("qk_norm") or args.get("num_kv_heads") is not None:
        raise ValueError(f"{variant} is axial rope (rope_type 'cat') without qk_norm or grouped-query attention, got "
                         f"rope_type={args.get('rope_type')!r}, qk_norm={args.get('qk_norm')}, "
                         f"num_kv_heads={args.get('num_kv_heads')}")
    layer = attention_class(CollaborativeAttentionRope, args["embed_dim"] if key_dim is None else
                            positive_int(key_dim, "key_dim"), args.pop("mixing_init", "concatenate"))
    out_indices = args.pop("out_indices", 3)
    with _rope_attention(layer):
        model = build_model_with_cfg(Eva, variant, pretrained,
                                     feature_cfg=dict(out_indices=out_indices, feature_cls="getter"), **args)
    return exclude_mixing_from_decay(model)


@register_model
def collab_vit_small_patch16_rope_224(pretrained: bool = False, **kwargs) -> Eva:
    """Collaborative RoPE-Axial ViT-S/16 (embed 384, 6 heads); ``key_dim`` keyword, default 384."""
    return _create_rope("collab_vit_small_patch16_rope_224", "small", "rope", pretrained, None, **kwargs)


@register_model
def collab_vit_small_patch16_rope_ape_224(pretrained: bool = False, **kwargs) -> Eva:
    """Collaborative RoPE-Axial + APE ViT-S/16 (embed 384, 6 heads); ``key_dim`` keyword, default 384."""
    return _create_rope("collab_vit_small_patch16_rope_ape_224", "small", "rope_ape", pretrained, None, **kwargs)


@register_model
def collab_vit_base_patch16_rope_224(pretrained: bool = False, **kwargs) -> Eva:
    """Collaborative RoPE-Axial ViT-B/16 (embed 768, 12 heads); ``key_dim`` keyword, default 768."""
    return _create_rope("collab_vit_base_patch16_rope_224", "base", "rope", pretrained, None, **kwargs)


@register_model
def collab_vit_base_patch16_rope_ape_224(pretrained: bool = False, **kwargs) -> Eva:
    """Collaborative RoPE-Axial + APE ViT-B/16 (embed 768, 12 heads); ``key_dim`` keyword, default 768."""
    return _create_rope("collab_vit_base_patch16_rope_ape_224", "base", "rope_ape", pretrained, None, **kwargs)


@register_model
def collab_vit_small_patch16_rope_224_k384(pretrained: bool = False, **kwargs) -> Eva:
    """Collaborative RoPE-Axial ViT-S/16, shared key/query dim 384 (192 rotated pairs)."""
    return _create_rope("collab_vit_small_patch16_rope_224_k384", "small", "rope", pretrained, 384, **kwargs)


@register_model
def collab_vit_small_patch16_rope_224_k192(pretrained: bool = False, **kwargs) -> Eva:
    """Collaborative RoPE-Axial ViT-S/16, shared key/query dim 192 (96 rotated pairs)."""
    return _create_rope("collab_vit_small_patch16_rope_224_k192", "small", "rope", pretrained, 192, **kwargs)


@register_model
def collab_vit_small_patch16_rope_224_k96(pretrained: bool = False, **kwargs) -> Eva:
    """Collaborative RoPE-Axial ViT-S/16, shared key/query dim 96 (48 rotated pairs)."""
    return _create_rope("collab_vit_small_patch16_rope_224_k96", "small", "rope", pretrained, 96, **kwargs)


@register_model
def collab_vit_base_patch16_rope_224_k768(pretrained: bool = False, **kwargs) -> Eva:
    """Collaborative RoPE-Axial ViT-B/16, shared key/query dim 768 (384 rotated pairs)."""
    return _create_rope("collab_vit_base_patch16_rope_224_k768", "base", "rope", pretrained, 768, **kwargs)


@register_model
def collab_vit_base_patch16_rope_224_k384(pretrained: bool = False, **kwargs) -> Eva:
    """Collaborative RoPE-Axial ViT-B/16, shared key/query dim 384 (192 rotated pairs)."""
    return _create_rope("collab_vit_base_patch16_rope_224_k384", "base", "rope", pretrained, 384, **kwargs)


@register_model
def collab_vit_base_patch16_rope_224_k192(pretrained: bool = False, **kwargs) -> Eva:
    """Collaborative RoPE-Axial ViT-B/16, shared key/query dim 192 (96 rotated pairs)."""
    return _create_rope("collab_vit_base_patch16_rope_224_k192", "base", "rope", pretrained, 192, **kwargs)
