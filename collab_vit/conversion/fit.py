"""One attention layer fitted: a timm ``Attention`` -> a ``CollaborativeAttention`` at a key dim (section 3.3).

Below ``heads x head_dim`` the per-head bilinear forms ``T_i = Wq_i Wk_i^T`` get a rank-``key_dim`` decomposition
(``decompose``), weight-only or of the forms whitened by the tokens the layer sees (``calibration``, docs/math.md
"Data-aware conversion"); at or above it the concatenate construction is exact. :func:`layer_from_decomposition`
builds every converted layer.
"""
from __future__ import annotations

import copy
import inspect
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from timm.layers import Attention

from ..layers.attention import CollaborativeAttention
from .calibration import Whitening, whitened_decomposition
from .decompose import (Decomposition, cp_decompose, exact_decomposition, parafac_decompose, split_qkv_heads,
                        tucker_decompose)
from .forms import keeps_form
from .support import attention_reason

# "tucker" and "cp" never form the dense tensor; "parafac" is the paper's procedure (tensorly on the dense tensor).
METHODS: dict[str, Callable[..., Decomposition]] = {"tucker": tucker_decompose, "cp": cp_decompose,
                                                    "parafac": parafac_decompose}


def check_method(method: object) -> str:
    if method not in METHODS:
        raise ValueError(f"method must be one of {tuple(METHODS)}, got {method!r}")
    return str(method)


def layer_from_decomposition(attn: Attention, decomposition: Decomposition) -> CollaborativeAttention:
    """The collaborative layer of ``attn`` with ``W~q, W~k, M`` from ``decomposition`` (section 3.3): the one
    construction, exact with ``decompose.exact_decomposition`` (the concatenate construction). Values, projection
    and norm are copied; the query bias becomes the content bias ``c_i = Wk_i bq_i`` (section 2.2); the key bias is
    dropped (constant along each softmax row)."""
    dim, heads, weight = attn.qkv.in_features, attn.num_heads, attn.qkv.weight
    has_bias = attn.qkv.bias is not None
    layer = CollaborativeAttention(
        dim, heads, key_dim=decomposition.query.shape[1], qkv_bias=has_bias, proj_bias=attn.proj.bias is not None,
        attn_drop=attn.attn_drop.p, proj_drop=attn.proj_drop.p, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        layer.query.weight.copy_(decomposition.query.T)
        layer.key.weight.copy_(decomposition.key.T)
        layer.mixing.copy_(decomposition.mixing)
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


@dataclass
class LayerFit:
    """One converted layer and how it was fitted."""

    layer: CollaborativeAttention
    key_dim: int
    tensor_error: float  # ||T - T~|| / ||T||
    whitened_error: Optional[float]  # ||Lq^T (T - T~) Lk|| / ||Lq^T T Lk|| (None without calibration)
    seconds: float


def head_factors(attn: Attention) -> tuple[torch.Tensor, torch.Tensor]:
    """``(wq, wk)``, each ``(Nh, D, dh)`` on the CPU, of a timm ``Attention`` (``decompose.split_qkv_heads``)."""
    return split_qkv_heads(attn.qkv.weight.detach().cpu(), attn.num_heads)


@keeps_form
def fit_attention(attn: Attention, key_dim: int, method: str = "tucker",
                  sides: Optional[tuple[Whitening, Whitening]] = None, **options) -> LayerFit:
    """``attn`` at ``key_dim``: a ``method`` decomposition (``options``: ``seed, max_iter, tol, dtype``) of its forms,
    whitened by ``sides`` (``calibration.whitening``) when given; exact at ``key_dim >= heads x head_dim``."""
    check_method(method)
    why = attention_reason(attn) if isinstance(attn, Attention) else "not a timm Attention"
    if why is not None:  # before the decomposition
        raise ValueError(f"cannot convert this {type(attn).__name__}: {why}")
    wq, wk = head_factors(attn)
    began = time.perf_counter()
    if key_dim >= attn.num_heads * attn.head_dim:
        return LayerFit(layer_from_decomposition(attn, exact_decomposition(wq, wk, key_dim)), key_dim, 0.0,
                        None if sides is None else 0.0, time.perf_counter() - began)
    whitened = None
    decompose = METHODS[method]
    if "seed" not in inspect.signature(decompose).parameters:  # tucker is deterministic: it takes no seed
        options = {k: v for k, v in options.items() if k != "seed"}
    with single_thread():
        if sides is None:
            decomposition = decompose(wq, wk, key_dim, **options)
        else:
            decomposition, whitened = whitened_decomposition(wq, wk, key_dim, sides, decompose, **options)
    return LayerFit(layer_from_decomposition(attn, decomposition), key_dim, decomposition.relative_error, whitened,
                    time.perf_counter() - began)


@contextmanager
def single_thread() -> Iterator[None]:
    """Run the decomposition on one thread: its matrices are small (D x key_dim), and measured on 2 shared cores
    one thread took 38 s for DeiT-B's 12 layers where two took 256 s (benchmarks/decompose_notes.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
