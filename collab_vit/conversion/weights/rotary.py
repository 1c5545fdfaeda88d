"""Rotary attention (timm's ``AttentionRope``; ``EvaAttention`` in a model with rope) -> collaborative rotary attention
(``layers/rotary.py``): which layers convert, the exact full-rank construction, the swap.

Full rank: shared pair ``r = i dh/2 + p`` is pair ``p`` of head ``i`` (its two dims in the source's layout,
interleaved or half, put in the shared interleaved order), carrying frequency ``p``; head i's mixing is 1 (real) on
its own ``dh/2`` pairs, 0 elsewhere. The query and key biases move into the shared projections, pair by pair: a
rotated bias varies along a softmax row, so neither the content bias nor dropping the key bias is exact under rope
(docs/math.md, "Rotary attention"). Values, scale norm, gate and output projection are copied. Below full rank:
``rotary_fit.py`` (per-frequency compression).

Refused in one line, naming the layer (``support.check_model``): mixed rope (``RotaryEmbeddingMixed`` learns its
frequencies per head), ``qk_norm``, grouped-query attention, head dims other than ``dim / heads``, a rope module not
known to give every head the same frequencies.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.nn as nn
from timm.layers import AttentionRope
from timm.layers.pos_embed_sincos import (RotaryEmbeddingCat, RotaryEmbeddingDinoV3, RotaryEmbeddingMixed,
                                          RotaryEmbeddingMRope)
from torch import Tensor

from ...layers.rotary import CollaborativeAttentionRope, CollaborativeEvaAttention
from ...layers.construction import QK_NORM, full_rank
from .forms import is_eva_attention

SHARED_ROPE = (RotaryEmbeddingCat, RotaryEmbeddingDinoV3, RotaryEmbeddingMRope)  # one rope tensor for all heads
MIXED = ("mixed rope (RotaryEmbeddingMixed) learns its frequencies per head: the heads share no frequency, so no "
         "shared rotary projection")


def is_rotary(module: nn.Module, model: nn.Module) -> bool:
    """Whether ``module`` is a rotary attention layer of ``model``: timm's ``AttentionRope``, or EVA's attention in a
    model with rope."""
    return isinstance(module, AttentionRope) or (is_eva_attention(module) and getattr(model, "rope", None) is not None)


def rotary_reason(module: nn.Module, model: nn.Module) -> Optional[str]:
    """None if ``module`` is no rotary layer of ``model``; "" if it converts; else why not (one line)."""
    if not is_rotary(module, model):
        return None
    rope = getattr(model, "rope", None)
    if isinstance(rope, RotaryEmbeddingMixed) or getattr(model, "rope_mixed", False):
        return MIXED
    if rope is not None and not isinstance(rope, SHARED_ROPE):
        return f"{type(rope).__name__} is not known to give every head the same rope frequencies: not covered"
    if not isinstance(module.q_norm, nn.Identity) or not isinstance(module.k_norm, nn.Identity):
        return QK_NORM
    if getattr(module, "num_kv_groups", 1) != 1:
        return "grouped-query attention (fewer key/value heads than query heads): not covered"
    dim = module.proj.out_features
    if full_rank(module) != dim or projections(module)[0].shape[1] != dim:
        return (f"heads x head dim ({full_rank(module)}) differs from dim ({dim}): not covered "
                f"(collaborative layers keep dim / heads per value head)")
    return ""


def projections(attn: nn.Module) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """``Wq, Wk, Wv`` (each (Nh dh, D)) and the biases ``bq, bk, bv`` (None without ``qkv_bias``; EVA's absent key
    bias as zeros) of a rotary layer, fused or separate q/k/v."""
    if attn.qkv is not None:
        wq, wk, wv = attn.qkv.weight.detach().chunk(3)
        if is_eva_attention(attn):
            biases = None if attn.q_bias is None else (attn.q_bias, attn.k_bias, attn.v_bias)
        else:
            biases = None if attn.qkv.bias is None else attn.qkv.bias.chunk(3)
    else:
        wq, wk, wv = (m.weight.detach() for m in (attn.q_proj, attn.k_proj, attn.v_proj))
        bq, bk = attn.q_proj.bias, attn.k_proj.bias
        biases = None if bq is None else (bq, torch.zeros_like(bq) if bk is None else bk, attn.v_proj.bias)
    if biases is None:
        return wq, wk, wv, None, None, None
    bq, bk, bv = (b.detach() for b in biases)
    return wq, wk, wv, bq, bk, bv


def shared_order(num_heads: int, head_dim: int, half: bool) -> Tensor:
    """The source rows of the shared dims at full rank: shared dims ``(2r, 2r+1)``, ``r = i dh/2 + p``, are pair
    ``p`` of head ``i``, i.e. rows ``i dh + (2p, 2p+1)`` (interleaved) or ``i dh + (p, p + dh/2)`` (half layout)."""
    pairs = torch.arange(head_dim // 2)
    first, second = (pairs, pairs + head_dim // 2) if half else (2 * pairs, 2 * pairs + 1)
    within = torch.stack([first, second], dim=-1).reshape(-1)
    return (torch.arange(num_heads).unsqueeze(1) * head_dim + within).reshape(-1)


def rotary_like(attn: nn.Module, key_dim: int) -> CollaborativeAttentionRope:
    """An untrained collaborative rotary layer of ``key_dim`` shaped as ``attn``: its class (EVA's or timm's
    keywords), biases, prefix tokens, rope layout, dropouts, scale norm and gate (copies), kernel choice, train flag."""
    wq, _, _, bq, _, _ = projections(attn)
    options: dict[str, Any] = {} if is_eva_attention(attn) else {"proj_bias": attn.proj.bias is not None}
    cls = CollaborativeEvaAttention if is_eva_attention(attn) else CollaborativeAttentionRope
    layer = cls(wq.shape[1], attn.num_heads, qkv_bias=bq is not None, num_prefix_tokens=attn.num_prefix_tokens,
                attn_drop=attn.attn_drop.p, proj_drop=attn.proj_drop.p, scale_norm=False,
                rotate_half=bool(getattr(attn, "rotate_half", False)), key_dim=key_dim, device=wq.device,
                dtype=wq.dtype, **options)
    layer.norm = copy.deepcopy(attn.norm)
    layer.gate = copy.deepcopy(attn.gate)
    layer.fused_attn = attn.fused_attn
    return layer.train(attn.training)


def rotary_layer(attn: nn.Module, key_dim: Optional[int] = None) -> CollaborativeAttentionRope:
    """The exact collaborative rotary layer of ``attn`` (module docstring) at ``key_dim >= heads x head dim`` (default:
    equal; extra shared pairs are zero); ``attn`` is unchanged."""
    full = full_rank(attn)
    key_dim = full if key_dim is None else key_dim
    if key_dim < full:
        raise ValueError(f"rotary_layer is the exact construction: key_dim {key_dim} is below the full rank {full} "
                         f"(heads x head dim); compressed layers come from rotary_fit")
    layer = rotary_like(attn, key_dim)
    wq, wk, wv, bq, bk, bv = projections(attn)
    order = shared_order(attn.num_heads, attn.head_dim, bool(getattr(attn, "rotate_half", False))).to(wq.device)
    with torch.no_grad():
        for shared, weight, bias in ((layer.query, wq, bq), (layer.key, wk, bk)):
            shared.weight.zero_()[:full] = weight[order]
            if bias is not None:
                shared.bias.zero_()[:full] = bias[order]
        layer.value.weight.copy_(wv)
        if bv is not None:
            layer.value.bias.copy_(bv)
        layer.mixing.zero_()
        for head in range(attn.num_heads):  # real part 1 on the head's own pairs
            layer.mixing[head, head * attn.head_dim:(head + 1) * attn.head_dim:2] = 1.
        layer.proj.load_state_dict(attn.proj.state_dict())
    return layer


@torch.no_grad()
def layer_calls(model: nn.Module, layers: list[tuple[str, nn.Module]], images: Tensor
                ) -> list[tuple[Tensor, dict[str, Any]]]:
    """The tokens and keywords (``rope``, ``attn_mask``, ...) each layer is called with on ``images`` (eval mode)."""
    calls: list[Optional[tuple[Tensor, dict[str, Any]]]] = [None] * len(layers)

    def hook(index: int):
        def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
            calls[index] = calls[index] or (args[0].detach(), {**kwargs, **dict(zip(("rope", "attn_mask"), args[1:]))})
        return record

    handles = [attn.register_forward_pre_hook(hook(i), with_kwargs=True) for i, (_, attn) in enumerate(layers)]
    was_training = model.training
    try:
        model.eval()(images.to(next(model.parameters()).device))
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return calls


