"""Which route computes collaborative attention (eq. 5): the one table, and ``select_path`` that reads it.

| device | fused_attn | attention dropout | graph capture | route |
|---|---|---|---|---|
| CPU | True | 0 | no | `core` |
| CPU | True | > 0 | any | `explicit` |
| CPU | True | any | yes | `explicit` |
| CUDA, other | True | any | any | `sdpa` |
| any | False | any | any | `explicit` |

* ``core``: ``attention_core.CollaborativeCore``, an autograd Function: one grouped matmul for the logits of all
  heads (CPU flash where the key dim is small), stores only the shared queries/keys and the row log-sum-exp and
  recomputes the weights in backward; no dropout. Second order differentiates ``explicit`` inside its backward.
* ``sdpa``: ``sdpa_layout.folded_sdpa``, the content bias folded into the product and ``F.scaled_dot_product_attention``
  with torch's kernel choice; one function on every device (the CPU tests force it).
* ``explicit``: ``attention_core.explicit_collaborative``, eq. 5 written out (timm's ``Attention`` without
  ``fused_attn``); differentiable to any order, traceable, exportable.

Graph capture is ``torch.jit.script``/``trace`` (and the TorchScript ONNX exporter, timm's ``onnx_export``),
``torch.compile`` and ``torch.export`` (and the dynamo ONNX exporter). It never takes ``core``: an autograd Function is
recorded by a trace as a call back into Python (``prim::PythonOp``: the traced module cannot be saved) and the
TorchScript ONNX exporter inlined it, losing the writes into the output it preallocates. Measurements behind the
table: ``benchmarks/attention_notes.md``; on a GPU, ``benchmarks/gpu_check.py`` times every route.
"""

import enum


class Path(enum.Enum):
    """The routes; the values are the names the table uses."""
    CORE = "core"
    SDPA = "sdpa"
    EXPLICIT = "explicit"


def select_path(device_type: str, fused: bool, dropout_p: float, capturing: bool) -> Path:
    """The route of one call of ``CollaborativeAttention`` (the module's table).

    ``fused`` is timm's ``fused_attn`` switch (``TIMM_FUSED_ATTN=0`` turns it off); ``dropout_p`` the attention dropout
    in effect (0 in eval); ``capturing``: inside graph capture (module docstring).
    """
    if not fused:
        return Path.EXPLICIT
    if device_type != "cpu":
        return Path.SDPA
    return Path.CORE if dropout_p == 0. and not capturing else Path.EXPLICIT
