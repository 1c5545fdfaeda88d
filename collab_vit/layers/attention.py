"""Collaborative multi-head attention and the reduced-key-dim concatenate baseline, as timm attention layers.

Paper: Cordonnier, Loukas, Jaggi, "Multi-Head Attention: Collaborate Instead of Concatenate" (arXiv 2006.16362).
Both layers are drop-in ``attn_layer`` classes for timm's ``VisionTransformer``: they take the keywords timm passes
(``dim, num_heads, qkv_bias, qk_norm, scale_norm, proj_bias, attn_drop, proj_drop, norm_layer, device, dtype``) and
``forward(x, attn_mask=None, is_causal=False)`` with the semantics of timm's ``Attention``.
"""

import math
from functools import lru_cache
from typing import Literal, Optional, Type

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.jit import Final
from timm.layers import Attention, use_fused_attn
from timm.layers.attention import maybe_add_mask, resolve_self_attn_mask
from timm.models import register_notrace_function

from ..checks import positive_int
from .construction import concatenate_factors, conversion_reason, from_factors, not_convertible, split_qkv_heads
from .attention_core import (CollaborativeCore, collaborative_logits, equal_head_dims, explicit_attend,
                             explicit_collaborative)
from .dispatch import Path, select_path
from .sdpa_layout import folded_layout, head_queries, shared_keys

MixingInit = Literal["concatenate", "random"]
MIXING_INITS = ("concatenate", "random")


def check_layer_args(dim: int, num_heads: int, key_dim: object, needs_norm: bool,
                     norm_layer: Optional[Type[nn.Module]]) -> int:
    """Checks shared by both layers; returns the key dim (``dim`` when None)."""
    key_dim = dim if key_dim is None else positive_int(key_dim, "key_dim")
    if dim % num_heads != 0:
        raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
    if needs_norm and norm_layer is None:
        raise ValueError("norm_layer must be given when qk_norm or scale_norm is set")
    return key_dim


def head_blocks(key_dim: int, num_heads: int) -> list[range]:
    """Split ``range(key_dim)`` into ``num_heads`` contiguous blocks of near-equal size (head i owns block i)."""
    bounds = [round(i * key_dim / num_heads) for i in range(num_heads + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(num_heads)]


@torch.fx.wrap
@register_notrace_function
def fused_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, attn_mask: Optional[torch.Tensor],
                 is_causal: bool, dropout_p: float) -> torch.Tensor:
    """``scaled_dot_product_attention``; on CPU head dims zero-padded to equal width for torch's flash kernel (exact).

    A float mask is cast to q's dtype (SDPA refuses a float32 mask on bfloat16 queries).
    """
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.to(q.dtype)
    value_dim = v.shape[-1]
    if q.device.type == "cpu":
        q, k, v = equal_head_dims(q, k, v)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    return out[..., :value_dim]


def attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        attn_mask: Optional[torch.Tensor],
        is_causal: bool,
        dropout_p: float,
        fused: bool,
) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` per head, with the mask semantics of timm's ``Attention``.

    ``fused`` goes through ``fused_attend`` (SDPA); otherwise the explicit product (same result).
    """
    if fused:
        return fused_attend(q, k, v, scale, attn_mask, is_causal, dropout_p)
    return explicit_attend(q, k, v, scale, attn_mask, is_causal, dropout_p)


@torch.jit.unused
def autocast_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast computes matmuls in on x's device, or x's own dtype outside autocast (or on a device
    autocast does not know, such as ``meta``)."""
    device = x.device.type
    # torch.compile traces real devices; torch 2.9's tracer refuses is_autocast_available (fullgraph graph break)
    known = torch.compiler.is_compiling() or torch.amp.is_autocast_available(device)
    if known and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the attention products: autocast's (bfloat16, float16) if it is on, else x's (TorchScript: x's)."""
    if torch.jit.is_scripting():
        return x.dtype
    return autocast_dtype(x)


def content_mask(content: Optional[torch.Tensor], scale: float, attn_mask: Optional[torch.Tensor], is_causal: bool,
                 seq_len: int, like: torch.Tensor) -> Optional[torch.Tensor]:
    """The content bias ``scale * c_i . x_m`` as an additive (B, Nh, 1, N) mask, merged with the caller's mask.

    Constant along a query row of head i; the merged mask follows timm's semantics (``is_causal`` wins).
    """
    if content is None:
        return resolve_self_attn_mask(seq_len, like, attn_mask, is_causal)
    bias = content.transpose(1, 2).unsqueeze(2) * scale  # (B, Nh, 1, N)
    return maybe_add_mask(bias, resolve_self_attn_mask(seq_len, bias, attn_mask, is_causal))


def folded_sdpa(q: torch.Tensor, mixing: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                content: Optional[torch.Tensor], scale: float, attn_mask: Optional[torch.Tensor], is_causal: bool,
                dropout_p: float) -> torch.Tensor:
    """The folded layout (``sdpa_layout``) through ``fused_attend``: the same function on every device, torch (or
    the compiler) picks the kernel."""
    q_ext, m_ext, k_ext = folded_layout(q, mixing, k, content)
    q2, k2 = head_queries(q_ext, m_ext), shared_keys(k_ext, m_ext.shape[0])
    return fused_attend(q2, k2, v, scale, attn_mask, is_causal, dropout_p)


@torch.jit.unused
def core_attend(q: torch.Tensor, mixing: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """``CollaborativeCore`` (eager only: graph capture never takes it)."""
    return CollaborativeCore.apply(q, mixing, k, v, mask, scale)


@torch.fx.wrap
@register_notrace_function
def collaborative_attend(
        q: torch.Tensor,
        mixing: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        content: Optional[torch.Tensor],
        scale: float,
        attn_mask: Optional[torch.Tensor],
        is_causal: bool,
        dropout_p: float,
        fused: bool,
) -> torch.Tensor:
    """Eq. 5 attention of all heads: (B, Nh, N, dh), by the route ``dispatch.select_path`` names.

    Shared queries/keys (B, N, D~k), mixing (Nh, D~k), values (B, Nh, N, dh), content scores ``c(x)`` (B, N, Nh)
    or None. Inputs are first cast to the compute dtype (autocast's, else q's); so is a float mask. A leaf for
    ``torch.fx`` (the route is chosen when the graph runs) and scriptable.
    """
    dtype = compute_dtype(q)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if content is not None:
        content = content.to(dtype)
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.to(dtype)
    capturing = torch.jit.is_scripting() or torch.compiler.is_compiling() or torch.jit.is_tracing()
    path = select_path(q.device.type, fused, dropout_p, capturing)
    if path == Path.SDPA:
        return folded_sdpa(q, mixing, k, v, content, scale, attn_mask, is_causal, dropout_p)
    mask = content_mask(content, scale, attn_mask, is_causal, q.shape[1], q)
    if path == Path.CORE:
        return core_attend(q, mixing, k, v, mask, scale)
    return explicit_collaborative(q, mixing, k, v, mask, scale, dropout_p)


class HeadOutput(nn.Module):
    """What follows the attention weights in timm's ``Attention``: merge heads, scale-norm, projection, dropout."""

    def init_output(self, dim: int, scale_norm: bool, proj_bias: bool, attn_drop: float, proj_drop: float,
                    norm_layer: Optional[Type[nn.Module]], dd: dict) -> None:
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = norm_layer(dim, **dd) if scale_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def project_heads(self, x: torch.Tensor) -> torch.Tensor:
        B, H, N, dh = x.shape
        x = x.transpose(1, 2).reshape(B, N, H * dh)
        return self.proj_drop(self.proj(self.norm(x)))


class CollaborativeAttention(HeadOutput):
    """Collaborative multi-head self-attention (paper eq. 5, section 3.2).

    Heads share one query and one key projection ``W~q, W~k`` (D x D~k, no bias); head i re-weights the shared
    dimensions with its mixing vector ``m_i`` (a row of ``mixing``, Nh x D~k). The logit of query token n and key
    token m for head i is ``((x_n W~q) diag(m_i) (x_m W~k)^T + c_i . x_m) / sqrt(dh)`` where ``c_i`` is the content
    bias (it replaces the query bias of the standard layer, docs/math.md) and ``dh = dim / num_heads`` is the
    ORIGINAL head dim, whatever ``key_dim`` is. Values, output projection and dropout are those of timm's
    ``Attention``.

    Args:
        dim: token dimension D.
        num_heads: number of heads Nh.
        key_dim: shared key/query dimension D~k (any positive integer; defaults to ``dim``).
        qkv_bias: bias on the values, and a content bias (Linear D -> Nh, no bias) for the keys.
        qk_norm: normalise the shared queries and keys (``norm_layer(key_dim)``) before mixing.
        scale_norm: normalise the attention output before the projection (as timm).
        proj_bias: bias of the output projection.
        attn_drop: dropout on the attention weights.
        proj_drop: dropout after the output projection.
        norm_layer: normalisation layer class for ``qk_norm`` / ``scale_norm``.
        mixing_init: ``"concatenate"`` (head i owns a contiguous block of shared dims; exact standard attention at
            ``key_dim == dim``) or ``"random"`` (normal, variance ``dh / key_dim`` so logits have the scale of
            standard attention; below ``key_dim == dim`` the concatenate init starts ``sqrt(dim / key_dim)`` cooler).
    """

    fused_attn: Final[bool]

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            key_dim: Optional[int] = None,
            qkv_bias: bool = False,
            qk_norm: bool = False,
            scale_norm: bool = False,
            proj_bias: bool = True,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            norm_layer: Optional[Type[nn.Module]] = None,
            mixing_init: MixingInit = "concatenate",
            device: Optional[torch.device] = None,
            dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        key_dim = check_layer_args(dim, num_heads, key_dim, qk_norm or scale_norm, norm_layer)
        if mixing_init not in MIXING_INITS:
            raise ValueError(f"mixing_init must be one of {MIXING_INITS}, got {mixing_init!r}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.key_dim = key_dim
        self.scale = self.head_dim ** -0.5
        self.mixing_init = mixing_init
        self.fused_attn = use_fused_attn()

        self.query = nn.Linear(dim, key_dim, bias=False, **dd)
        self.key = nn.Linear(dim, key_dim, bias=False, **dd)
        self.value = nn.Linear(dim, dim, bias=qkv_bias, **dd)
        self.mixing = nn.Parameter(torch.empty(num_heads, key_dim, **dd))
        self.content_bias = nn.Linear(dim, num_heads, bias=False, **dd) if qkv_bias else None
        self.q_norm = norm_layer(key_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(key_dim, **dd) if qk_norm else nn.Identity()
        self.init_output(dim, scale_norm, proj_bias, attn_drop, proj_drop, norm_layer, dd)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise the non-Linear parameters (the mixing matrix); timm's ViT init handles the Linears."""
        if self.mixing_init == "concatenate":
            self.mixing.zero_()
            for head, block in enumerate(head_blocks(self.key_dim, self.num_heads)):
                self.mixing[head, block.start:block.stop] = 1.
        else:
            nn.init.normal_(self.mixing, std=math.sqrt(self.head_dim / self.key_dim))

    def forward(
            self,
            x: torch.Tensor,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ) -> torch.Tensor:
        B, N, C = x.shape
        q = self.q_norm(self.query(x))  # (B, N, D~k), shared by all heads
        k = self.k_norm(self.key(x))
        v = self.value(x).reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        content: Optional[torch.Tensor] = None
        if self.content_bias is not None:
            content = self.content_bias(x)  # (B, N, Nh): c_i . x_m
        dropout_p = self.attn_drop.p if self.training else 0.
        x = collaborative_attend(q, self.mixing, k, v, content, self.scale, attn_mask, is_causal, dropout_p,
                                 self.fused_attn)
        return self.project_heads(x)

    @torch.jit.unused
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Eq. 5's logits of every head for tokens ``x`` (B, N, D): ``(B, Nh, N, N)``, content bias included, in
        ``x``'s dtype (float32 at least); ``attention_core.collaborative_logits``, as the explicit route computes them."""
        q, k = self.q_norm(self.query(x)), self.k_norm(self.key(x))
        content = self.content_bias(x) if self.content_bias is not None else None
        mask = content_mask(content, self.scale, None, False, x.shape[1], q)
        return collaborative_logits(q, self.mixing, k, mask, self.scale)

    @classmethod
    def from_attention(cls, attn: Attention, key_dim: Optional[int] = None) -> "CollaborativeAttention":
        """Exact collaborative layer from a timm ``Attention`` (paper section 3.3, full rank).

        Concatenate construction: ``W~q = [Wq_1 .. Wq_Nh]``, ``W~k = [Wk_1 .. Wk_Nh]`` (zero columns past ``dim``),
        ``m_i`` the indicator of head i's dh columns, content bias ``c_i = Wk_i bq_i``; the key bias is dropped (it is
        constant along each softmax row). ``key_dim`` defaults to ``dim`` and must be at least ``dim`` here.
        """
        if not isinstance(attn, Attention):
            raise TypeError(f"from_attention expects a timm Attention, got {type(attn).__name__}")
        why = conversion_reason(attn)
        if why is not None:
            raise not_convertible(attn, why)
        dim = attn.qkv.in_features
        key_dim = dim if key_dim is None else positive_int(key_dim, "key_dim")
        if key_dim < dim:
            raise ValueError(f"exact conversion needs key_dim >= dim ({dim}), got {key_dim}; "
                             f"use collab_vit.reparametrize for compressed layers")
        wq, wk = split_qkv_heads(attn.qkv.weight.detach(), attn.num_heads)
        return from_factors(cls, attn, *concatenate_factors(wq, wk, key_dim))


class ConcatAttention(HeadOutput):
    """Standard (concatenate) multi-head attention with a reduced key/query dim: the paper's baseline (Table 2).

    Each head projects queries and keys to ``key_dim / num_heads`` dims; values keep ``dim / num_heads`` per head.
    Logits are scaled by ``(key_dim / num_heads) ** -0.5``, as in the reference DeiT fork.
    """

    fused_attn: Final[bool]

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            key_dim: Optional[int] = None,
            qkv_bias: bool = False,
            qk_norm: bool = False,
            scale_norm: bool = False,
            proj_bias: bool = True,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            norm_layer: Optional[Type[nn.Module]] = None,
            device: Optional[torch.device] = None,
            dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        key_dim = check_layer_args(dim, num_heads, key_dim, qk_norm or scale_norm, norm_layer)
        if key_dim % num_heads != 0:
            raise ValueError(f"key_dim ({key_dim}) must be divisible by num_heads ({num_heads}) for concatenate "
                             f"attention")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.key_dim = key_dim
        self.key_head_dim = key_dim // num_heads
        self.scale = self.key_head_dim ** -0.5
        self.fused_attn = use_fused_attn()

        self.qkv = nn.Linear(dim, 2 * key_dim + dim, bias=qkv_bias, **dd)  # [q | k | v] in one matmul
        self.q_norm = norm_layer(self.key_head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.key_head_dim, **dd) if qk_norm else nn.Identity()
        self.init_output(dim, scale_norm, proj_bias, attn_drop, proj_drop, norm_layer, dd)

    def forward(
            self,
            x: torch.Tensor,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).split([self.key_dim, self.key_dim, C], dim=-1)
        q = self.q_norm(q.reshape(B, N, self.num_heads, self.key_head_dim).transpose(1, 2))
        k = self.k_norm(k.reshape(B, N, self.num_heads, self.key_head_dim).transpose(1, 2))
        v = v.reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)

        x = attend(q, k, v, self.scale, attn_mask, is_causal, self.attn_drop.p if self.training else 0., self.fused_attn)
        return self.project_heads(x)


@lru_cache(maxsize=None)
def attention_class(base: Type[nn.Module], key_dim: int, mixing_init: Optional[MixingInit] = None) -> type:
    """A subclass of ``base`` with ``key_dim`` (and ``mixing_init``) fixed, to pass as timm's ``attn_layer``.

    timm's ``VisionTransformer`` only accepts a class (it calls ``issubclass``) and passes no extra keywords, so the
    key dim travels in the class. Classes are cached: one per (base, key_dim, mixing_init).
    """
    positive_int(key_dim, "key_dim")
    fixed = {"key_dim": key_dim} if mixing_init is None else {"key_dim": key_dim, "mixing_init": mixing_init}
    suffix = f"K{key_dim}" + ("" if mixing_init is None else mixing_init.capitalize())

    def __init__(self, dim: int, *args, **kwargs) -> None:
        base.__init__(self, dim, *args, **{**kwargs, **fixed})

    cls = type(f"{base.__name__}{suffix}", (base,), {"__init__": __init__, "__module__": base.__module__})
    globals()[cls.__name__] = cls  # importable by name, so full-module pickling works
    return cls


def per_block_attention_class(base: Type[nn.Module], key_dims: tuple, mixing_init: Optional[MixingInit] = None) -> type:
    """A fresh ``attn_layer`` class whose successive instances take ``key_dims[0], key_dims[1], ...``.

    timm builds the blocks of a ``VisionTransformer`` in order, so block i gets ``key_dims[i]`` (a converted model
    keeps one key dim per layer). Building more layers than ``key_dims`` holds is an error; ``remaining()`` tells
    how many were not used.
    """
    pending = list(key_dims)

    def __init__(self, dim: int, *args, **kwargs) -> None:
        if not pending:
            raise ValueError(f"key_dim list has {len(key_dims)} entries but the model builds more attention layers")
        extra = {"key_dim": pending.pop(0)} if mixing_init is None else {"key_dim": pending.pop(0),
                                                                          "mixing_init": mixing_init}
        base.__init__(self, dim, *args, **{**kwargs, **extra})

    return type(f"{base.__name__}PerBlock", (base,), {
        "__init__": __init__, "__module__": base.__module__, "remaining": staticmethod(lambda: len(pending))})
