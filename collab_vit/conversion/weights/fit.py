"""One attention layer fitted: a timm ``Attention`` -> a ``CollaborativeAttention`` at a key dim (section 3.3).

Below ``heads x head_dim`` the per-head bilinear forms ``T_i = Wq_i Wk_i^T`` get a rank-``key_dim`` decomposition
(``decompose``), weight-only or of the forms whitened by the tokens the layer sees (``whitening``, docs/math.md
"Data-aware conversion"); at or above it the concatenate construction is exact. :func:`layer_from_decomposition`
builds every converted layer; :func:`tensor_error` and :func:`output_error` measure a fitted layer against its
source (rotary layers' tensor error: ``rotary_fit.layer_error``).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn
from timm.layers import Attention

from ...layers.attention import CollaborativeAttention
from ...layers.construction import from_factors, not_convertible
from .whitening import Whitening, whitened_decomposition
from .decompose import Decomposition, exact_decomposition, relative_error, split_qkv_heads, tucker_decompose
from .forms import keeps_form
from .support import attention_reason

def layer_from_decomposition(attn: Attention, decomposition: Decomposition) -> CollaborativeAttention:
    """The collaborative layer of ``attn`` with ``W~q, W~k, M`` from ``decomposition`` (section 3.3), built by
    ``layers.construction.from_factors``; exact with ``decompose.exact_decomposition``."""
    return from_factors(CollaborativeAttention, attn, decomposition.query, decomposition.key,
                        decomposition.mixing)


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
def fit_attention(attn: Attention, key_dim: int, sides: Optional[tuple[Whitening, Whitening]] = None,
                  **options) -> LayerFit:
    """``attn`` at ``key_dim``: the Tucker decomposition (``decompose.tucker_decompose``, deterministic; ``options``:
    ``max_iter, tol, dtype``) of its forms, whitened by ``sides`` (``whitening.whitening``) when given; exact at
    ``key_dim >= heads x head_dim``."""
    why = attention_reason(attn) if isinstance(attn, Attention) else "not a timm Attention"
    if why is not None:  # before the decomposition
        raise not_convertible(attn, why)
    wq, wk = head_factors(attn)
    began = time.perf_counter()
    if key_dim >= attn.attn_dim:
        return LayerFit(layer_from_decomposition(attn, exact_decomposition(wq, wk, key_dim)), key_dim, 0.0,
                        None if sides is None else 0.0, time.perf_counter() - began)
    whitened = None
    with single_thread():
        if sides is None:
            decomposition = tucker_decompose(wq, wk, key_dim, **options)
        else:
            decomposition, whitened = whitened_decomposition(wq, wk, key_dim, sides, tucker_decompose, **options)
    return LayerFit(layer_from_decomposition(attn, decomposition), key_dim, decomposition.relative_error, whitened,
                    time.perf_counter() - began)


def tensor_error(attn: Attention, layer: nn.Module) -> float:
    """``||T - T~|| / ||T||`` of a fitted (e.g. refined) collaborative layer against its source ``attn``."""
    wq, wk = head_factors(attn)
    weights = (layer.query.weight.T, layer.key.weight.T, layer.mixing)
    return relative_error(wq, wk, *(w.detach().cpu() for w in weights))


@torch.no_grad()
def output_error(layer: nn.Module, source: nn.Module, call: tuple[torch.Tensor, dict[str, Any]]) -> float:
    """``||layer(x) - source(x)|| / ||source(x)||`` on one call (the tokens and the keywords a layer is called with,
    e.g. the rope: ``rotary.layer_calls``; ``(tokens, {})`` for standard attention), both in eval mode (their train
    flags are put back), on ``layer``'s device: the attention-output error of a converted layer
    (``LayerReport.output_error``)."""
    tokens = call[0].to(next(layer.parameters()).device)
    was = layer.training, source.training
    out, ref = layer.eval()(tokens, **call[1]), source.eval()(tokens, **call[1])
    layer.train(was[0])
    source.train(was[1])
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@contextmanager
def single_thread() -> Iterator[None]:
    """Run the decomposition on one thread: its matrices are small (D x key_dim), and on shared cores OpenMP threads
    that wait on each other cost more than they save (timings: benchmarks/decompose_notes.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
