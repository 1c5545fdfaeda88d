"""The calibrated recipe's closed-form candidates of one layer: reads the layer's weights, the moments of the tokens
it sees on the fitting images and (a rotary layer) the rope it is called with; returns the candidate's ``LayerFit``.

Every layer has the weight-only start (``weights.convert.convert_layer``) and the whitened closed form (the forms
whitened by the tokens' second moments, the class token weighted: docs/math.md, "Data-aware conversion"); a rotary
layer also each head keeping its strongest pairs under its rope (``rotary_fit.selection_fit``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn
from torch import Tensor

from ..weights.convert import convert_layer
from ..weights.fit import LayerFit, fit_attention, tensor_error
from ..weights.rotary import layer_calls
from ..weights.rotary_fit import fit_rotary, layer_error, selection_fit
from ..weights.whitening import TokenMoments, Whitening, whitener, whitening

STARTS = ("weight", "whitened")  # every layer's; a rotary layer's also "select"


def rotary_sides(moments: TokenMoments, ridge: float, prefix_weight: float) -> tuple[Whitening, Whitening]:
    """Whitenings of a rotary layer's tokens: both sides uncentred (a rotated constant is no constant along a softmax
    row), the query side with the prefix tokens weighted."""
    if moments.tokens == 0:
        raise ValueError("no calibration tokens were seen")
    return (whitener(moments.weighted_query(prefix_weight), moments.tokens, ridge),
            whitener(moments.query, moments.tokens, ridge))


@dataclass(frozen=True)
class Starts:
    """The closed-form candidates of a model's layers: standard attention, or rotary (``rotary``); the whitened
    start's ``ridge`` and class-token weight (``prefix_weight``)."""

    rotary: bool
    ridge: float
    prefix_weight: float

    @property
    def names(self) -> tuple[str, ...]:
        return STARTS + (("select",) if self.rotary else ())

    def fit(self, name: str, attn: nn.Module, key_dim: int, moments: TokenMoments, rope: Tensor | None) -> LayerFit:
        """Start ``name`` of ``attn`` at ``key_dim``."""
        if name == "weight":
            return convert_layer(attn, key_dim, self.rotary)
        if name == "select":
            return selection_fit(attn, key_dim, rope)
        if self.rotary:
            return fit_rotary(attn, key_dim, rotary_sides(moments, self.ridge, self.prefix_weight))
        return fit_attention(attn, key_dim, whitening(moments, self.ridge, self.prefix_weight))

    def tensor_error(self, attn: nn.Module, layer: nn.Module) -> float:
        """``||T - T~|| / ||T||`` of a (refined) layer against its source."""
        return layer_error(attn, layer) if self.rotary else tensor_error(attn, layer)

    def ropes(self, model: nn.Module, layers: list[tuple[str, nn.Module]], images: Tensor) -> list[Tensor | None]:
        """The rope each layer is called with on the first of ``images`` (it ranks the selection's pairs); None for
        standard attention."""
        if not self.rotary:
            return [None] * len(layers)
        return [call[1].get("rope") for call in layer_calls(model, layers, images[:1])]
