"""Parameter counts of the registered models (README table) and the full-rank conversion check (the demo)."""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import timm
import torch
import torch.nn as nn
from timm.layers import Attention

from .attention import CollaborativeAttention, ConcatAttention
from .models import COLLAB_MODELS, CONCAT_MODELS, DEIT_ARCHS
from .reparam import reparametrize


@dataclass
class ModelRow:
    name: str
    key_dim: int
    params: int
    qk_params: int


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


def model_row(name: str) -> ModelRow:
    """Count parameters on the meta device (no memory, no init cost)."""
    model = timm.create_model(name, device="meta")
    layers = [block.attn for block in model.blocks]
    key_dim = getattr(layers[0], "key_dim", getattr(layers[0], "attn_dim", 0))
    return ModelRow(name, key_dim, sum(p.numel() for p in model.parameters()), sum(map(query_key_params, layers)))


def model_table() -> list[ModelRow]:
    """timm's DeiT baselines, then every registered collaborative and concatenate model."""
    names = [f"deit_{size}_patch16_224" for size in DEIT_ARCHS] + COLLAB_MODELS + CONCAT_MODELS
    return [model_row(name) for name in names]


def format_table(rows: list[ModelRow]) -> str:
    lines = ["| model | key dim | params (M) | attention q/k params (M) |", "|---|---:|---:|---:|"]
    lines += [f"| `{r.name}` | {r.key_dim} | {r.params / 1e6:.2f} | {r.qk_params / 1e6:.2f} |" for r in rows]
    return "\n".join(lines)


@dataclass
class ConversionCheck:
    name: str
    max_abs_diff: float
    max_abs_logit: float
    seconds: float


def check_full_rank_conversion(name: str, batch: int = 2, seed: int = 0) -> ConversionCheck:
    """Convert a randomly initialised timm model at full rank and compare logits (DESIGN.md section 1)."""
    torch.manual_seed(seed)
    reference = timm.create_model(name).eval()
    with torch.no_grad():
        for param_name, param in reference.named_parameters():
            if param_name.endswith("qkv.bias"):
                param.normal_(0, 0.2)  # non-zero query biases exercise the content bias
    start = time.perf_counter()
    converted = reparametrize(copy.deepcopy(reference))
    seconds = time.perf_counter() - start
    x = torch.randn(batch, *reference.default_cfg["input_size"])
    with torch.no_grad():
        expected, actual = reference(x), converted(x)
    return ConversionCheck(name, (expected - actual).abs().max().item(), expected.abs().max().item(), seconds)
