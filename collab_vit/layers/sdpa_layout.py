"""Collaborative attention (eq. 5) as plain scaled dot-product attention, for torch's fused kernels.

The content bias folded into the product. With ``c(x)`` the content scores (B, N, Nh), extend the shared queries by
Nh ones, each mixing vector ``m_i`` by the one-hot ``e_i`` and the shared keys by ``c(x)``:

    q' = [q, 1],  m'_i = [m_i, e_i],  k' = [k, c(x)]   =>   (q' diag(m'_i)) . k'_m = (q diag(m_i)) . k_m + c_i . x_m

so head i is ordinary attention with queries ``q' diag(m'_i)``, keys ``k'`` shared by all heads (an expanded, stride-0
view) and the layer's scale passed explicitly: no additive mask (whose gradient would make the memory-efficient
kernel allocate a (B, Nh, N, N) buffer), widths zero-padded to a multiple of ``ALIGN`` (zero columns add nothing).

``pinned_sdpa`` runs that layout on one named kernel (``torch.nn.attention.sdpa_kernel``): the memory-efficient
(CUTLASS) kernel on CUDA, which takes q/k widths other than the value width and above 256. A case the kernel refuses
is not left to torch's silent fallback to the math kernel: it warns once, naming the reason, and the caller runs the
explicit path. In training a saved-tensor hook stores the recipe of the Nh x larger queries ``q' diag(m'_i)`` (the
shared ``q'`` and ``m'``) instead of the tensor, and recomputes it (one multiply) in backward. On CPU the layer
never dispatches here (``dispatch.select_path``); there it pins torch's CPU flash kernel, which takes only equal head
dims, so that the tests can check the pin, the refusal and the hook without a GPU.
"""

import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_efficient_attention
from torch.nn.attention import SDPBackend, sdpa_kernel

ALIGN = 8  # head-dim multiple the memory-efficient kernel needs for 16-bit inputs (4 for float32): sdp_utils.cpp

_WARNED: set = set()


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
    pad = (align - q.shape[-1] % align) % align
    if pad > 0:
        q, m, k = F.pad(q, (0, pad)), F.pad(m, (0, pad)), F.pad(k, (0, pad))
    return q, m, k


def head_queries(q_ext: torch.Tensor, m_ext: torch.Tensor) -> torch.Tensor:
    """``q' diag(m'_i)`` for every head: (B, Nh, N, W)."""
    return q_ext.unsqueeze(1) * m_ext.unsqueeze(1)


def shared_keys(k_ext: torch.Tensor, heads: int) -> torch.Tensor:
    """The shared keys as (B, Nh, N, W), a stride-0 view (no copy)."""
    return k_ext.unsqueeze(1).expand(-1, heads, -1, -1)


