"""Collaborative models in timm's own hub format: ``save_pretrained`` writes a folder timm loads by itself.

``save_pretrained(model, DIR)`` writes, through timm's ``save_for_hf``, ``DIR/config.json`` (``architecture``: a
registered entry point; ``model_args``: every keyword it needs, the per-layer key dims included; ``pretrained_cfg``:
the evaluation pipeline the model carries, i.e. its source's) and ``DIR/model.safetensors``. After
``import collab_vit``, ``timm.create_model("local-dir:DIR", pretrained=True)`` rebuilds the model with identical
outputs; ``push_to_hf_hub(model, "USER/REPO")`` publishes the same files through timm's ``push_to_hf_hub``, and
``hf-hub:USER/REPO`` loads them back.

The architecture: the model's own registered name (``collab_deit_*``, ``concat_deit_*``, ``collab_vit_generic``),
else ``collab_deit_{size}_patch16_224`` for a converted timm DeiT, else ``collab_vit_generic`` (any timm
``VisionTransformer`` design). Before anything is written the model is rebuilt from that description and must give
bit-identical outputs on a probe input; a design the description does not cover is refused with one line.
"""
from __future__ import annotations

import copy
import inspect
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import timm
import torch
import torch.nn as nn
from timm.layers import GluMlp, LayerScale, Mlp, SwiGLU
from timm.models import VisionTransformer, push_to_hf_hub as timm_push_to_hf_hub, save_for_hf

from .conversion.support import hub_design_problem
from .layers.attention import CollaborativeAttention, ConcatAttention
from .models import COLLAB_MODELS, CONCAT_MODELS, GENERIC_MODEL
from .weights_io import EVAL_KEYS, HUB_CONFIG, HUB_WEIGHTS

DEIT_SOURCE = re.compile(r"^deit_(tiny|small|base)_patch16_224$")
ACTIVATIONS = {nn.GELU: "gelu", nn.SiLU: "silu", nn.ReLU: "relu", nn.Tanh: "tanh"}
ALWAYS = ("img_size", "patch_size", "in_chans", "num_classes", "embed_dim", "depth", "num_heads", "key_dim")
GENERIC_ONLY = ("norm_layer", "norm_eps", "mlp_layer")  # collab_vit_generic's own keywords (names for classes)


