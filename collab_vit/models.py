"""timm registrations: collaborative DeiTs (paper section 4, vision) and the reduced-key-dim concatenate baselines.

``import collab_vit`` registers every model here with timm, one ``@register_model`` function per variant as in
timm's ``deit.py``:

* ``collab_deit_{tiny,small,base}_patch16_224`` -- keywords ``key_dim`` (default: the embed dim; an int, or one per
  block) and ``mixing_init`` (``"concatenate"`` or ``"random"``);
* ``collab_deit_{size}_patch16_224_k{N}`` -- the paper's grid, key dim fixed by the name;
* ``concat_deit_{size}_patch16_224`` (keyword ``key_dim``) and ``concat_deit_{size}_patch16_224_k{N}`` -- standard
  attention with each head's key/query dim cut to ``key_dim / heads``;
* ``collab_vit_converted`` -- a timm model converted to collaborative attention, as its file or folder records it
  (``conversion/files/record.py``): the source's timm name (``source_model``) and keyword arguments, and per converted
  layer its collaborative class and key dim (``collaborative_layers``); what ``collab_vit.save_pretrained`` and
  ``collab-vit convert`` name for a converted model that is not a timm DeiT; with no record (timm's sweeps over
  every registered name), timm's ViT-B/16 with every attention layer collaborative at full rank;
* ``collab_vit_generic`` -- any timm ViT design (the keyword arguments of timm's ``VisionTransformer``) with
  collaborative or cut attention, ``key_dim`` an int or one per block (what version 0.2 saved converted models as;
  its folders still load).

All are :class:`CollabVisionTransformer` (timm's ``VisionTransformer`` whose ``no_weight_decay()`` also names the
mixing matrices, so that timm's ``create_optimizer_v2`` -- with or without ``layer_decay`` -- keeps them out of
weight decay). With ``pretrained=True`` the ``.fb_in1k`` tags (every ``collab_deit_*`` name, the paper's grid too)
load timm's DeiT weights and convert them on load (``conversion_options``); a file written by this package
(``pretrained_cfg_overlay=dict(file=...)``) supplies the architecture it records (key dims, sizes, classes, channels)
and its evaluation pipeline unless the call overrides them.

Evaluation crop (``crop_pct``): a model holding timm's DeiT weights (``pretrained=True`` on a ``.fb_in1k`` tag) has
the evaluation pipeline of timm's own cfg for those weights (``crop_pct`` 0.9, read from timm's registry), so a
conversion is scored exactly as its source; a model built without them (trained from scratch by ``train.py``, which
follows DeiT's recipe) has DeiT's 0.875 (resize 256, centre crop 224), the paper's and ``train.py``'s evaluation.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional, Sequence, Type, Union

import timm
import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import Attention, AttentionRope, GluMlp, Mlp, SwiGLU, get_norm_layer
from timm.models import build_model_with_cfg, generate_default_cfgs, get_pretrained_cfg, register_model

from .conversion.files.pretrained import collab_filter_fn, conversion, converted_file_kwargs
from .conversion.files.record import COLLABORATIVE_NAMES, CONVERTED_MODEL, LAYERS, SOURCE, swap_layers
from .checks import positive_ints
from .layers.attention import CollaborativeAttention, ConcatAttention, attention_class, per_block_attention_class
from .layers.weight_decay import CollabVisionTransformer
from .weights_io import EVAL_KEYS, safetensors_metadata

# DeiT sizes (Touvron et al. 2021), patch 16 at 224 px.
DEIT_ARCHS: dict[str, dict[str, int]] = {
    "tiny": dict(patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "small": dict(patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "base": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12),
}
# The paper's key-dim grid: full, 1/2 and 1/4 of the embed dim (collaborative); the reduced ones for the baseline.
KEY_DIM_GRID: dict[str, tuple[int, ...]] = {"tiny": (192, 96, 48), "small": (384, 192, 96), "base": (768, 384, 192)}
EVAL_CROP_PCT = 0.875  # DeiT's evaluation (resize 256, centre crop 224): the trainer's and eval.py's default too
GENERIC_MODEL = "collab_vit_generic"
ATTENTIONS: dict[str, Type[nn.Module]] = {"collaborative": CollaborativeAttention, "concatenate": ConcatAttention}
MLP_LAYERS: dict[str, Any] = {"mlp": Mlp, "swiglu": SwiGLU, "swiglu_packed": partial(GluMlp, gate_last=False)}


def model_cfg(**kwargs: Any) -> dict[str, Any]:
    """Default cfg as timm's DeiT (input 224, bicubic, ImageNet mean/std), evaluated at DeiT's crop 0.875."""
    return {
        "url": "", "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": None,
        "crop_pct": EVAL_CROP_PCT, "interpolation": "bicubic", "fixed_input_size": True,
        "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj", "classifier": "head", "license": "apache-2.0",
        **kwargs,
    }


@dataclass(frozen=True)
class ModelName:
    """The name scheme of the DeiT family: ``[{family}_]deit_{size}_patch16_224[_k{key_dim}]``, built and parsed here
    only. ``family``: ``""`` (timm's DeiT), ``"collab"`` or ``"concat"``; ``key_dim``: fixed by the name, or None."""

    size: str
    family: str = "collab"
    key_dim: Optional[int] = None

    PATTERN = re.compile(r"^(?:(collab|concat)_)?deit_(tiny|small|base)_patch16_224(?:_k(\d+))?$")

    def __str__(self) -> str:
        prefix = f"{self.family}_" if self.family else ""
        return f"{prefix}deit_{self.size}_patch16_224" + ("" if self.key_dim is None else f"_k{self.key_dim}")

    @classmethod
    def parse(cls, name: str) -> Optional["ModelName"]:
        """The parts of ``name``, or None for a name outside the scheme."""
        match = cls.PATTERN.match(name)
        if match is None:
            return None
        family, size, key_dim = match.groups()
        return cls(size, family or "", None if key_dim is None else int(key_dim))


def model_name(size: str, family: str = "collab", key_dim: Optional[int] = None) -> str:
    """``collab_deit_{size}_patch16_224`` (``family``, ``_k{key_dim}``: see :class:`ModelName`)."""
    return str(ModelName(size, family, key_dim))


def rope_name(size: str, variant: str, key_dim: Optional[int] = None) -> str:
    """``collab_vit_{size}_patch16_{variant}_224`` (timm's ``vit_...`` name, collaborative), ``_k{N}`` on the grid:
    the rotary family's names (``models_rope.py``), built here with the DeiT family's."""
    return f"collab_vit_{size}_patch16_{variant}_224" + ("" if key_dim is None else f"_k{key_dim}")


def deit_eval_cfg(size: str) -> dict[str, Any]:
    """The evaluation pipeline of timm's own cfg for its DeiT weights (``deit_{size}_patch16_224.fb_in1k``)."""
    source = get_pretrained_cfg(f"{model_name(size, '')}.fb_in1k").to_dict()
    return {key: source[key] for key in EVAL_KEYS}


DEIT_MODELS: list[str] = [model_name(s, "") for s in DEIT_ARCHS]  # timm's, the baselines
COLLAB_MODELS: list[str] = [model_name(s) for s in DEIT_ARCHS] + [
    model_name(s, "collab", k) for s, grid in KEY_DIM_GRID.items() for k in grid]
CONCAT_MODELS: list[str] = [model_name(s, "concat") for s in DEIT_ARCHS] + [
    model_name(s, "concat", k) for s, grid in KEY_DIM_GRID.items() for k in grid[1:]]
# a conversion of timm's DeiT is recorded as the registered collaborative DeiT (conversion/files/record.py)
COLLABORATIVE_NAMES.update({model_name(s, ""): model_name(s) for s in DEIT_ARCHS})

DEFAULT_SOURCE = "vit_base_patch16_224"  # what collab_vit_converted converts when no record names a source


def _source_cfg(source: str) -> dict[str, Any]:
    """The source's pretrained cfg (its evaluation pipeline and input size) without its weights' locations."""
    cfg = get_pretrained_cfg(source)
    cfg = {} if cfg is None else cfg.to_dict()
    for key in ("url", "hf_hub_id", "hf_hub_filename", "file", "state_dict", "source", "tag"):
        cfg.pop(key, None)
    return {**cfg, "architecture": CONVERTED_MODEL}


# timm's DeiT ImageNet-1k weights, converted on load (collab_vit.conversion.files.pretrained); key dim from the keyword.
DEIT_WEIGHTS = {size: dict(hf_hub_id=f"timm/{model_name(size, '')}.fb_in1k",
                           url=f"https://dl.fbaipublicfiles.com/deit/{model_name(size, '')}-{sha}.pth")
                for size, sha in (("tiny", "a1311bcf"), ("small", "cd65a155"), ("base", "b5f2ef4d"))}
default_cfgs = generate_default_cfgs({
    **{f"{name}.fb_in1k": model_cfg(**DEIT_WEIGHTS[size], **deit_eval_cfg(size))
       for name in COLLAB_MODELS for size in [ModelName.parse(name).size]},
    **{name: model_cfg() for name in CONCAT_MODELS + [GENERIC_MODEL]},
    CONVERTED_MODEL: {k: v for k, v in _source_cfg(DEFAULT_SOURCE).items() if k != "architecture"},  # the default build
})
OWN_MODELS: list[str] = COLLAB_MODELS + CONCAT_MODELS + [GENERIC_MODEL, CONVERTED_MODEL]


def layer_key_dim(layer: nn.Module) -> int:
    """An attention layer's key/query dim: ``key_dim`` of ours, timm's ``attn_dim`` (heads x head dim); 0 for
    a module that has neither."""
    return int(getattr(layer, "key_dim", 0) or getattr(layer, "attn_dim", 0))


def query_key_params(layer: nn.Module) -> int:
    """Parameters that form the attention logits: q/k projections (+ mixing and content bias when collaborative)."""
    if isinstance(layer, CollaborativeAttention):
        parts = [layer.query, layer.key, layer.content_bias]
        return sum(p.numel() for part in parts if part is not None for p in part.parameters()) + layer.mixing.numel()
    if isinstance(layer, ConcatAttention):
        rows = 2 * layer.key_dim
    elif isinstance(layer, (Attention, AttentionRope)):  # fused qkv (timm's RoPE-ViTs fuse it)
        rows = 2 * layer.attn_dim
    else:
        raise TypeError(f"not an attention layer: {type(layer).__name__}")
    bias = layer.qkv.bias is not None
    return rows * (layer.qkv.in_features + bias)


def file_architecture(kwargs: dict[str, Any]) -> None:
    """With ``pretrained_cfg_overlay=dict(file=F)`` of a file this package wrote, default the keyword arguments to
    the architecture it records, and tell timm the file's classes and channels (so it keeps the head as saved)."""
    overlay = dict(kwargs.get("pretrained_cfg_overlay") or {})
    recorded = converted_file_kwargs(overlay.get("file"))
    if not recorded:
        return
    for key, value in recorded.items():
        kwargs.setdefault(key, value)
    overlay.setdefault("num_classes", recorded.get("num_classes", 1000))
    size = recorded.get("img_size", 224)
    size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)  # collab_vit_generic records [H, W]
    overlay.setdefault("input_size", (recorded.get("in_chans", 3), *size))
    pipeline = safetensors_metadata(overlay["file"]).get("data_config") or {}  # the source's evaluation
    for key in EVAL_KEYS:
        if key in pipeline:
            overlay.setdefault(key, tuple(pipeline[key]) if isinstance(pipeline[key], list) else pipeline[key])
    kwargs["pretrained_cfg_overlay"] = overlay


