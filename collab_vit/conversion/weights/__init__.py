"""The weights stage of a conversion: closed-form math on a layer's weights (section 3.3), and the whitening that
token statistics give it. Reads no images. Importing this package imports none of its modules.

The modules, top to bottom (each imports only modules listed below it):

* ``convert``: the one weight-only conversion of a layer (standard or rotary).
* ``rotary_fit``: rotary layers compressed per frequency (complex CP, allocation, the strongest-pairs selection).
* ``fit``: one layer fitted at a key dim, weight-only or whitened; its tensor and output errors.
* ``support``: which attention layers convert and why others do not, all-or-nothing conversion.
* ``rotary``: rope layers: which convert, the exact full-rank construction.
* ``forms``: BEiT / EVA layers rewritten as timm's ``Attention``.
* ``whitening``: token moments and the whitened decomposition of the data-aware conversion (docs/math.md).
* ``decompose``: the Tucker decomposition of the per-head bilinear forms (CP-ALS and the paper's parafac, its
  references: ``benchmarks/reference_decompose.py``).
* ``dims``: key dims per layer (one or a list, read once); each removed option's one line.
"""
