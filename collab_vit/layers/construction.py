"""Building a collaborative layer from a timm ``Attention``: the one place that does it (paper section 3.3).

``conversion_reason`` says whether a layer has an exact collaborative form, and if not why (the layer's
``from_attention``, the conversion's support check and its rewritten forms all ask it); ``split_qkv_heads`` reads
the per-head query/key factors of the fused ``qkv`` weight; ``concatenate_factors`` is the concatenate construction
(exact at full rank); ``from_factors`` builds the layer from any shared factors ``W~q, W~k`` and mixing ``M`` (a
decomposition's, or the concatenate ones) and copies everything else; ``replace_submodule`` puts the layer in its
model's place.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor
from timm.layers import Attention

from ..checks import positive_int

QK_NORM = "qk_norm normalises each head's queries and keys token by token, so the logits are not a bilinear form of " \
          "the tokens"
GATED = "a gated output (sigmoid gate on the heads) the collaborative layer does not have"


def full_rank(attn: nn.Module) -> int:
    """A layer's full q/k rank, heads x head dim: timm's ``attn_dim`` where the layer has it (``Attention``), else
    the product (EVA's and rotary layers)."""
    return getattr(attn, "attn_dim", None) or attn.num_heads * attn.head_dim


def conversion_reason(attn: nn.Module) -> Optional[str]:
    """Why a self-attention layer with per-head forms ``x_n^T Wq_i Wk_i^T x_m`` (timm's ``Attention``, BEiT's,
    EVA's without rope) has no exact collaborative form (eq. 5); None when it has one.

    Refused: ``qk_norm`` (the logits are no bilinear form), a gated output, and heads x head dim (timm's
    ``attn_dim``, the width of the output projection's input) or output dim other than the token dim.
    """
    if any(not isinstance(getattr(attn, norm, None), (nn.Identity, type(None))) for norm in ("q_norm", "k_norm")):
        return QK_NORM
    if getattr(attn, "gate", None) is not None:
        return GATED
    fused = getattr(attn, "qkv", None)
    dim = (fused if fused is not None else attn.q_proj).in_features
    attn_dim, dim_out = attn.proj.in_features, attn.proj.out_features
    if attn_dim != dim or dim_out != dim:
        return (f"heads x head dim ({attn_dim}) or output dim ({dim_out}) differs from dim ({dim}): not covered "
                f"(collaborative layers keep dim / heads per value head)")
    return None


def not_convertible(attn: nn.Module, why: str) -> ValueError:
    """The one-line refusal of a layer that does not convert (``why``: :func:`conversion_reason`'s, or another)."""
    return ValueError(f"cannot convert this {type(attn).__name__}: {why}")


def split_qkv_heads(qkv_weight: Tensor, num_heads: int) -> tuple[Tensor, Tensor]:
    """Per-head query and key factors from a timm ``attn.qkv.weight`` of shape (3D, D).

    Rows ``[0:D]`` are the queries and ``[D:2D]`` the keys; head i owns rows ``i*dh:(i+1)*dh`` of each block.

    Args:
        qkv_weight: The fused qkv Linear weight, shape (3D, D).
        num_heads: Number of heads Nh; must divide D.

    Returns:
        ``(wq, wk)``, each of shape (Nh, D, dh) with ``wq[i] = W[i*dh:(i+1)*dh].T`` (views of ``qkv_weight``).
    """
    if not isinstance(qkv_weight, Tensor) or qkv_weight.dim() != 2:
        raise ValueError(f"qkv_weight must be a 2-D tensor of shape (3D, D), got {getattr(qkv_weight, 'shape', None)}")
    num_heads = positive_int(num_heads, "num_heads")
    three_d, d = qkv_weight.shape
    if three_d != 3 * d:
        raise ValueError(f"qkv_weight must have shape (3D, D), got {tuple(qkv_weight.shape)}")
    if d % num_heads:
        raise ValueError(f"num_heads={num_heads} does not divide the embedding dim D={d}")
    dh = d // num_heads
    wq = qkv_weight[:d].reshape(num_heads, dh, d).transpose(1, 2)
    wk = qkv_weight[d : 2 * d].reshape(num_heads, dh, d).transpose(1, 2)
    return wq, wk


def concatenate_factors(wq: Tensor, wk: Tensor, key_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """The concatenate construction: ``W~q = [wq_0 .. wq_{Nh-1}]``, ``W~k`` likewise (D x ``key_dim``, zero columns
    past ``Nh * dh``), ``M[i]`` the indicator of head i's ``dh`` columns. Exact for ``key_dim >= Nh * dh``.

    ``wq``, ``wk``: per-head factors (Nh, D, dh), as ``split_qkv_heads`` returns them.
    """
    nh, d, dh = wq.shape
    if key_dim < nh * dh:
        raise ValueError(f"the concatenate construction needs key_dim >= Nh*dh = {nh * dh}, got {key_dim}")
    query, key, mixing = wq.new_zeros(d, key_dim), wk.new_zeros(d, key_dim), wq.new_zeros(nh, key_dim)
    query[:, :nh * dh] = wq.permute(1, 0, 2).reshape(d, nh * dh)
    key[:, :nh * dh] = wk.permute(1, 0, 2).reshape(d, nh * dh)
    for i in range(nh):
        mixing[i, i * dh:(i + 1) * dh] = 1
    return query, key, mixing


def from_factors(cls: type, attn: Attention, query: Tensor, key: Tensor, mixing: Tensor) -> nn.Module:
    """A ``cls`` (a ``CollaborativeAttention``) layer of ``attn`` with shared factors ``query``, ``key`` (D x D~k)
    and ``mixing`` (Nh x D~k). Values, projection, norm and dropout are copied; the query bias becomes the content
    bias ``c_i = Wk_i bq_i`` (section 2.2); the key bias is dropped (constant along each softmax row)."""
    dim, heads, weight = attn.qkv.in_features, attn.num_heads, attn.qkv.weight
    has_bias = attn.qkv.bias is not None
    layer = cls(dim, heads, key_dim=query.shape[1], qkv_bias=has_bias, proj_bias=attn.proj.bias is not None,
                attn_drop=attn.attn_drop.p, proj_drop=attn.proj_drop.p, mixing_init="concatenate",
                device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        layer.query.weight.copy_(query.T)
        layer.key.weight.copy_(key.T)
        layer.mixing.copy_(mixing)
        layer.value.weight.copy_(weight[2 * dim:])
        if has_bias:
            b_q, _, b_v = attn.qkv.bias.chunk(3)
            layer.value.bias.copy_(b_v)
            _, wk = split_qkv_heads(weight, heads)  # (Nh, D, dh): c_i = Wk_i bq_i
            layer.content_bias.weight.copy_((wk @ b_q.reshape(heads, -1, 1)).squeeze(-1))
        layer.proj.load_state_dict(attn.proj.state_dict())
    layer.norm = copy.deepcopy(attn.norm)  # scale_norm, with its exact eps and weights
    layer.fused_attn = attn.fused_attn
    return layer.train(attn.training)


def parent_module(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding ``model``'s submodule of dotted name ``name`` (e.g. ``"blocks.3.attn"``: ``blocks.3``) and
    the submodule's name in it (``"attn"``)."""
    parent, _, child = name.rpartition(".")
    return model.get_submodule(parent), child


def replace_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` in ``model`` at the dotted submodule name ``name`` (e.g. ``"blocks.3.attn"``), in place."""
    setattr(*parent_module(model, name), new)
