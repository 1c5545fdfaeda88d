"""Which function computes an attention call (eq. 5, and the concatenate baseline): the one table, and the routes.

The route of one call of ``CollaborativeAttention`` (``select_path``):

| device | fused_attn | attention dropout | graph capture | route |
|---|---|---|---|---|
| CPU | True | 0 | no | `core` |
| CPU | True | > 0 | any | `explicit` |
| CPU | True | any | yes | `explicit` |
| CUDA, other | True | any | any | `sdpa` |
| any | False | any | any | `explicit` |

Every forward and backward implementation a call can reach, and the condition that picks it (an implementation
named without its module is in this one; ``attention_core`` holds the CPU core, its ``CPU_FLASH`` and ``flash_pays``,
and eq. 5 written out):

| layer | route | pass | condition | implementation |
|---|---|---|---|---|
| collab | `core` | forward | CPU, `CPU_FLASH`, `flash_pays` | `core_attend`, `attention_core.flash_forward` |
| collab | `core` | forward | otherwise | `core_attend`, `attention_core.grouped_forward` |
| collab | `core` | backward | no `create_graph` | `attention_core.core_backward` |
| collab | `core` | backward | `create_graph=True` | `attention_core.CollaborativeCore.differentiable_backward` |
| collab | `sdpa` | forward | any | `folded_sdpa`, `fused_attend` |
| collab | `sdpa` | backward | any | torch's, of the SDPA kernel that ran |
| collab | `explicit` | forward | any | `attention_core.explicit_collaborative` |
| collab | `explicit` | backward | any | autograd |
| concat | `sdpa` | forward | `fused_attn` | `fused_attend` |
| concat | `sdpa` | backward | `fused_attn` | torch's, of the SDPA kernel that ran |
| concat | `explicit` | forward | not `fused_attn` | `attention_core.explicit_attend` |
| concat | `explicit` | backward | not `fused_attn` | autograd |

* ``core``: ``attention_core.CollaborativeCore``, an autograd Function: the logits of all heads in one grouped matmul
  (``grouped_forward``), or torch's CPU flash kernel on zero-padded head dims where the key dim is small
  (``flash_forward``); it stores only the shared queries/keys and the row log-sum-exp and recomputes the weights in
  backward (``core_backward``); no dropout. Second order: ``differentiable_backward`` differentiates
  ``explicit_collaborative`` on the saved inputs (``core_backward`` is not itself differentiable). The batch is worked
  through in chunks (``attention_core.batch_chunks``: same arithmetic per element).
* ``sdpa``: ``folded_sdpa``, the content bias folded into the product (``sdpa_layout.folded_layout``), through
  ``fused_attend``: ``F.scaled_dot_product_attention`` with torch's kernel choice; one function on every device (the
  CPU tests force it). On CPU ``fused_attend`` zero-pads the head dims to equal width (``equal_head_dims``, exact), as
  torch's CPU flash kernel needs them; elsewhere the query/key width to a multiple of 8 (``sdpa_layout.aligned``), as
  CUDA's fused kernels need it under 16-bit inputs (the folded layout and the rotary layer arrive aligned).
* ``explicit``: eq. 5 written out (timm's ``Attention`` without ``fused_attn``); differentiable to any order,
  traceable, exportable.

Dtypes, every route: ``collaborative_attend`` casts the inputs and a float mask to the compute dtype
(``compute_dtype``: autocast's where it is on, else q's); ``fused_attend`` casts a float mask to q's dtype (SDPA
refuses a float32 mask on bfloat16 queries); softmax statistics and accumulations are float32 at least
(``attention_core.stats_dtype``).

Graph capture is ``torch.jit.script``/``trace`` (and the TorchScript ONNX exporter, timm's ``onnx_export``),
``torch.compile`` and ``torch.export`` (and the dynamo ONNX exporter). It never takes ``core``: an autograd Function is
recorded by a trace as a call back into Python (``prim::PythonOp``: the traced module cannot be saved) and the
TorchScript ONNX exporter inlined it, losing the writes into the output it preallocates. The measurement or reason
behind each row: ``benchmarks/attention_notes.md`` (*Every route and what earns it*); on a GPU,
``benchmarks/gpu_check.py`` times every route.
"""

