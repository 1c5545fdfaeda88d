"""Which implementation of collaborative attention (eq. 5) runs: the one place that decides (README, Performance).

* ``core``: ``attention_core.CollaborativeCore`` -- CPU; grouped matmuls or CPU flash, stores only the shared
  queries/keys and the row log-sum-exp, recomputes the weights in backward; no dropout.
* ``sdpa-pinned``: ``sdpa_layout.pinned_sdpa`` -- the folded layout on the memory-efficient kernel, pinned; the
  Nh x larger queries recomputed in backward. Where the kernel refuses an input: one warning, then ``explicit``.
* ``sdpa``: the folded layout through ``F.scaled_dot_product_attention`` with torch's own kernel choice (zero-padded
  to equal head dims on CPU for its flash kernel); what graph capture sees: ``torch.jit.script``/``trace``, the
  ONNX exporters, ``torch.export`` and ``torch.compile`` (there the compiler decides what to store).
* ``explicit``: ``softmax(q_i k^T * scale + mask) v`` written out, as timm's ``Attention`` without ``fused_attn``.
"""

import enum


class Path(enum.Enum):
    """The implementations; the values are the names the README's table uses."""
    CORE = "core"
    SDPA_PINNED = "sdpa-pinned"
    SDPA = "sdpa"
    EXPLICIT = "explicit"


def select_path(device_type: str, fused: bool, dropout_p: float, scripting: bool, compiling: bool,
                tracing: bool) -> Path:
    """The implementation for one call of ``CollaborativeAttention``.

    ``fused`` is timm's ``fused_attn`` switch (``TIMM_FUSED_ATTN=0`` turns it off); ``dropout_p`` the attention
    dropout in effect (0 in eval); ``scripting``/``compiling``/``tracing``: inside ``torch.jit.script`` /
    ``torch.compile`` or ``torch.export`` (also the dynamo ONNX exporter) / ``torch.jit.trace`` (also the
    TorchScript-based ONNX exporter, ``torch.onnx.export(dynamo=False)`` and timm's ``onnx_export``).
    Graph capture never takes ``core`` or ``sdpa-pinned``: ``core`` is an autograd Function, which a trace records
    as a call back into Python (``prim::PythonOp``: the traced module cannot be saved) and the TorchScript ONNX
    exporter inlines, losing the writes into the output it preallocates (the graph had no attention at all: logits
    off by 0.9 of their max); ``sdpa-pinned`` decides in Python (kernel eligibility, the fallback) at capture time.
    Training and inference take the same path. Second-order gradients (``create_graph=True``) through ``core``
    differentiate the explicit product inside its backward; ``sdpa-pinned`` raises there (torch's kernel has no
    double backward).
    """
    if not fused:
        return Path.EXPLICIT
    if scripting or compiling or tracing:
        return Path.SDPA
    if device_type == "cpu":  # with dropout, SDPA on CPU takes its math kernel (CPU flash has none): as explicit
        return Path.CORE if dropout_p == 0. else Path.EXPLICIT
    if device_type == "cuda":
        return Path.SDPA_PINNED
    return Path.SDPA