def _vit_defaults() -> dict[str, Any]:
    """timm's ``VisionTransformer`` keyword defaults in the installed version (an argument left at its default is
    not recorded, so a folder also loads with timm versions that lack a newer keyword)."""
    parameters = inspect.signature(VisionTransformer.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def _identity(module: nn.Module) -> bool:
    return isinstance(module, nn.Identity)


def _activation(act: nn.Module) -> str:
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    if type(act).__name__ == "QuickGELU":
        return "quick_gelu"
    for cls, name in ACTIVATIONS.items():
        if type(act) is cls:
            return name
    raise ValueError(f"save_pretrained: activation {type(act).__name__} has no timm name it can record")


def _mlp(mlp: nn.Module, dim: int) -> tuple[str, float, str]:
    """``mlp_layer`` name, ``mlp_ratio`` and activation name of a block's MLP."""
    if type(mlp) is Mlp:
        return "mlp", mlp.fc1.out_features / dim, _activation(mlp.act)
    if type(mlp) is SwiGLU:
        return "swiglu", mlp.fc1_g.out_features / dim, _activation(mlp.act)
    if type(mlp) is GluMlp and not mlp.gate_last:
        return "swiglu_packed", mlp.fc1.out_features / 2 / dim, _activation(mlp.act)
    raise ValueError(f"save_pretrained: MLP {type(mlp).__name__} is not one collab_vit_generic can rebuild")


def _norm(model: VisionTransformer) -> tuple[str, float]:
    norm = model.blocks[0].norm1
    name = {"LayerNorm": "layernorm", "RmsNorm": "rmsnorm"}.get(type(norm).__name__)
    if name is None:
        raise ValueError(f"save_pretrained: norm {type(norm).__name__} is not one collab_vit_generic can rebuild")
    return name, float(norm.eps)


def describe(model: nn.Module) -> tuple[str, dict[str, Any]]:
    """The registered entry point and keyword arguments that rebuild ``model`` (see the module docstring)."""
    problem = hub_design_problem(model)
    if problem is not None:
        raise ValueError(problem if problem.startswith("save_pretrained") else f"save_pretrained: {problem}")
    layers = [block.attn for block in model.blocks]
    kinds = {type(layer) for layer in layers}
    if not all(isinstance(layer, (CollaborativeAttention, ConcatAttention)) for layer in layers) or (
            any(isinstance(layer, CollaborativeAttention) for layer in layers)
            and any(isinstance(layer, ConcatAttention) for layer in layers)):
        raise ValueError(f"save_pretrained needs every block's attention collaborative (or every one cut), got "
                         f"{sorted(k.__name__ for k in kinds)}")
    first, block = layers[0], model.blocks[0]
    key_dims = [layer.key_dim for layer in layers]
    mlp_layer, mlp_ratio, act = _mlp(block.mlp, model.embed_dim)
    norm_layer, norm_eps = _norm(model)
    bias = first.value.bias if isinstance(first, CollaborativeAttention) else first.qkv.bias
    has_fc_norm, has_norm = not _identity(model.fc_norm), not _identity(model.norm)
    args: dict[str, Any] = dict(
        img_size=list(model.patch_embed.img_size), patch_size=list(model.patch_embed.patch_size),
        in_chans=model.patch_embed.proj.in_channels, num_classes=model.num_classes, global_pool=model.global_pool,
        embed_dim=model.embed_dim, depth=len(model.blocks), num_heads=first.num_heads, mlp_ratio=mlp_ratio,
        qkv_bias=bias is not None, qk_norm=not _identity(first.q_norm), scale_attn_norm=not _identity(first.norm),
        scale_mlp_norm=not _identity(getattr(block.mlp, "norm", nn.Identity())), proj_bias=first.proj.bias is not None,
        init_values=1e-5 if isinstance(block.ls1, LayerScale) else None,  # the value only initialises (weights load)
        class_token=model.cls_token is not None, pos_embed="learn" if model.pos_embed is not None else "none",
        no_embed_class=model.no_embed_class, reg_tokens=model.num_reg_tokens, pre_norm=not _identity(model.norm_pre),
        final_norm=has_fc_norm or has_norm, fc_norm=has_fc_norm,
        pool_include_prefix=getattr(model, "pool_include_prefix", False), dynamic_img_size=model.dynamic_img_size,
        dynamic_img_pad=getattr(model.patch_embed, "dynamic_img_pad", False),
        norm_layer=norm_layer, norm_eps=norm_eps, act_layer=act, mlp_layer=mlp_layer,
        key_dim=key_dims[0] if len(set(key_dims)) == 1 else key_dims,
    )
    defaults = {**_vit_defaults(), "norm_layer": "layernorm", "norm_eps": 1e-6, "act_layer": "gelu", "mlp_layer": "mlp"}
    defaults["global_pool"], defaults["pos_embed"] = "token", "learn"
    for key in ("pool_include_prefix", "scale_attn_norm", "scale_mlp_norm", "dynamic_img_pad"):
        defaults.setdefault(key, False)  # keywords newer than some timm versions: recorded only when used
    args = {k: v for k, v in args.items() if k in ALWAYS or k not in defaults or v != defaults[k]}
    name = (getattr(model, "pretrained_cfg", None) or {}).get("architecture", "")
    collaborative = isinstance(first, CollaborativeAttention)
    source = DEIT_SOURCE.match(name)
    if source and collaborative:
        name = f"collab_deit_{source.group(1)}_patch16_224"
    if name in COLLAB_MODELS + CONCAT_MODELS and collaborative == (name in COLLAB_MODELS) and not any(
            k in args for k in GENERIC_ONLY):
        return name, args
    return GENERIC_MODEL, {**args, "attention": "collaborative" if collaborative else "concatenate"}


def _rebuilt_matches(model: nn.Module, name: str, args: dict[str, Any]) -> Optional[str]:
    """Why the model rebuilt from ``name(**args)`` with ``model``'s weights is not ``model`` (None when it is)."""
    source = copy.deepcopy(model).float().cpu().eval()
    try:
        rebuilt = timm.create_model(name, **args).eval()
    except (TypeError, ValueError, KeyError, AssertionError, RuntimeError) as e:
        return f"{name} does not take the recorded arguments ({str(e).strip().splitlines()[0]})"
    own, recorded = source.state_dict(), rebuilt.state_dict()
    wrong = [k for k in own.keys() | recorded.keys() if k not in own or k not in recorded
             or own[k].shape != recorded[k].shape]
    if wrong:
        return f"rebuilt as {name} its weights differ at {sorted(wrong)[:4]}"
    rebuilt.load_state_dict(own)
    for a, b in zip(source.modules(), rebuilt.modules()):  # same kernels: the check is of the architecture
        if hasattr(a, "fused_attn") and hasattr(b, "fused_attn"):
            b.fused_attn = a.fused_attn
    size = args.get("img_size", 224)
    size = size if isinstance(size, (list, tuple)) else (size, size)
    x = torch.randn(2, source.patch_embed.proj.in_channels, *size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if not torch.equal(source(x), rebuilt(x)):
            return f"rebuilt as {name} it computes other outputs"
    return None


def checked_description(model: nn.Module) -> tuple[str, dict[str, Any]]:
    """``describe(model)``, checked: the model rebuilt from it gives bit-identical outputs, else a one-line
    ``ValueError`` (what ``save_pretrained`` and ``collab-vit convert --out X.safetensors`` record)."""
    name, args = describe(model)
    why = _rebuilt_matches(model, name, args)
    if why is not None:
        raise ValueError(f"save_pretrained cannot describe this {type(model).__name__} for timm: {why}")
    return name, args


@contextmanager
def _described(model: nn.Module, data_config: Optional[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Check that ``model`` can be described (else a one-line ValueError), then, for the block, give it the
    ``pretrained_cfg`` timm's ``save_for_hf`` records (architecture ours, the pipeline its source's or
    ``data_config``'s) and no factory arguments of its source; yields the ``model_args``."""
    name, args = checked_description(model)
    cfg = dict(getattr(model, "pretrained_cfg", None) or {})
    cfg.update({k: tuple(v) if isinstance(v, list) else v for k, v in (data_config or {}).items() if k in EVAL_KEYS})
    cfg.update(architecture=name, num_classes=model.num_classes)
    cfg.setdefault("input_size", (args["in_chans"], *args["img_size"]))
    saved = {k: getattr(model, k) for k in ("pretrained_cfg", "_model_args") if k in model.__dict__}
    try:
        model.pretrained_cfg, model._model_args = cfg, {}  # what timm reads: ours only, not the source's kwargs
        yield args
    finally:
        for key in ("pretrained_cfg", "_model_args"):
            if key in saved:
                setattr(model, key, saved[key])
            elif key in model.__dict__:
                delattr(model, key)


def save_pretrained(model: nn.Module, directory: str, data_config: Optional[dict[str, Any]] = None) -> str:
    """Write ``model`` to ``directory`` in timm's hub layout (module docstring); returns the architecture name.

    ``data_config`` (keys of timm's data config: ``input_size``, ``crop_pct``, ``crop_mode``, ``interpolation``,
    ``mean``, ``std``) replaces those of the model's ``pretrained_cfg`` (its source's evaluation). A model the
    description cannot rebuild is a one-line ``ValueError`` and nothing is written. The folder appears whole
    (written beside it, then renamed); files of an existing folder are replaced one by one.
    """
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"save_pretrained: {directory} exists and is not a folder")
    with _described(model, data_config) as args:
        parent = os.path.dirname(os.path.abspath(directory))
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(directory))}.", dir=parent)
        try:
            save_for_hf(model, staging, model_args=args, safe_serialization=True)
            if not os.path.exists(directory):
                os.rename(staging, directory)
            else:
                for file in (HUB_WEIGHTS, HUB_CONFIG):
                    os.replace(os.path.join(staging, file), os.path.join(directory, file))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return model.pretrained_cfg["architecture"]


def push_to_hf_hub(model: nn.Module, repo_id: str, data_config: Optional[dict[str, Any]] = None,
                   **kwargs: Any) -> Any:
    """timm's ``push_to_hf_hub`` of the files ``save_pretrained`` writes (same check, same ``config.json``, only
    ``model.safetensors`` unless ``safe_serialization`` says otherwise); ``kwargs`` go to timm's function
    (``token``, ``private``, ``commit_message``, ``model_card``, ...)."""
    with _described(model, data_config) as args:
        kwargs.setdefault("safe_serialization", True)
        return timm_push_to_hf_hub(model, repo_id, model_args=args, **kwargs)
