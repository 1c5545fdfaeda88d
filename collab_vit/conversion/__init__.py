"""Standard attention -> collaborative attention after training (paper sections 3.1 and 3.3).

``decompose`` (tensor math) <- ``calibration`` (token statistics and whitening of the data-aware conversion),
``capture`` (the tokens each layer sees), ``refine`` (label-free matching of the source's outputs) <- ``fit`` (one
layer) <- ``dims`` (key dims per layer), ``recipe`` (the calibrated candidates and their guard) <- ``reparam`` (the
public entries) <- ``pretrained`` (timm weights converted on load) and ``files`` (``collab-vit convert`` /
``analyze``); ``spectrum`` measures how much the heads share (section 3.1); ``record`` says what a converted model's
file or folder records (its source) and rebuilds the model from it.
"""
from .dims import removed_name
from .reparam import ConversionReport, LayerReport, reparametrize, reparametrize_attention

__all__ = ["ConversionReport", "LayerReport", "reparametrize", "reparametrize_attention"]


def __getattr__(name: str) -> object:
    raise removed_name(__name__, name)  # a removed public name says what replaced it
