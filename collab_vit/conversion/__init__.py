"""Standard attention -> collaborative attention after training (paper sections 3.1 and 3.3).

``decompose`` (tensor math) <- ``reparam`` (layers and whole models) <- ``pretrained`` (timm weights converted on load)
and ``files`` (``collab-vit convert`` / ``analyze``); ``spectrum`` measures how much the heads share (section 3.1).
"""
from .reparam import LayerReport, reparametrize, reparametrize_layers

__all__ = ["LayerReport", "reparametrize", "reparametrize_layers"]
