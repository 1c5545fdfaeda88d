"""Key dims per layer (section 3.3): one for every layer, one per layer, or None (each layer's full rank: exact).

:func:`check_spec` reads a ``key_dim`` once where it enters (``reparametrize``'s argument, ``collab-vit convert
--key-dim``); :func:`layer_dims` gives one key dim per layer from it, for standard and rotary layers alike, and is the
only resolver the conversion paths call. What was removed from the public surface because no measurement kept it
answers with the one line of :data:`REMOVED`, naming what replaced it (the numbers: RESULTS_HISTORY.md, "Options
removed from the public surface").
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch.nn as nn

from ...checks import is_integer, is_number, positive_int
from ...layers.construction import full_rank

KeyDimSpec = Union[None, int, Sequence[int]]

# one line each: what left the public surface, the measurement that removed it, what replaced it
REMOVED: dict[str, str] = {
    "budget": "budget key dims were removed (measured no better than one key dim for every layer: RESULTS.md (b)); "
              "give --key-dim K or a per-layer list K1,K2,... (key_dim=K or a list in Python)",
    "threshold": "energy-threshold key dims were removed (no measurement showed one beating a key dim at equal q/k "
                 "parameters on two sources: RESULTS.md (b)); give --key-dim K or a per-layer list (collab-vit "
                 "analyze --threshold suggests K)",
    "method": "the decomposition method is no longer an option: every conversion uses Tucker (cp measured slower, "
              "157.6 s against 56.2 s on DeiT-B: docs/performance.md); drop --method (method= and conversion_method= in "
              "Python)",
    "thorough": "effort 'thorough' (the whole-model refinement) was removed (better in one cell at about 20 times "
                "--effort full's compute: RESULTS_HISTORY.md); use the default effort (the blockwise refinement) or "
                "'fast'",
    "reparametrize_layers": "reparametrize_layers was removed: use collab_vit.reparametrize(model, key_dim, "
                            "calibration=..., return_report=True)",
    "Budget": "Budget was removed with budget key dims (no better than one key dim: RESULTS.md (b)): give key_dim=K "
              "or a per-layer list",
}


def check_spec(spec: object) -> KeyDimSpec:
    """``spec`` as None, a positive int or a list of them; a budget (``"budget=F"``) or an energy threshold (a float)
    is refused with its line of :data:`REMOVED`."""
    if spec is None:
        return None
    if isinstance(spec, str) and spec.startswith("budget="):
        raise ValueError(REMOVED["budget"])
    if isinstance(spec, (list, tuple)):
        return [positive_int(k, "key_dim") for k in spec]
    if is_integer(spec):
        return positive_int(spec, "key_dim")
    if is_number(spec):
        raise ValueError(REMOVED["threshold"])
    raise ValueError(f"key_dim must be an int, a list of ints (one per attention layer) or None, got {spec!r}")


def layer_dims(spec: KeyDimSpec, layers: Sequence[tuple[str, nn.Module]], even: bool = False,
               beyond: Optional[str] = None) -> list[int]:
    """One key dim per layer of ``layers`` from a checked ``spec`` (None: each layer's full rank); ``even``: rotary
    layers (pairs of dims), an odd one refused naming its layer; ``beyond`` (the flag's name): a key dim above a
    layer's full rank refused (the conversion is exact there, a larger one only adds zero columns: docs/math.md).
    Works on meta layers (no weight is read)."""
    if spec is None:
        return [full_rank(attn) for _, attn in layers]
    dims = list(spec) if isinstance(spec, list) else [spec] * len(layers)
    if len(dims) != len(layers):
        raise ValueError(f"key_dim list has {len(dims)} entries but the model has {len(layers)} attention layers")
    for (name, attn), dim in zip(layers, dims):
        if even and dim % 2:
            raise ValueError(f"rotary attention needs an even key_dim (pairs of dims), got {dim} for {name}")
        if beyond is not None and dim > (most := full_rank(attn)):
            raise ValueError(f"{beyond} {dim} is beyond the full rank {most} of {name} (num_heads x head_dim): the "
                             f"conversion is exact at {most}, a larger key dim only adds zero columns")
    return dims


def removed_name(module: str, name: str) -> ImportError:
    """What a package's ``__getattr__`` raises for ``name``: for a public name that was removed (``Budget``,
    ``reparametrize_layers``), an ``ImportError`` with its line of :data:`REMOVED` (so ``from collab_vit import
    Budget`` says what replaced it); else the usual ``AttributeError``."""
    if name in ("Budget", "reparametrize_layers"):
        return ImportError(f"{module}.{name}: {REMOVED[name]}")
    return AttributeError(f"module {module!r} has no attribute {name!r}")
