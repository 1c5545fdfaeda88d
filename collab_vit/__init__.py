"""collab-vit: collaborative multi-head attention for timm vision transformers."""
__version__ = "0.1.0"
