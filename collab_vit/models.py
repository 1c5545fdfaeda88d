"""timm registrations: collaborative DeiTs (paper section 4, vision) and the reduced-key-dim concatenate baselines.

``import collab_vit`` registers every model here with timm:

* ``collab_deit_{tiny,small,base}_patch16_224`` -- keyword ``key_dim`` (default: the embed dim) and ``mixing_init``;
* ``collab_deit_{size}_patch16_224_k{N}`` -- the paper's grid, key dim fixed by the name;
* ``concat_deit_{size}_patch16_224_k{N}`` -- standard attention with each head's key/query dim cut to N / heads.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Sequence, Type, Union

import torch.nn as nn
from timm.layers import Attention
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import VisionTransformer, build_model_with_cfg, generate_default_cfgs, register_model

from .layers.attention import (CollaborativeAttention, ConcatAttention, attention_class, check_key_dim,
                               per_block_attention_class)
from .conversion.pretrained import collab_filter_fn, conversion, converted_file_kwargs

# DeiT sizes (Touvron et al. 2021), patch 16 at 224 px.
DEIT_ARCHS: dict[str, dict[str, int]] = {
    "tiny": dict(patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "small": dict(patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "base": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12),
}
# The paper's key-dim grid: full, 1/2 and 1/4 of the embed dim (collaborative); the reduced ones for the baseline.
KEY_DIM_GRID: dict[str, tuple[int, ...]] = {"tiny": (192, 96, 48), "small": (384, 192, 96), "base": (768, 384, 192)}


def _cfg(**kwargs: Any) -> dict[str, Any]:
    """Default cfg as timm's DeiT (input 224, bicubic, crop 0.9, ImageNet mean/std)."""
    return {
        "url": "", "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": None,
        "crop_pct": .9, "interpolation": "bicubic", "fixed_input_size": True,
        "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj", "classifier": "head", "license": "apache-2.0",
        **kwargs,
    }


def collab_name(size: str, key_dim: Optional[int] = None) -> str:
    return f"collab_deit_{size}_patch16_224" + ("" if key_dim is None else f"_k{key_dim}")


def concat_name(size: str, key_dim: Optional[int] = None) -> str:
    return f"concat_deit_{size}_patch16_224" + ("" if key_dim is None else f"_k{key_dim}")


COLLAB_MODELS: list[str] = [collab_name(s) for s in DEIT_ARCHS] + [
    collab_name(s, k) for s, grid in KEY_DIM_GRID.items() for k in grid]
CONCAT_MODELS: list[str] = [concat_name(s) for s in DEIT_ARCHS] + [
    concat_name(s, k) for s, grid in KEY_DIM_GRID.items() for k in grid[1:]]

# timm's DeiT ImageNet-1k weights, converted on load (collab_vit.pretrained); the key dim comes from the keyword.
DEIT_WEIGHTS = {size: dict(hf_hub_id=f"timm/deit_{size}_patch16_224.fb_in1k",
                           url=f"https://dl.fbaipublicfiles.com/deit/deit_{size}_patch16_224-{sha}.pth")
                for size, sha in (("tiny", "a1311bcf"), ("small", "cd65a155"), ("base", "b5f2ef4d"))}
default_cfgs = generate_default_cfgs({
    **{f"{collab_name(size)}.fb_in1k": _cfg(**DEIT_WEIGHTS[size]) for size in DEIT_ARCHS},
    **{name: _cfg() for name in COLLAB_MODELS[len(DEIT_ARCHS):] + CONCAT_MODELS},
})


def query_key_params(layer: nn.Module) -> int:
    """Parameters that form the attention logits: q/k projections (+ mixing and content bias when collaborative)."""
    if isinstance(layer, CollaborativeAttention):
        parts = [layer.query, layer.key, layer.content_bias]
        return sum(p.numel() for part in parts if part is not None for p in part.parameters()) + layer.mixing.numel()
    if isinstance(layer, ConcatAttention):
        rows = 2 * layer.key_dim
    elif isinstance(layer, Attention):
        rows = 2 * layer.attn_dim
    else:
        raise TypeError(f"not an attention layer: {type(layer).__name__}")
    bias = layer.qkv.bias is not None
    return rows * (layer.qkv.in_features + bias)


