"""The attention layers (paper section 3.2): collaborative attention and the reduced-key-dim concatenate baseline."""
from .attention import CollaborativeAttention, ConcatAttention, attention_class

__all__ = ["CollaborativeAttention", "ConcatAttention", "attention_class"]
