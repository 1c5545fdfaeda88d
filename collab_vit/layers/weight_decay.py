"""Mixing matrices out of weight decay under timm's optimizer factory, whatever the model class.

timm's ``create_optimizer_v2`` (with or without ``layer_decay``) decays every parameter of two or more dims except
the names ``model.no_weight_decay()`` returns. The mixing matrix (heads x D~k, paper eq. 5) is 2-D, but it plays the
role of the concatenate layer's fixed head-block indicator: it is kept out of decay, as the registered models always
did. The content bias ``c_i`` (heads x D, a Linear weight) IS decayed: it is the query bias seen through the key
projection (``c_i = Wk_i bq_i``), a linear functional of the tokens, literally one more shared key column per head in
the folded layout (``sdpa_layout``); the key projection it is made from is decayed in the source layer too, and
keeping it in the decay group keeps the training of every registered model as it was.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn as nn
from timm.models import VisionTransformer

from .attention import CollaborativeAttention
from .pickling import reduced_by


def mixing_names(model: nn.Module) -> set[str]:
    """Parameter names of the mixing matrices of every ``CollaborativeAttention`` in ``model``."""
    return {f"{name}.mixing" if name else "mixing" for name, module in model.named_modules()
            if isinstance(module, CollaborativeAttention)}


class MixingNoDecay:
    """Mixin: ``no_weight_decay()`` is the base class's set plus every mixing matrix."""

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        base = getattr(super(), "no_weight_decay", None)
        return set(base() if base is not None else ()) | mixing_names(self)


class CollabVisionTransformer(MixingNoDecay, VisionTransformer):
    """timm's ``VisionTransformer`` whose ``no_weight_decay()`` adds every attention layer's mixing matrix."""


@lru_cache(maxsize=None)
def no_decay_class(cls: type) -> type:
    """``cls`` with :class:`MixingNoDecay` mixed in (``CollabVisionTransformer`` for timm's ``VisionTransformer``)."""
    if issubclass(cls, MixingNoDecay):
        return cls
    if cls is VisionTransformer:
        return CollabVisionTransformer
    named = type(f"Collab{cls.__name__}", (MixingNoDecay, cls), {"__module__": __name__,
                                                                 "__reduce_ex__": reduced_by(no_decay_class, cls)})
    globals()[named.__name__] = named  # importable by name in this process too
    return named


def exclude_mixing_from_decay(model: nn.Module) -> nn.Module:
    """Give ``model`` (in place, by class) a ``no_weight_decay()`` naming its mixing matrices; returns it."""
    model.__class__ = no_decay_class(type(model))
    return model