import enum
from typing import Optional

import torch
import torch.nn.functional as F
from timm.models import register_notrace_function

from .attention_core import CollaborativeCore, content_mask, equal_head_dims, explicit_attend, explicit_collaborative
from .sdpa_layout import aligned, folded_layout, head_queries, shared_keys


class Path(enum.Enum):
    """The routes; the values are the names the table uses."""
    CORE = "core"
    SDPA = "sdpa"
    EXPLICIT = "explicit"


def select_path(device_type: str, fused: bool, dropout_p: float, capturing: bool) -> Path:
    """The route of one call of ``CollaborativeAttention`` (the module's first table).

    ``fused`` is timm's ``fused_attn`` switch (``TIMM_FUSED_ATTN=0`` turns it off); ``dropout_p`` the attention dropout
    in effect (0 in eval); ``capturing``: inside graph capture (module docstring).
    """
    if not fused:
        return Path.EXPLICIT
    if device_type != "cpu":
        return Path.SDPA
    return Path.CORE if dropout_p == 0. and not capturing else Path.EXPLICIT


@torch.fx.wrap
@register_notrace_function
def fused_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, attn_mask: Optional[torch.Tensor],
                 is_causal: bool, dropout_p: float) -> torch.Tensor:
    """``scaled_dot_product_attention``, head dims zero-padded (exact): on CPU to equal width for torch's flash
    kernel, elsewhere the query/key width to a multiple of ``sdpa_layout.ALIGN`` (``aligned``), which CUDA's fused
    kernels need under 16-bit inputs (else SDPA silently takes its math kernel). The collaborative layers hand it
    widths already aligned, so their stride-0 shared keys stay a view.

    A float mask is cast to q's dtype (SDPA refuses a float32 mask on bfloat16 queries).
    """
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.to(q.dtype)
    value_dim = v.shape[-1]
    if q.device.type == "cpu":
        q, k, v = equal_head_dims(q, k, v)
    else:
        q, k = aligned(q), aligned(k)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    return out[..., :value_dim]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, attn_mask: Optional[torch.Tensor],
           is_causal: bool, dropout_p: float, fused: bool) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` per head (the concatenate layer), with the mask semantics of timm's
    ``Attention``: ``fused_attend`` (SDPA) when ``fused``, else the explicit product (same result)."""
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


def folded_sdpa(q: torch.Tensor, mixing: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                content: Optional[torch.Tensor], scale: float, attn_mask: Optional[torch.Tensor], is_causal: bool,
                dropout_p: float) -> torch.Tensor:
    """The ``sdpa`` route: the folded layout (``sdpa_layout``) through ``fused_attend``; the same function on every
    device, torch (or the compiler) picks the kernel."""
    q_ext, m_ext, k_ext = folded_layout(q, mixing, k, content)
    q2, k2 = head_queries(q_ext, m_ext), shared_keys(k_ext, m_ext.shape[0])
    return fused_attend(q2, k2, v, scale, attn_mask, is_causal, dropout_p)


@torch.jit.unused
def core_attend(q: torch.Tensor, mixing: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """The ``core`` route: ``CollaborativeCore`` (eager only: graph capture never takes it)."""
    return CollaborativeCore.apply(q, mixing, k, v, mask, scale)


@torch.fx.wrap
@register_notrace_function
def collaborative_attend(q: torch.Tensor, mixing: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         content: Optional[torch.Tensor], scale: float, attn_mask: Optional[torch.Tensor],
                         is_causal: bool, dropout_p: float, fused: bool) -> torch.Tensor:
    """Eq. 5 attention of all heads: (B, Nh, N, dh), by the route ``select_path`` names.

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