def sdpa_mask(attn_mask: Optional[torch.Tensor], is_causal: bool, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The mask to hand the kernel: none when causal (timm's precedence), else additive in the compute dtype (a
    boolean mask keeps where True, as SDPA's own conversion does), so that the eligibility check sees what the
    kernel gets."""
    if is_causal or attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        return torch.zeros_like(attn_mask, dtype=dtype).masked_fill_(~attn_mask, float("-inf"))
    return attn_mask.to(dtype)


def pinned_backend(device_type: str) -> SDPBackend:
    """The fused kernel ``pinned_sdpa`` runs on: memory-efficient on CUDA, torch's flash kernel on CPU."""
    return SDPBackend.EFFICIENT_ATTENTION if device_type == "cuda" else SDPBackend.FLASH_ATTENTION


def refusal(q2: torch.Tensor, k2: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], dropout_p: float,
            is_causal: bool) -> Optional[str]:
    """Why the pinned kernel cannot run this input, or None. On CUDA the final word is torch's own check
    (``torch.backends.cuda.can_use_efficient_attention``, which prints its reason); the named cases come first."""
    device = q2.device.type
    if device == "cuda":
        if q2.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"{q2.dtype} inputs (the memory-efficient kernel takes float16, bfloat16 and float32)"
        if not torch.backends.cuda.mem_efficient_sdp_enabled():
            return "the memory-efficient kernel is disabled (torch.backends.cuda.enable_mem_efficient_sdp(False))"
        try:
            params = SDPAParams(q2, k2, v, mask, dropout_p, is_causal, False)
        except TypeError:  # torch < 2.5: no enable_gqa argument
            params = SDPAParams(q2, k2, v, mask, dropout_p, is_causal)
        if not can_use_efficient_attention(params, True):
            return (f"torch.backends.cuda.can_use_efficient_attention refused queries {tuple(q2.shape)} "
                    f"{q2.dtype}, values {tuple(v.shape)} (torch printed its reason above)")
        return None
    if device == "cpu":
        if q2.shape[-1] != v.shape[-1]:
            return f"CPU flash needs equal query and value head dims, got {q2.shape[-1]} and {v.shape[-1]}"
        if dropout_p > 0:
            return "CPU flash has no dropout"
        if mask is not None and mask.requires_grad and torch.is_grad_enabled():
            return "CPU flash has no gradient for the attention mask"
        return None
    return f"no fused kernel is pinned on {device} tensors"


def warn_once(message: str) -> None:
    """One ``UserWarning`` per distinct message for the life of the process."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


def _tensor_key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype


class _Recompute:
    """Placeholder autograd stores instead of the Nh x larger queries."""


def pinned_sdpa(q_ext: torch.Tensor, m_ext: torch.Tensor, k_ext: torch.Tensor, v: torch.Tensor, scale: float,
                attn_mask: Optional[torch.Tensor], is_causal: bool, dropout_p: float) -> Optional[torch.Tensor]:
    """Attention of the folded layout on the pinned fused kernel; None (after one warning) where it refuses.

    With gradients, autograd stores the shared ``q'`` and ``m'`` instead of ``q' diag(m'_i)``. A saved tensor of the
    queries' shape that is not them (a copy made on the way, e.g. by a cast) is reported with a warning: the memory
    saving would be lost, and silently is what the layer must not do.
    """
    q2, k2 = head_queries(q_ext, m_ext), shared_keys(k_ext, m_ext.shape[0])
    mask = sdpa_mask(attn_mask, is_causal, q2.dtype)
    reason = refusal(q2, k2, v, mask, dropout_p, is_causal)
    if reason is not None:
        warn_once(f"collab_vit: the fused attention kernel cannot run this input: {reason}; CollaborativeAttention "
                  f"runs the explicit path instead (it stores the (B, heads, N, N) attention weights)")
        return None
    backend = pinned_backend(q2.device.type)
    if not (torch.is_grad_enabled() and q2.requires_grad):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q2, k2, v, attn_mask=mask, dropout_p=dropout_p,
                                                  is_causal=is_causal, scale=scale)
    # The hooks live as long as the graph (torch keeps both with each saved tensor): they must not hold q2 itself.
    recipe_key, queries_shape = _tensor_key(q2), tuple(q2.shape)
    shared_q, shared_m = q_ext.detach(), m_ext.detach()
    copies: list[tuple[int, torch.dtype]] = []

    def pack(tensor: torch.Tensor) -> object:
        if _tensor_key(tensor) == recipe_key:
            return _Recompute
        if tuple(tensor.shape) == queries_shape:
            copies.append((tensor.untyped_storage().data_ptr(), tensor.dtype))
        return tensor

    def unpack(packed: object) -> torch.Tensor:
        return head_queries(shared_q, shared_m) if packed is _Recompute else packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q2, k2, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                             scale=scale)
    legitimate = {t.untyped_storage().data_ptr() for t in (out, v, k_ext)}  # output, values, stride-0 keys
    for storage, dtype in copies:
        if storage not in legitimate:
            warn_once(f"collab_vit: autograd stored a {queries_shape} {dtype} copy of the per-head queries or keys "
                      f"(inputs {q2.dtype}): the layer's memory saving is lost")
    return out
