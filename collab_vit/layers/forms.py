"""timm's attention in the forms of other timm families, standard and collaborative: BEiT's relative position bias,
EVA's call signature (without rope).

BEiT adds a learned bias ``B[h, n, m]`` (a table indexed by the relative position of tokens n and m) to the logits
of head h. It is additive to the logits and does not depend on the tokens' content, so it carries over unchanged
into collaborative attention (eq. 5 plus the same additive term): both layers pass it as the additive ``attn_mask``
of the layers they extend, with the signature of BEiT's layer, ``forward(x, shared_rel_pos_bias=None)``. EVA's blocks call their attention
as ``attn(x, rope=..., attn_mask=..., is_causal=...)``; a model without rotary embeddings passes ``rope=None``,
and its layers are timm's attention under that signature (a rope given to them is an error).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from timm.layers import Attention

from .attention import CollaborativeAttention


class RelPosBias:
    """Mixin: the relative position bias of BEiT (its table, index and window) and the mask it adds."""

    relative_position_bias_table: Optional[nn.Parameter]
    relative_position_index: Optional[torch.Tensor]

    def adopt_rel_pos(self, source: nn.Module) -> None:
        """Take ``source``'s table (the same parameter), index (a non-persistent buffer, as BEiT's) and window."""
        self.window_size = source.window_size
        self.relative_position_bias_table = source.relative_position_bias_table
        index = source.relative_position_index
        self.register_buffer("relative_position_index", None if index is None else index.clone(), persistent=False)

    def rel_pos_mask(self, shared_rel_pos_bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``(1, heads, N, N)``: the layer's bias (if it has a table) plus the model's shared one (if given)."""
        bias = shared_rel_pos_bias
        if self.relative_position_bias_table is not None:
            area = self.window_size[0] * self.window_size[1] + 1
            own = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(area, area, -1)
            own = own.permute(2, 0, 1).unsqueeze(0)
            bias = own if bias is None else own + bias
        return bias


class RelPosAttention(RelPosBias, Attention):
    """BEiT's attention written as timm's ``Attention`` (fused qkv bias ``[q_bias, 0, v_bias]``) plus its relative
    position bias: the same function, in the form ``reparametrize`` converts."""

    def forward(self, x: torch.Tensor, shared_rel_pos_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return super().forward(x, attn_mask=self.rel_pos_mask(shared_rel_pos_bias))


class CollaborativeRelPosAttention(RelPosBias, CollaborativeAttention):
    """Collaborative attention (eq. 5) plus BEiT's relative position bias, added to the logits unchanged."""

    def forward(self, x: torch.Tensor, shared_rel_pos_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return super().forward(x, attn_mask=self.rel_pos_mask(shared_rel_pos_bias))


class RopeFreeCall:
    """Mixin: ``forward(x, rope=None, attn_mask=None, is_causal=False)`` as EVA's blocks call it; ``rope`` must be
    None (the layer was converted from a model without rotary embeddings)."""

    def forward(self, x: torch.Tensor, rope: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        if rope is not None:
            raise ValueError(f"{type(self).__name__} was converted from a layer without rotary embeddings; got rope")
        return super().forward(x, attn_mask=attn_mask, is_causal=is_causal)


class EvaFormAttention(RopeFreeCall, Attention):
    """EVA's attention without rope (fused or separate q/k/v) written as timm's ``Attention``."""


class CollaborativeEvaFormAttention(RopeFreeCall, CollaborativeAttention):
    """Collaborative attention (eq. 5) under EVA's call signature."""

