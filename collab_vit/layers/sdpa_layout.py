"""Collaborative attention (eq. 5) as plain scaled dot-product attention: the layout of the ``sdpa`` route.

The content bias folded into the product. With ``c(x)`` the content scores (B, N, Nh), extend the shared queries by
Nh ones, each mixing vector ``m_i`` by the one-hot ``e_i`` and the shared keys by ``c(x)``:

    q' = [q, 1],  m'_i = [m_i, e_i],  k' = [k, c(x)]   =>   (q' diag(m'_i)) . k'_m = (q diag(m_i)) . k_m + c_i . x_m

so head i is ordinary attention with queries ``q' diag(m'_i)``, keys ``k'`` shared by all heads (an expanded, stride-0
view) and the layer's scale passed explicitly: no additive mask (whose gradient would make a fused kernel allocate a
(B, Nh, N, N) buffer), widths zero-padded to a multiple of ``ALIGN`` (``aligned``; zero columns add nothing). The
rotary layer pads its shared queries, keys and mixing with the same ``aligned``. ``dispatch.folded_sdpa``
hands it to SDPA, whose kernel is torch's choice.
"""

from typing import Optional

import torch
import torch.nn.functional as F

ALIGN = 8  # head-dim multiple the memory-efficient kernel needs for 16-bit inputs (4 for float32): sdp_utils.cpp


def folded_layout(q: torch.Tensor, mixing: torch.Tensor, k: torch.Tensor, content: Optional[torch.Tensor],
                  align: int = ALIGN) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shared queries ``q'`` (B, N, W), mixing ``m'`` (Nh, W) and shared keys ``k'`` (B, N, W) of the folded layout.

    ``W`` is ``D~k`` (+ Nh with a content bias) rounded up to a multiple of ``align``; everything is in q's dtype.
    """
    B, N, _ = q.shape
    heads = mixing.shape[0]
    m = mixing.to(q.dtype)
    if content is not None:
        q = torch.cat([q, q.new_ones(B, N, heads)], dim=-1)
        m = torch.cat([m, torch.eye(heads, dtype=q.dtype, device=q.device)], dim=-1)
        k = torch.cat([k, content.to(q.dtype)], dim=-1)
    return aligned(q, align), aligned(m, align), aligned(k, align)


def aligned(x: torch.Tensor, align: int = ALIGN, width: int = -1) -> torch.Tensor:
    """``x`` with its last dim zero-padded to a multiple of ``align`` (itself when it already is one): the width a
    fused CUDA kernel takes. Exact for queries, keys and mixing alike: zero columns add nothing to the logits.
    ``width``: the last dim where the caller knows it as a plain int (so that torch.fx can trace the layer)."""
    pad = (align - (x.shape[-1] if width < 0 else width) % align) % align
    return F.pad(x, (0, pad)) if pad else x


def head_queries(q_ext: torch.Tensor, m_ext: torch.Tensor) -> torch.Tensor:
    """``q' diag(m'_i)`` for every head: (B, Nh, N, W)."""
    return q_ext.unsqueeze(1) * m_ext.unsqueeze(1)


def shared_keys(k_ext: torch.Tensor, heads: int) -> torch.Tensor:
    """The shared keys as (B, Nh, N, W), a stride-0 view (no copy)."""
    return k_ext.unsqueeze(1).expand(-1, heads, -1, -1)

