"""Collaborative multi-head attention and the reduced-key-dim concatenate baseline, as timm attention layers.

Paper: Cordonnier, Loukas, Jaggi, "Multi-Head Attention: Collaborate Instead of Concatenate" (arXiv 2006.16362).
Both layers are drop-in ``attn_layer`` classes for timm's ``VisionTransformer``: they take the keywords timm passes
(``dim, num_heads, qkv_bias, qk_norm, scale_norm, proj_bias, attn_drop, proj_drop, norm_layer, device, dtype``) and
``forward(x, attn_mask=None, is_causal=False)`` with the semantics of timm's ``Attention``. Which function computes
the attention of a call, on each device: ``dispatch``.
"""

import math
from functools import lru_cache
from typing import Literal, Optional, Type

import torch
import torch.nn as nn
from torch.jit import Final
from timm.layers import Attention, use_fused_attn

from ..checks import positive_int
from .construction import concatenate_factors, conversion_reason, from_factors, not_convertible, split_qkv_heads
from .attention_core import collaborative_logits, content_mask
from .dispatch import attend, collaborative_attend
from .pickling import reduced_by

torch.fx.wrap("collaborative_attend")  # a leaf of plain torch.fx traces here too (its route is chosen when it runs)

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

    cls = type(f"{base.__name__}{suffix}", (base,), {"__init__": __init__, "__module__": base.__module__,
                                                      "__reduce_ex__": reduced_by(attention_class, base, key_dim,
                                                                                mixing_init)})
    globals()[cls.__name__] = cls  # importable by name in this process too
    return cls


@lru_cache(maxsize=None)
def _built_per_block(base: Type[nn.Module], mixing_init: Optional[MixingInit]) -> type:
    """The per-block class of ``base`` an unpickled layer gets: its key dim is in its state; it builds no more."""
    return per_block_attention_class(base, (), mixing_init)


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
        "__init__": __init__, "__module__": base.__module__, "remaining": staticmethod(lambda: len(pending)),
        "__reduce_ex__": reduced_by(_built_per_block, base, mixing_init)})