def _create(
        variant: str,
        attn_base: Type[nn.Module],
        pretrained: bool = False,
        fixed_key_dim: Optional[int] = None,
        **kwargs: Any,
) -> CollabVisionTransformer:
    """Build a DeiT-style ViT whose blocks use ``attn_base`` with ``key_dim`` (one, or one per block).

    ``kwargs`` are timm's ``VisionTransformer`` arguments plus ``key_dim``, ``mixing_init`` (collaborative only),
    ``conversion_options`` (how ``pretrained`` standard-attention weights are converted by the Tucker fit of section 3.3:
    ``max_iter``, ``tol``, ``dtype``).
    """
    file_read = kwargs.pop("file_read", False)  # collab_vit_generic read the file's keywords itself
    if pretrained:
        if not file_read:
            file_architecture(kwargs)
    elif kwargs.get("pretrained_cfg") is None:  # not timm's DeiT weights: DeiT's own evaluation (module docstring)
        kwargs["pretrained_cfg_overlay"] = {"crop_pct": EVAL_CROP_PCT, **(kwargs.get("pretrained_cfg_overlay") or {})}
    key_dim: Union[None, int, Sequence[int]] = kwargs.pop("key_dim", fixed_key_dim)
    if fixed_key_dim is not None and key_dim != fixed_key_dim:
        parts = ModelName.parse(variant)
        raise ValueError(f"{variant} fixes key_dim={fixed_key_dim}; use {model_name(parts.size, parts.family)} for "
                         f"key_dim={key_dim}")
    options = kwargs.pop("conversion_options", None) or {}
    mixing_init = kwargs.pop("mixing_init", "concatenate") if attn_base is CollaborativeAttention else None
    dims = kwargs.get("embed_dim", 768) if key_dim is None else positive_ints(
        key_dim, "key_dim", "a positive integer or a list of them (one per block)")
    if isinstance(dims, list):
        attn_layer = per_block_attention_class(attn_base, tuple(dims), mixing_init)
    else:
        attn_layer = attention_class(attn_base, dims, mixing_init)
    out_indices = kwargs.pop("out_indices", 3)
    with conversion(**options):
        model = build_model_with_cfg(
            CollabVisionTransformer, variant, pretrained,
            pretrained_filter_fn=collab_filter_fn,
            feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
            attn_layer=attn_layer, qkv_bias=kwargs.pop("qkv_bias", True),
            **kwargs,
        )
    if isinstance(key_dim, (list, tuple)) and attn_layer.remaining():
        raise ValueError(f"key_dim list has {len(key_dim)} entries but the model has {kwargs.get('depth', 12)} blocks")
    return model


