"""The calibration stage of a conversion: what reads images. The source's tokens on the calibration images, the
candidates measured on held-out images and the guard that picks one, the blockwise refinement and its state on disk.
Importing this package imports none of its modules.

The modules, top to bottom (each imports only modules listed below it):

* ``recipe``: the calibrated conversion: candidates measured on held-out images, its plan of memory, disk and time.
* ``blockwise``: each layer refined on its own, on the converted model's tokens (Fisher form of the objective).
* ``candidates``: a layer's closed-form candidates (weight-only, whitened; rotary layers also the selection).
* ``capture``: the calibration images checked, the tokens each layer sees.
* ``guard``: the per-image scores; which candidate the held-out images resolve (a seeded bootstrap interval).
* ``objective``: what the conversion preserves of the source's outputs (the KL of a classifier's, the features of a
  model without a head): the per-image scores and the refinement's sensitivities.
* ``state``: the refinement's per-image tensors in memory-mapped files, each refined layer committed: resumable.
"""
