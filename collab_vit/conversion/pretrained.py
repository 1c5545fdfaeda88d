"""Pretrained weights for collaborative models: converted files and timm's DeiT weights converted on load.

``timm.create_model("collab_deit_base_patch16_224", pretrained=True, key_dim=384)`` fetches timm's DeiT-B weights
exactly as timm does, then ``collab_filter_fn`` re-parametrises each attention layer (section 3.3) and caches the
result under ``<torch hub dir>/checkpoints/collab_vit/``, keyed by the source weights, method and key dims.
A file written by ``collab-vit convert`` already holds collaborative weights and its key dims in its metadata.
"""
from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from timm.layers import Attention
from timm.models.vision_transformer import checkpoint_filter_fn

from ..layers.attention import CollaborativeAttention
from ..weights_io import atomic_write
from .reparam import METHODS, collaborative_layer

_conversion_method: ContextVar[str] = ContextVar("collab_vit_conversion_method", default="tucker")


@contextmanager
def conversion(method: str) -> Iterator[None]:
    """Use ``method`` ("tucker" or "cp") when ``collab_filter_fn`` converts standard weights in this block."""
    if method not in METHODS:
        raise ValueError(f"conversion_method must be one of {tuple(METHODS)}, got {method!r}")
    token = _conversion_method.set(method)
    try:
        yield
    finally:
        _conversion_method.reset(token)


def converted_file_kwargs(path: Optional[str]) -> dict[str, Any]:
    """``model_kwargs`` recorded in a converted ``.safetensors`` file's metadata ({} for any other file)."""
    if not path or not str(path).endswith(".safetensors") or not os.path.isfile(path):
        return {}
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    return json.loads(metadata.get("model_kwargs", "{}"))


def cache_dir() -> Path:
    return Path(torch.hub.get_dir()) / "checkpoints" / "collab_vit"


def _cache_path(state_dict: dict[str, torch.Tensor], method: str, key_dims: list[int]) -> Path:
    digest = hashlib.sha256()
    for key in sorted(k for k in state_dict if k.endswith("attn.qkv.weight")):
        digest.update(key.encode())
        digest.update(state_dict[key].float().contiguous().numpy().tobytes())
    digest.update(json.dumps([method, key_dims]).encode())
    return cache_dir() / f"{digest.hexdigest()[:24]}_{method}.safetensors"


def convert_attention_state(state_dict: dict[str, torch.Tensor], model: nn.Module, method: str) -> dict[str, Any]:
    """Replace every standard ``blocks.N.attn.*`` entry by the collaborative layer at the model's key dims."""
    converted = dict(state_dict)
    for index, block in enumerate(model.blocks):
        target = block.attn
        prefix = f"blocks.{index}.attn."
        if not isinstance(target, CollaborativeAttention) or prefix + "qkv.weight" not in state_dict:
            continue
        dim = state_dict[prefix + "qkv.weight"].shape[1]
        attn = Attention(dim, target.num_heads, qkv_bias=prefix + "qkv.bias" in state_dict)
        attn.load_state_dict({k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)})
        layer, _ = collaborative_layer(attn, target.key_dim, method)
        for key in [k for k in converted if k.startswith(prefix)]:
            del converted[key]
        converted.update({prefix + k: v for k, v in layer.state_dict().items()})
    return converted


def collab_filter_fn(state_dict: dict[str, Any], model: nn.Module) -> dict[str, torch.Tensor]:
    """timm's ViT checkpoint filter, then (for standard-attention weights) conversion to the model's key dims."""
    state_dict = checkpoint_filter_fn(state_dict, model)
    if not any(k.endswith("attn.qkv.weight") for k in state_dict):
        return state_dict
    method = _conversion_method.get()
    key_dims = [block.attn.key_dim for block in model.blocks]
    cached = _cache_path(state_dict, method, key_dims)
    if cached.is_file():
        attention_part = load_file(str(cached))
        return {k: v for k, v in state_dict.items() if ".attn." not in k} | attention_part
    converted = convert_attention_state(state_dict, model, method)
    attention_part = {k: v.contiguous() for k, v in converted.items() if ".attn." in k}
    cached.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(str(cached), lambda tmp: save_file(attention_part, tmp, metadata={"method": method}))
    return converted
