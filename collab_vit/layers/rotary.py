"""Collaborative attention under rotary position embedding: drop-ins for timm's ``AttentionRope`` and ``EvaAttention``.

timm's rope (``timm.layers.pos_embed_sincos.apply_rot_embed_cat``) splits each head's query and key into 2-dim pairs,
dims ``(2p, 2p+1)`` in the interleaved layout and ``(p, p + dh/2)`` in the half one, and rotates pair ``p`` of the
token at position ``t`` by the angle ``theta_p(t)``: read as ``z = x_first + i x_second``, ``z -> z e^{i theta_p(t)}``.
The rope tensor (``sin | cos``, ``(N', 2 dh)``) is the same for every head; prefix tokens (class token, registers)
are not rotated. Pair ``p`` of head ``i`` adds ``Re(q_ip(n) conj(k_ip(m)) e^{i(theta_p(n) - theta_p(m))})`` to the
logit.

Here the shared queries and keys ``x W~q + b~q``, ``x W~k + b~k`` (``D~k`` even) are ``D~k / 2`` complex pairs,
stored interleaved whatever the rope layout; shared pair ``r`` carries the source frequency ``pair_freq[r]`` and is
rotated by its angles. Head i's logit (docs/math.md, "Rotary attention"):

    a_i(n, m) = sum_r Re( mu_ir q~_r(n) conj(k~_r(m)) ) / sqrt(dh),      q~, k~ the rotated shared pairs,

with the complex mixing ``mu_ir = mixing[i, 2r] + i mixing[i, 2r+1]``: a 2x2 rotation-scaling, which commutes with the
position rotation, so the logit still depends on the positions only through ``theta(n) - theta(m)``. At full rank
(``D~k = Nh dh``, head i's mixing 1 on its own pairs) the layer computes the source's logits.
"""
from __future__ import annotations

import math
from typing import Optional, Type

import torch
import torch.nn as nn
from timm.layers import use_fused_attn
from timm.layers.pos_embed_sincos import apply_rot_embed, rot
from timm.models import register_notrace_function

from .attention import CollaborativeAttention, MIXING_INITS, MixingInit, attend, check_layer_args, head_blocks
from .attention_core import logits as head_logits
from .sdpa_layout import aligned


