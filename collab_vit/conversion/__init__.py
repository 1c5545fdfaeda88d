"""Standard attention -> collaborative attention after training (paper sections 3.1 and 3.3).

A conversion goes through three stages, one subpackage each, importing one way (``tests/test_layout.py``):

* ``weights``: the closed-form math on a layer's weights: decompositions, one layer's fit, rotary layers, which
  layers convert, key dims, the whitening that token statistics give the fit.
* ``calibration``: what reads images: the tokens each layer sees, the calibrated recipe's candidates, its guard and
  blockwise refinement, the refinement's state on disk.
* ``files``: the command line's side: ``collab-vit convert`` / ``analyze``, the spectrum (section 3.1), pretrained
  tags converted on load, what a converted model's file records, the table of timm's families.

``reparam`` (``reparametrize``, ``convert_model``: the public entries) joins the first two; ``files`` calls it.
"""
from .reparam import ConversionReport, LayerReport, reparametrize, reparametrize_attention

__all__ = ["ConversionReport", "LayerReport", "reparametrize", "reparametrize_attention"]