def create_deit(
        variant: str,
        attn_base: Type[nn.Module],
        key_dim: Union[None, int, Sequence[int]],
        pretrained: bool = False,
        mixing_init: Optional[str] = None,
        conversion_method: str = "tucker",
        **kwargs: Any,
) -> VisionTransformer:
    """Build a DeiT-style ``VisionTransformer`` whose blocks use ``attn_base`` with ``key_dim`` (one, or per block).

    With ``pretrained``, standard-attention weights (timm's DeiT) are converted on load with ``conversion_method``.
    """
    embed_dim = kwargs.get("embed_dim", 768)
    if isinstance(key_dim, (list, tuple)):
        key_dims = tuple(check_key_dim(k) for k in key_dim)
        attn_layer = per_block_attention_class(attn_base, key_dims, mixing_init)
    else:
        attn_layer = attention_class(attn_base, embed_dim if key_dim is None else check_key_dim(key_dim), mixing_init)
    out_indices = kwargs.pop("out_indices", 3)
    with conversion(conversion_method):
        model = build_model_with_cfg(
            VisionTransformer,
            variant,
            pretrained,
            pretrained_filter_fn=collab_filter_fn,
            feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
            attn_layer=attn_layer,
            **kwargs,
        )
    if isinstance(key_dim, (list, tuple)) and attn_layer.remaining():
        raise ValueError(f"key_dim list has {len(key_dim)} entries but the model has {kwargs.get('depth', 12)} blocks")
    return model


def _make_entrypoint(name: str, size: str, attn_base: Type[nn.Module], fixed_key_dim: Optional[int]) -> Callable:
    """One timm entry point (``fn(pretrained=False, **kwargs)``) for a named variant."""

    def entrypoint(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
        if fixed_key_dim is not None and kwargs.get("key_dim", fixed_key_dim) != fixed_key_dim:
            raise ValueError(f"{name} fixes key_dim={fixed_key_dim}; use {collab_name(size)} for key_dim="
                             f"{kwargs['key_dim']}")
        if pretrained and "key_dim" not in kwargs:  # a converted file records its key dims
            overlay = kwargs.get("pretrained_cfg_overlay") or {}
            kwargs.update({k: v for k, v in converted_file_kwargs(overlay.get("file")).items() if k == "key_dim"})
        key_dim = kwargs.pop("key_dim", fixed_key_dim)
        method = kwargs.pop("conversion_method", "tucker")
        mixing_init = kwargs.pop("mixing_init", "concatenate") if attn_base is CollaborativeAttention else None
        model_args = dict(DEIT_ARCHS[size], qkv_bias=True)
        return create_deit(name, attn_base, key_dim, pretrained, mixing_init, method, **dict(model_args, **kwargs))

    entrypoint.__name__ = entrypoint.__qualname__ = name
    entrypoint.__module__ = __name__
    kind = "Collaborative" if attn_base is CollaborativeAttention else "Reduced-key-dim concatenate"
    dims = "key_dim keyword, default embed dim" if fixed_key_dim is None else f"key_dim={fixed_key_dim}"
    entrypoint.__doc__ = f"{kind} DeiT-{size} patch16 224 ({dims})."
    return entrypoint


def _register_all() -> None:
    module = sys.modules[__name__]
    for size, grid in KEY_DIM_GRID.items():
        entries = [(collab_name(size), CollaborativeAttention, None)]
        entries += [(collab_name(size, k), CollaborativeAttention, k) for k in grid]
        entries += [(concat_name(size), ConcatAttention, None)]
        entries += [(concat_name(size, k), ConcatAttention, k) for k in grid[1:]]
        for name, attn_base, key_dim in entries:
            fn = _make_entrypoint(name, size, attn_base, key_dim)
            setattr(module, name, fn)
            register_model(fn)


_register_all()
