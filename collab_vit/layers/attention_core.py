"""Eq. 5 on the CPU: ``softmax(scale * (q diag(m_i)) k^T + mask) v_i`` for every head i, and eq. 5 written out.

All heads share the queries ``q`` and keys ``k`` (B, N, D~k); head i only re-weights the shared dims with ``m_i``. So
the logits of all heads are ONE batched matmul ``(B, Nh*N, D~k) @ (B, D~k, N)``, and in backward the key gradient's
sum over heads is the contraction of that same matmul. ``CollaborativeCore`` saves only the small tensors (shared
queries and keys, mixing, values, mask, output and the row log-sum-exp); the (B, Nh, N, N) weights and the Nh x larger
mixed queries exist only transiently, in forward and again in backward. Why each choice: ``benchmarks/attention_notes.md``.

Precision: the products run in the inputs' (compute) dtype, bfloat16 under autocast; the softmax statistics (logits,
row log-sum-exp, ``rowsum(dO * O)``) and the accumulations across chunks (mixing and mask gradients) are float32 at
least (``stats_dtype``). Autocast is off inside the core: it does exactly the casts written here.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from timm.layers.attention import maybe_add_mask, resolve_self_attn_mask


def has_cpu_flash() -> bool:
    """Whether this torch has the private op of its CPU flash kernel that returns the row log-sum-exp, taking an
    additive ``attn_mask`` as ``flash_forward`` calls it."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    return op is not None and "attn_mask" in str(op.default._schema)


CPU_FLASH = has_cpu_flash()  # the one feature check; without the op the core's forward is the grouped matmuls
CHUNK_BYTES = 4 << 20  # working set of one chunk's (c, Nh, N, N) weights: stays in cache and in reused heap blocks


def flash_pays(key_dim: int, head_dim: int) -> bool:
    """Whether the core's forward takes CPU flash (head dims zero-padded to equal width) over the grouped matmuls:
    at key dims up to twice the value head dim."""
    return key_dim <= 2 * head_dim