def _collab(variant: str, size: str, pretrained: bool, key_dim: Optional[int], kwargs: dict) -> CollabVisionTransformer:
    return _create(variant, CollaborativeAttention, pretrained, key_dim, **dict(DEIT_ARCHS[size], **kwargs))


def _concat(variant: str, size: str, pretrained: bool, key_dim: Optional[int], kwargs: dict) -> CollabVisionTransformer:
    return _create(variant, ConcatAttention, pretrained, key_dim, **dict(DEIT_ARCHS[size], **kwargs))


@register_model
def collab_deit_tiny_patch16_224(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """Collaborative DeiT-Ti/16 (embed 192, 3 heads); ``key_dim`` keyword, default 192."""
    return _collab("collab_deit_tiny_patch16_224", "tiny", pretrained, None, kwargs)


@register_model
def collab_deit_small_patch16_224(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """Collaborative DeiT-S/16 (embed 384, 6 heads); ``key_dim`` keyword, default 384."""
    return _collab("collab_deit_small_patch16_224", "small", pretrained, None, kwargs)


@register_model
def collab_deit_base_patch16_224(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """Collaborative DeiT-B/16 (embed 768, 12 heads); ``key_dim`` keyword, default 768."""
    return _collab("collab_deit_base_patch16_224", "base", pretrained, None, kwargs)


@register_model
def collab_deit_tiny_patch16_224_k192(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """Collaborative DeiT-Ti/16, shared key/query dim 192."""
    return _collab("collab_deit_tiny_patch16_224_k192", "tiny", pretrained, 192, kwargs)


@register_model
def collab_deit_tiny_patch16_224_k96(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """Collaborative DeiT-Ti/16, shared key/query dim 96."""
    return _collab("collab_deit_tiny_patch16_224_k96", "tiny", pretrained, 96, kwargs)


@register_model
def collab_deit_tiny_patch16_224_k48(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """Collaborative DeiT-Ti/16, shared key/query dim 48."""
    return _collab("collab_deit_tiny_patch16_224_k48", "tiny", pretrained, 48, kwargs)


@register_model
def collab_deit_small_patch16_224_k384(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """Collaborative DeiT-S/16, shared key/query dim 384."""
    return _collab("collab_deit_small_patch16_224_k384", "small", pretrained, 384, kwargs)


@register_model
def collab_deit_small_patch16_224_k192(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """Collaborative DeiT-S/16, shared key/query dim 192."""
    return _collab("collab_deit_small_patch16_224_k192", "small", pretrained, 192, kwargs)


@register_model
def collab_deit_small_patch16_224_k96(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """Collaborative DeiT-S/16, shared key/query dim 96."""
    return _collab("collab_deit_small_patch16_224_k96", "small", pretrained, 96, kwargs)


@register_model
def collab_deit_base_patch16_224_k768(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """Collaborative DeiT-B/16, shared key/query dim 768 (the paper's Table 2)."""
    return _collab("collab_deit_base_patch16_224_k768", "base", pretrained, 768, kwargs)


@register_model
def collab_deit_base_patch16_224_k384(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """Collaborative DeiT-B/16, shared key/query dim 384 (the paper's Table 2)."""
    return _collab("collab_deit_base_patch16_224_k384", "base", pretrained, 384, kwargs)


@register_model
def collab_deit_base_patch16_224_k192(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """Collaborative DeiT-B/16, shared key/query dim 192 (the paper's Table 2)."""
    return _collab("collab_deit_base_patch16_224_k192", "base", pretrained, 192, kwargs)


@register_model
def concat_deit_tiny_patch16_224(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """DeiT-Ti/16 with standard attention cut to ``key_dim`` in all (``key_dim / 3`` per head); default 192."""
    return _concat("concat_deit_tiny_patch16_224", "tiny", pretrained, None, kwargs)


@register_model
def concat_deit_small_patch16_224(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """DeiT-S/16 with standard attention cut to ``key_dim`` in all (``key_dim / 6`` per head); default 384."""
    return _concat("concat_deit_small_patch16_224", "small", pretrained, None, kwargs)


@register_model
def concat_deit_base_patch16_224(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """DeiT-B/16 with standard attention cut to ``key_dim`` in all (``key_dim / 12`` per head); default 768."""
    return _concat("concat_deit_base_patch16_224", "base", pretrained, None, kwargs)


@register_model
def concat_deit_tiny_patch16_224_k96(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """DeiT-Ti/16, standard attention with key/query dim 96 (32 per head)."""
    return _concat("concat_deit_tiny_patch16_224_k96", "tiny", pretrained, 96, kwargs)


@register_model
def concat_deit_tiny_patch16_224_k48(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """DeiT-Ti/16, standard attention with key/query dim 48 (16 per head)."""
    return _concat("concat_deit_tiny_patch16_224_k48", "tiny", pretrained, 48, kwargs)


@register_model
def concat_deit_small_patch16_224_k192(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """DeiT-S/16, standard attention with key/query dim 192 (32 per head)."""
    return _concat("concat_deit_small_patch16_224_k192", "small", pretrained, 192, kwargs)


@register_model
def concat_deit_small_patch16_224_k96(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """DeiT-S/16, standard attention with key/query dim 96 (16 per head)."""
    return _concat("concat_deit_small_patch16_224_k96", "small", pretrained, 96, kwargs)


@register_model
def concat_deit_base_patch16_224_k384(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """DeiT-B/16, standard attention with key/query dim 384 (32 per head), the paper's baseline."""
    return _concat("concat_deit_base_patch16_224_k384", "base", pretrained, 384, kwargs)


@register_model
def concat_deit_base_patch16_224_k192(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """DeiT-B/16, standard attention with key/query dim 192 (16 per head), the paper's baseline."""
    return _concat("concat_deit_base_patch16_224_k192", "base", pretrained, 192, kwargs)


@register_model
def collab_vit_generic(pretrained: bool = False, **kwargs) -> CollabVisionTransformer:
    """Any timm ``VisionTransformer`` design with collaborative (or cut) attention (how version 0.2 saved converted
    models: its folders and files still load).

    Keywords: timm's ``VisionTransformer`` arguments (defaults: ViT-B/16), with ``norm_layer`` / ``act_layer`` by
    timm's names (``"layernorm"``, ``"gelu_tanh"``, ...), ``norm_eps``, ``mlp_layer`` (``"mlp"``, ``"swiglu"``,
    ``"swiglu_packed"``), plus ``key_dim`` (an int, or one per block) and ``attention`` (``"collaborative"`` or
    ``"concatenate"``).
    """
    if pretrained:
        file_architecture(kwargs)  # a converted file's recorded keywords, before the generic ones are read
    attention = kwargs.pop("attention", "collaborative")
    mlp_layer = kwargs.pop("mlp_layer", "mlp")
    if attention not in ATTENTIONS or mlp_layer not in MLP_LAYERS:
        raise ValueError(f"attention must be one of {tuple(ATTENTIONS)} and mlp_layer one of {tuple(MLP_LAYERS)}, "
                         f"got {attention!r}, {mlp_layer!r}")
    norm_eps = kwargs.pop("norm_eps", None)
    if norm_eps is not None:
        kwargs["norm_layer"] = partial(get_norm_layer(kwargs.get("norm_layer") or "layernorm"), eps=norm_eps)
    return _create(GENERIC_MODEL, ATTENTIONS[attention], pretrained, mlp_layer=MLP_LAYERS[mlp_layer],
                   file_read=pretrained, **kwargs)


def _converted_source(source: str, layers: Optional[dict[str, dict[str, Any]]], **kwargs: Any) -> nn.Module:
    return swap_layers(timm.create_model(source, **kwargs), layers)


@register_model
def collab_vit_converted(pretrained: bool = False, **kwargs) -> nn.Module:
    """A timm model converted to collaborative attention, rebuilt from what its file or folder records.

    Keywords: ``source_model`` (the source's timm name), ``collaborative_layers`` (``{layer name: {"layer":
    collaborative class, "key_dim": k}}``) and the source's own keyword arguments. The source's architecture is
    created without its weights, its attention layers are swapped for collaborative ones of the recorded key dims
    (``conversion/files/record.py``), then ``pretrained`` weights (a ``local-dir:`` / ``hf-hub:`` folder, or a converted
    file given as ``pretrained_cfg_overlay=dict(file=...)``) are loaded. Without a record, as timm's model sweeps
    call it: ``source_model`` defaults to timm's ViT-B/16 (``vit_base_patch16_224``) and ``collaborative_layers``
    to every attention layer of the source at its full rank (randomly initialised, as any model without weights).
    """
    if pretrained:
        file_architecture(kwargs)  # a converted file's recorded keywords
    source, layers = kwargs.pop(SOURCE, DEFAULT_SOURCE), kwargs.pop(LAYERS, None)
    if not isinstance(source, str) or ":" in source or source in OWN_MODELS or not timm.is_model(source) or \
            not isinstance(layers, (dict, type(None))):
        raise ValueError(f"{CONVERTED_MODEL} needs {SOURCE} (a timm model name, got {source!r}) and {LAYERS} (one "
                         f"entry per converted layer), as a converted file or folder records them")
    kwargs["pretrained_cfg"] = kwargs.get("pretrained_cfg") or _source_cfg(source)
    return build_model_with_cfg(partial(_converted_source, source, layers), CONVERTED_MODEL, pretrained,
                                feature_cfg=dict(out_indices=kwargs.pop("out_indices", 3), feature_cls="getter"),
                                **kwargs)