def check_rope_args(dim: int, num_heads: int, key_dim: int, dim_out: Optional[int], attn_head_dim: Optional[int],
                    qk_norm: bool, num_kv_heads: Optional[int]) -> None:
    """The rotary layer's checks beyond ``check_layer_args`` (one-line ``ValueError`` each)."""
    if dim_out not in (None, dim) or attn_head_dim not in (None, dim // num_heads):
        raise ValueError(f"the collaborative rotary layer keeps dim / heads per head and dim outputs, got "
                         f"dim_out={dim_out}, attn_head_dim={attn_head_dim} for dim {dim}")
    if qk_norm:
        raise ValueError("qk_norm normalises each head's queries and keys: no shared collaborative projection")
    if num_kv_heads not in (None, num_heads):
        raise ValueError(f"grouped-query attention (num_kv_heads={num_kv_heads} < num_heads={num_heads}): not covered")
    if key_dim % 2 or (dim // num_heads) % 2:
        raise ValueError(f"rotary attention needs an even key_dim and head dim, got {key_dim} and {dim // num_heads}")


@torch.fx.wrap
@register_notrace_function
def pair_angles(rope: torch.Tensor, pair_freq: torch.Tensor, half: bool,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sin, cos`` of every shared dim, interleaved (``(N', D~k)``, or ``(B, N', D~k)`` per sample), read from timm's
    rope tensor ``(N', 2 dh)`` (or ``(B, 1, N', 2 dh)``) in its layout: pair ``r`` takes frequency ``pair_freq[r]``."""
    if rope.dim() == 4 and rope.shape[1] == 1:
        rope = rope[:, 0]
    elif rope.dim() != 2:
        raise ValueError(f"rope of shape {list(rope.shape)} has one embedding per head (RotaryEmbeddingMixed): the "
                         f"heads share no frequency, the collaborative rotary layer needs one for all heads")
    if rope.shape[-1] != 2 * head_dim:
        raise ValueError(f"rope has {rope.shape[-1]} channels, the layer's heads need 2 x {head_dim}")
    sin, cos = rope[..., :head_dim], rope[..., head_dim:]  # slices, not chunk: TorchScript cannot unpack its list
    pairs = head_dim // 2
    sin, cos = (sin[..., :pairs], cos[..., :pairs]) if half else (sin[..., 0::2], cos[..., 0::2])
    sin, cos = sin.index_select(-1, pair_freq), cos.index_select(-1, pair_freq)
    return sin.repeat_interleave(2, -1), cos.repeat_interleave(2, -1)


def rotate(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, prefix: int) -> torch.Tensor:
    """Shared pairs ``x`` (B, N, D~k) rotated as timm rotates a head (``apply_rot_embed``, interleaved), the first
    ``prefix`` tokens left as they are."""
    if prefix == 0:
        return apply_rot_embed(x, sin, cos)
    return torch.cat([x[:, :prefix], apply_rot_embed(x[:, prefix:], sin, cos)], dim=1)


def complex_mix(q: torch.Tensor, mixing: torch.Tensor) -> torch.Tensor:
    """Every head's queries ``mu_i * q~`` pair by pair, (B, Nh, N, D~k): ``q Re(mu_i) + rot(q) Im(mu_i)`` with timm's
    ``rot`` (``(x0, x1) -> (-x1, x0)``, multiplication by ``i``). With ``mu = 1`` it returns ``q`` unchanged, bit
    for bit."""
    m = mixing.to(q.dtype)
    real, imag = m[:, 0::2].repeat_interleave(2, -1), m[:, 1::2].repeat_interleave(2, -1)
    return q.unsqueeze(1) * real.unsqueeze(1) + rot(q).unsqueeze(1) * imag.unsqueeze(1)


class CollaborativeAttentionRope(CollaborativeAttention):
    """Collaborative attention with rotary position embedding (module docstring): timm ``AttentionRope``'s keywords
    and ``forward(x, rope=None, attn_mask=None, is_causal=False)``.

    The shared query / key Linears carry the biases (``qkv_bias``; a rotated bias is no content bias: docs/math.md);
    there is no content bias. ``mixing`` (Nh x D~k) holds each head's complex mixing, real and imaginary parts
    interleaved per pair; ``pair_freq`` (a buffer, D~k / 2) the source frequency of each shared pair. The routes are
    the standard layer's: SDPA (``fused_attn``) with each head's mixed queries against the shared keys, or written
    out. ``qkv_fused`` and ``qkv_bias_separate`` are accepted for timm's call and change nothing; ``qk_norm``,
    grouped-query attention and other head dims are refused. ``CollaborativeAttention.__init__`` is not called (its
    parameters differ); the layer is a ``CollaborativeAttention`` for records, weight decay and the hub.
    """

    def __init__(self, dim: int, num_heads: int = 8, dim_out: Optional[int] = None, qkv_bias: bool = True,
                 qkv_fused: bool = True, num_prefix_tokens: int = 1, attn_drop: float = 0., proj_drop: float = 0.,
                 attn_head_dim: Optional[int] = None, norm_layer: Optional[Type[nn.Module]] = None,
                 qk_norm: bool = False, scale_norm: bool = False, proj_bias: bool = True, rotate_half: bool = False,
                 gated: bool = False, num_kv_heads: Optional[int] = None, key_dim: Optional[int] = None,
                 mixing_init: MixingInit = "concatenate", qkv_bias_separate: bool = False,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        nn.Module.__init__(self)
        dd = {"device": device, "dtype": dtype}
        key_dim = check_layer_args(dim, num_heads, key_dim, scale_norm, norm_layer)
        check_rope_args(dim, num_heads, key_dim, dim_out, attn_head_dim, qk_norm, num_kv_heads)
        if mixing_init not in MIXING_INITS:
            raise ValueError(f"mixing_init must be one of {MIXING_INITS}, got {mixing_init!r}")
        self.num_heads, self.head_dim, self.key_dim = num_heads, dim // num_heads, key_dim
        self.scale = self.head_dim ** -0.5
        self.mixing_init = mixing_init
        self.fused_attn = use_fused_attn()
        self.num_prefix_tokens = num_prefix_tokens
        self.rotate_half = rotate_half

        self.query = nn.Linear(dim, key_dim, bias=qkv_bias, **dd)
        self.key = nn.Linear(dim, key_dim, bias=qkv_bias, **dd)
        self.value = nn.Linear(dim, dim, bias=qkv_bias, **dd)
        self.mixing = nn.Parameter(torch.empty(num_heads, key_dim, **dd))
        self.content_bias = None
        self.q_norm, self.k_norm = nn.Identity(), nn.Identity()
        self.gate = nn.Linear(dim, dim, bias=qkv_bias, **dd) if gated else None
        self.init_output(dim, scale_norm, proj_bias, attn_drop, proj_drop, norm_layer, dd)
        pairs = torch.arange(key_dim // 2, device=device) % (self.head_dim // 2)
        self.register_buffer("pair_freq", pairs)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """``concatenate``: head i's mixing 1 (real) on a contiguous block of pairs, 0 elsewhere; ``random``: real and
        imaginary parts normal with variance ``dh / (2 D~k)`` each (logits of standard attention's scale)."""
        if self.mixing_init == "concatenate":
            self.mixing.zero_()
            for head, block in enumerate(head_blocks(self.key_dim // 2, self.num_heads)):
                self.mixing[head, 2 * block.start:2 * block.stop:2] = 1.
        else:
            nn.init.normal_(self.mixing, std=math.sqrt(self.head_dim / (2 * self.key_dim)))

    def rotated(self, x: torch.Tensor, rope: Optional[torch.Tensor],
                pad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's mixed rotated queries (B, Nh, N, W) and the rotated shared keys (B, N, W): ``W = D~k``, or
        with ``pad`` zero pairs up to a multiple of ``sdpa_layout.ALIGN`` (``aligned``, exact), the width SDPA's fused
        CUDA kernels take (the standard layer's ``folded_layout`` pads the same way)."""
        q, k = self.query(x), self.key(x)
        if rope is not None:
            sin, cos = pair_angles(rope, self.pair_freq, self.rotate_half, self.head_dim)
            q = rotate(q, sin, cos, self.num_prefix_tokens)
            k = rotate(k, sin, cos, self.num_prefix_tokens)
        mixing = self.mixing
        if pad:
            width = self.query.out_features  # a plain int: traceable
            q, mixing, k = aligned(q, width=width), aligned(mixing, width=width), aligned(k, width=width)
        return complex_mix(q, mixing), k

    def forward(self, x: torch.Tensor, rope: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        B, N, C = x.shape
        v = self.value(x).reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        queries, k = self.rotated(x, rope, pad=self.fused_attn)
        keys = k.to(v.dtype).unsqueeze(1).expand(-1, self.num_heads, -1, -1)  # one view, shared by all heads
        dropout_p = self.attn_drop.p if self.training else 0.
        out = attend(queries.to(v.dtype), keys, v, self.scale, attn_mask, is_causal, dropout_p, self.fused_attn)
        out = self.norm(out.transpose(1, 2).reshape(B, N, C))
        if self.gate is not None:
            out = out * self.gate(x).sigmoid()
        return self.proj_drop(self.proj(out))

    @torch.jit.unused
    def logits(self, x: torch.Tensor, rope: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Every head's logits ``(B, Nh, N, N)`` for tokens ``x`` (module docstring), as the written-out route forms
        them."""
        queries, k = self.rotated(x, rope)
        return head_logits(queries * self.scale, k, None)

    @classmethod
    def from_attention(cls, attn: nn.Module, key_dim: Optional[int] = None) -> "CollaborativeAttentionRope":
        raise TypeError(f"{cls.__name__} is built from a rotary layer by collab_vit.reparametrize (exact at full rank)")


class CollaborativeEvaAttention(CollaborativeAttentionRope):
    """:class:`CollaborativeAttentionRope` with timm ``EvaAttention``'s keywords and defaults (scale norm on, output
    projection with bias)."""

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, qkv_fused: bool = True,
                 qkv_bias_separate: bool = False, num_prefix_tokens: int = 1, attn_drop: float = 0.,
                 proj_drop: float = 0., attn_head_dim: Optional[int] = None,
                 norm_layer: Optional[Type[nn.Module]] = None, qk_norm: bool = False, scale_norm: bool = True,
                 rotate_half: bool = False, gated: bool = False, key_dim: Optional[int] = None,
                 mixing_init: MixingInit = "concatenate", device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(dim, num_heads, qkv_bias=qkv_bias, num_prefix_tokens=num_prefix_tokens, attn_drop=attn_drop,
                         proj_drop=proj_drop, attn_head_dim=attn_head_dim, norm_layer=norm_layer, qk_norm=qk_norm,
                         scale_norm=scale_norm, rotate_half=rotate_half, gated=gated, key_dim=key_dim,
                         mixing_init=mixing_init, device=device, dtype=dtype)
