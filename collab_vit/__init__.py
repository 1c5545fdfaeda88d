"""collab-vit: collaborative multi-head attention (Cordonnier, Loukas, Jaggi 2020) for timm vision transformers.

``import collab_vit`` registers the collaborative DeiT models with timm.
"""
from .attention import CollaborativeAttention, ConcatAttention, attention_class
from .models import COLLAB_MODELS, CONCAT_MODELS
from .reparam import reparametrize

__version__ = "0.1.0"
__all__ = ["CollaborativeAttention", "ConcatAttention", "attention_class", "reparametrize", "COLLAB_MODELS",
           "CONCAT_MODELS"]
