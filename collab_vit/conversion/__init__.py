"""Standard attention -> collaborative attention after training (paper sections 3.1 and 3.3).

``decompose`` (tensor math) <- ``calibration`` (token statistics and whitening of the data-aware conversion),
``capture`` (the tokens each layer sees), ``refine`` (label-free matching of the source's outputs) <- ``fit`` (one
layer) <- ``budget`` (key dims per layer), ``recipe`` (the calibrated candidates and their guard) <- ``reparam`` (the
public entries) <- ``pretrained`` (timm weights converted on load) and ``files`` (``collab-vit convert`` /
``analyze``); ``spectrum`` measures how much the heads share (section 3.1); ``record`` says what a converted model's
file or folder records (its source) and rebuilds the model from it.
"""
from .budget import Budget
from .reparam import ConversionReport, LayerReport, reparametrize, reparametrize_attention, reparametrize_layers

__all__ = ["Budget", "ConversionReport", "LayerReport", "reparametrize", "reparametrize_attention",
           "reparametrize_layers"]
