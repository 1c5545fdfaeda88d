"""collab-vit: collaborative multi-head attention (Cordonnier, Loukas, Jaggi 2020) for timm vision transformers.

``import collab_vit`` registers the collaborative DeiT models with timm. Layers, bottom to top (each imports only
those below it): ``checks`` (argument checks) <- ``layers`` (the attention layers) <- ``weights_io`` (atomic writes,
code-free loading) <- ``console`` (the commands' one-line errors and exit codes) <- ``conversion`` (decompositions,
whole-model re-parametrisation, pretrained weights, spectrum) <- ``models`` / ``models_rope`` (timm registrations) <-
``hub`` (``save_pretrained``, ``push_to_hf_hub``: timm's hub folder) <- ``training`` (DeiT's recipe) <- ``cli`` /
``train.py`` / ``eval.py``.
"""
from ._version import __version__
from .conversion import reparam
from .conversion.reparam import reparametrize, reparametrize_attention
from .layers.attention import CollaborativeAttention, ConcatAttention, attention_class
from .layers.rotary import CollaborativeAttentionRope, CollaborativeEvaAttention
from .layers.weight_decay import exclude_mixing_from_decay
from .models import COLLAB_MODELS, CONCAT_MODELS
from .models_rope import ROPE_MODELS
from .hub import push_to_hf_hub, save_pretrained

__all__ = ["CollaborativeAttention", "CollaborativeAttentionRope", "CollaborativeEvaAttention", "ConcatAttention",
           "attention_class", "reparametrize", "reparametrize_attention", "reparam", "COLLAB_MODELS", "CONCAT_MODELS",
           "ROPE_MODELS", "save_pretrained", "push_to_hf_hub", "exclude_mixing_from_decay"]
