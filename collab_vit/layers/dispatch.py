"""Which implementation of collaborative attention (eq. 5) runs: the one place that decides (README, Performance).

* ``core``: ``attention_core.CollaborativeCore`` -- CPU; grouped matmuls or CPU flash, stores only the shared
  queries/keys and the row log-sum-exp, recomputes the weights in backward; no dropout.
* ``sdpa-pinned``: ``sdpa_layout.pinned_sdpa`` -- the folded layout on the memory-efficient kernel, pinned; the
  Nh x larger queries recomputed in backward. Where the kernel refuses an input: one warning, then ``explicit``.
* ``sdpa``: the folded layout through ``F.scaled_dot_product_attention`` with torch's own kernel choice (zero-padded
  to equal head dims on CPU for its flash kernel); what TorchScript and ``torch.compile`` see (there the compiler
  decides what to store).
* ``explicit``: ``softmax(q_i k^T * scale + mask) v`` written out, as timm's ``Attention`` without ``fused_attn``.
"""

import enum


class Path(enum.Enum):
    """The implementations; the values are the names the README's table uses."""
    CORE = "core"
    SDPA_PINNED = "sdpa-pinned"
    SDPA = "sdpa"
    EXPLICIT = "explicit"


def select_path(device_type: str, fused: bool, dropout_p: float, scripting: bool, compiling: bool) -> Path:
    """The implementation for one call of ``CollaborativeAttention``.

    ``fused`` is timm's ``fused_attn`` switch (``TIMM_FUSED_ATTN=0`` turns it off); ``dropout_p`` the attention
    dropout in effect (0 in eval); ``scripting``/``compiling``: inside ``torch.jit.script`` / ``torch.compile``.
    Training and inference take the same path. Second-order gradients (``create_graph=True``) through ``core``
    differentiate the explicit product inside its backward; ``sdpa-pinned`` raises there (torch's kernel has no
    double backward).
    """
    if not fused:
        return Path.EXPLICIT
    if scripting or compiling:
        return Path.SDPA
    if device_type == "cpu":  # with dropout, SDPA on CPU takes its math kernel (CPU flash has none): as explicit
        return Path.CORE if dropout_p == 0. else Path.EXPLICIT
    if device_type == "cuda":
        return Path.SDPA_PINNED
    return Path.SDPA