def equal_head_dims(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero-pad q/k or v to equal head dims, as torch's CPU flash kernel needs them.

    Exact: zero q/k columns add nothing to the logits; zero v columns give zero outputs, sliced off afterwards.
    """
    e, ev = q.shape[-1], v.shape[-1]
    if e > ev:
        return q, k, F.pad(v, (0, e - ev))
    if e < ev:
        return F.pad(q, (0, ev - e)), F.pad(k, (0, ev - e)), v
    return q, k, v


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of softmax statistics and accumulations: float32 for 16-bit inputs, else the inputs' own."""
    return torch.promote_types(dtype, torch.float32)


def scaled_mixing(mixing: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``scale * m_i`` for every head, in the compute dtype (Nh x D~k: the only cast the mixing matrix needs)."""
    return (mixing.to(stats_dtype(mixing.dtype)) * scale).to(dtype)


def mixed_queries(q: torch.Tensor, mixing_scaled: torch.Tensor) -> torch.Tensor:
    """``scale * q diag(m_i)`` for every head (eq. 5), as (B, Nh, N, D~k) in q's dtype."""
    return q.unsqueeze(1) * mixing_scaled.unsqueeze(1)


def explicit_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, attn_mask: Optional[torch.Tensor],
                    is_causal: bool, dropout_p: float) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` written out, as timm's ``Attention`` without ``fused_attn``.

    The logits, mask and softmax are in ``stats_dtype`` (float32 for 16-bit inputs); the weights meet ``v`` in its
    dtype. Differentiable to any order.
    """
    attn = ((q * scale) @ k.transpose(-2, -1)).to(stats_dtype(q.dtype))
    attn = maybe_add_mask(attn, resolve_self_attn_mask(q.shape[-2], attn, attn_mask, is_causal))
    return F.dropout(attn.softmax(dim=-1), dropout_p).to(v.dtype) @ v


def content_mask(content: Optional[torch.Tensor], scale: float, attn_mask: Optional[torch.Tensor], is_causal: bool,
                 seq_len: int, like: torch.Tensor) -> Optional[torch.Tensor]:
    """The content bias ``scale * c_i . x_m`` as an additive (B, Nh, 1, N) mask, merged with the caller's mask.

    Constant along a query row of head i; the merged mask follows timm's semantics (``is_causal`` wins).
    """
    if content is None:
        return resolve_self_attn_mask(seq_len, like, attn_mask, is_causal)
    bias = content.transpose(1, 2).unsqueeze(2) * scale  # (B, Nh, 1, N)
    return maybe_add_mask(bias, resolve_self_attn_mask(seq_len, bias, attn_mask, is_causal))


def collaborative_logits(q: torch.Tensor, mixing: torch.Tensor, k: torch.Tensor, mask: Optional[torch.Tensor],
                         scale: float) -> torch.Tensor:
    """Eq. 5's logits of every head, ``(B, Nh, N, N)`` in ``stats_dtype``: ``scale * (q diag(m_i)) k^T + mask``.

    ``q``, ``k``: shared queries and keys (B, N, D~k); ``mixing`` (Nh, D~k); ``mask``: additive, the content bias
    ``scale * c_i . x_m`` included (``content_mask``). The one written-out form of the logits: the explicit
    route, the core's double backward, the layer's ``logits`` and the conversion's measures all come here.
    """
    return logits(mixed_queries(q, scaled_mixing(mixing, scale, q.dtype)), k, mask)


def explicit_collaborative(q: torch.Tensor, mixing: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: Optional[torch.Tensor], scale: float, dropout_p: float = 0.) -> torch.Tensor:
    """Eq. 5 written out: the softmax of ``collaborative_logits`` (float32 at least) times the values."""
    weights = collaborative_logits(q, mixing, k, mask, scale).softmax(dim=-1)
    return F.dropout(weights, dropout_p).to(v.dtype) @ v


def logits(q_mixed: torch.Tensor, k: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """``q_i k^T + mask`` of all heads in one ``bmm`` over (B, Nh*N, D~k): a new (B, Nh, N, N) tensor.

    The product runs in the compute dtype (float32 accumulation); the result is in ``stats_dtype`` (no copy at
    float32/float64), so the mask and the softmax statistics are added and taken at full precision.
    """
    B, H, N, e = q_mixed.shape
    scores = torch.bmm(q_mixed.reshape(B, H * N, e), k.transpose(1, 2)).view(B, H, N, k.shape[1])
    scores = scores.to(stats_dtype(scores.dtype))
    return scores if mask is None else scores.add_(mask)


def flash_forward(q: torch.Tensor, mixing_scaled: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and row log-sum-exp of one chunk from torch's CPU flash kernel, zero-padding head dims to equal width
    (exact). CPU flash keeps float32 statistics for 16-bit inputs and returns a float32 lse."""
    ev = v.shape[-1]
    q_mixed = mixed_queries(q, mixing_scaled)
    q_mixed, keys, v = equal_head_dims(q_mixed, k.unsqueeze(1).expand(-1, q_mixed.shape[1], -1, -1), v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q_mixed, keys, v, attn_mask=mask, scale=1.)
    return out[..., :ev], lse


def grouped_forward(q: torch.Tensor, mixing_scaled: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and row log-sum-exp of one chunk by the grouped matmuls: the logits of all heads in one ``bmm``
    (``logits``; the mixed queries are freed before the softmax), then ``exp(logits - lse) v``."""
    scores = logits(mixed_queries(q, mixing_scaled), k, mask)
    row_lse = torch.logsumexp(scores, dim=-1)
    return scores.sub_(row_lse.unsqueeze(-1)).exp_().to(v.dtype) @ v, row_lse


def batch_chunks(batch: int, heads: int, queries: int, keys: int) -> list[slice]:
    """Slices of the batch whose attention weights take about ``CHUNK_BYTES`` each (at least one sample)."""
    per_sample = heads * queries * keys * 4
    step = max(1, CHUNK_BYTES // per_sample)
    return [slice(i, min(i + step, batch)) for i in range(0, batch, step)]


def mask_rows(mask: Optional[torch.Tensor], rows: slice, batch: int) -> Optional[torch.Tensor]:
    """The part of a broadcastable additive mask that applies to the batch rows ``rows``."""
    if mask is None or mask.dim() < 4 or mask.shape[0] != batch or batch == 1:
        return mask
    return mask[rows]


def core_forward(q: torch.Tensor, mixing: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output (B, Nh, N, dh) and row log-sum-exp (B, Nh, N): ``flash_forward`` on CPU where it pays and
    exists, else ``grouped_forward`` (``dispatch``'s table).

    Works through the batch in chunks (``batch_chunks``). The output is laid out as (B, N, Nh, dh), so merging the
    heads afterwards is a view: autograd then saves one tensor (this output) where it would save two.
    """
    B, N, _ = q.shape
    H, ev = mixing.shape[0], v.shape[-1]
    if mask is not None and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    out = q.new_empty(B, N, H, ev).transpose(1, 2)
    lse = q.new_empty(B, H, N, dtype=stats_dtype(q.dtype))
    use_flash = CPU_FLASH and q.device.type == "cpu" and flash_pays(q.shape[-1], ev)
    mixing_scaled = scaled_mixing(mixing, scale, q.dtype)
    chunk_forward = flash_forward if use_flash else grouped_forward
    for rows in batch_chunks(B, H, N, k.shape[1]):
        out[rows], lse[rows] = chunk_forward(q[rows], mixing_scaled, k[rows], v[rows], mask_rows(mask, rows, B))
    return out, lse


class CollaborativeCore(torch.autograd.Function):
    """Eq. 5 attention whose backward recomputes the weights ``P = exp(logits - lse)`` instead of storing them.

    Backward, with ``dS = P * (dO v^T - rowsum(dO * O))`` (softmax), ``Q_i = scale * q diag(m_i)`` (eq. 5):
    ``dv = P^T dO``; ``dq = sum_i (dS_i k) diag(scale m_i)``; ``dm_i = scale * sum_{b,n} (dS_i k) * q``;
    ``dk = sum_i dS_i^T Q_i`` (one matmul over the stacked heads); ``dmask = dS`` summed to the mask's shape.
    Forward and backward both work through the batch in chunks (``batch_chunks``).

    Second order (``create_graph=True``: gradient penalties, Hessian-vector products): that backward is not itself
    differentiable (the saved lse is cut from the graph), so there it differentiates ``explicit_collaborative`` on the
    saved inputs instead: exact double backward, at the explicit route's memory.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, mixing: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        with torch.autocast(q.device.type, enabled=False):
            out, lse = core_forward(q, mixing, k, v, scale, mask)
        ctx.scale = scale
        ctx.save_for_backward(q, mixing, k, v, mask, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        if torch.is_grad_enabled():  # create_graph=True
            return CollaborativeCore.differentiable_backward(ctx, grad_out)
        q, mixing, k, v, mask, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            grads = core_backward(q, mixing, k, v, mask, out, lse, grad_out.to(out.dtype), ctx.scale,
                                  ctx.needs_input_grad)
        return grads + (None,)

    @staticmethod
    def differentiable_backward(ctx, grad_out: torch.Tensor):
        q, mixing, k, v, mask, _, _ = ctx.saved_tensors
        needs = ctx.needs_input_grad[:5]
        inputs = [t for t, need in zip((q, mixing, k, v, mask), needs) if need]
        with torch.autocast(q.device.type, enabled=False):
            out = explicit_collaborative(q, mixing, k, v, mask, ctx.scale)
        grads = iter(torch.autograd.grad(out, inputs, grad_out, create_graph=True))
        return tuple(next(grads) if need else None for need in needs) + (None,)


def core_backward(q: torch.Tensor, mixing: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
                  scale: float, needs_input_grad: tuple) -> tuple:
    """Gradients of ``CollaborativeCore`` (formulas in its docstring), chunk by chunk; None where not needed."""
    need_q, need_m, need_k, need_v, need_mask = needs_input_grad[:5]
    B, H, N, _ = out.shape
    acc = stats_dtype(q.dtype)
    mixing_scaled = scaled_mixing(mixing, scale, q.dtype)
    compute_mask = None if mask is None else mask.to(q.dtype)
    grad_q = torch.zeros_like(q) if need_q else None
    grad_k = torch.zeros_like(k) if need_k else None
    grad_v = torch.zeros_like(v) if need_v else None
    grad_m = torch.zeros_like(mixing, dtype=acc) if need_m else None
    grad_mask = q.new_zeros(mask.shape, dtype=acc) if need_mask else None
    for rows in batch_chunks(B, H, N, k.shape[1]):
        b = rows.stop - rows.start
        q_rows, k_rows, d_out = q[rows], k[rows], grad_out[rows]
        q_mixed = mixed_queries(q_rows, mixing_scaled)
        weights = logits(q_mixed, k_rows, mask_rows(compute_mask, rows, B)).sub_(lse[rows].unsqueeze(-1)).exp_()
        if need_v:
            grad_v[rows] = weights.to(v.dtype).transpose(-2, -1) @ d_out
        delta = (d_out.to(acc) * out[rows]).sum(-1, keepdim=True)
        grad_scores = (d_out @ v[rows].transpose(-2, -1)).to(acc).sub_(delta).mul_(weights)  # dS
        del weights
        if need_mask:
            part = mask_rows(grad_mask, rows, B)
            part += grad_scores.sum_to_size(part.shape)
        stacked = grad_scores.to(q.dtype).view(b, H * N, N)
        del grad_scores
        if need_k:
            grad_k[rows] = torch.bmm(stacked.transpose(1, 2), q_mixed.view(b, H * N, -1))
        del q_mixed
        if need_q or need_m:
            grad_mixed = torch.bmm(stacked, k_rows).view(b, H, N, -1)  # d logits / d Q_i, (b, Nh, N, D~k)
            if need_q:
                grad_q[rows] = (grad_mixed * mixing_scaled.unsqueeze(1)).sum(1)
            if need_m:
                grad_m += (grad_mixed * q_rows.unsqueeze(1)).sum((0, 2), dtype=acc)
    if need_m:
        grad_m = grad_m.mul_(scale).to(mixing.dtype)
    if need_mask:
        grad_mask = grad_mask.to(mask.dtype)
    return grad_q, grad_m, grad_k, grad_v, grad_mask
