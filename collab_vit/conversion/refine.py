"""The blockwise refinement's result and the context that trains only the collaborative query/key projections and
mixing (``W~q, W~k, M``, eq. 5). Its one user is ``blockwise.py``, where these two belong (issue 54: the whole-model
refinement that shared them left; the per-image KL moved to ``guard.py``). (A whole-model refinement, layer-wise
losses and refining the values too were measured and lost: RESULTS.md (b).)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn


@dataclass
class RefineResult:
    steps: int
    seconds: float
    first_loss: float
    last_loss: float
    kl_before: float  # mean KL over all the refinement's images, before the steps
    kl_after: float  # and after them
    kept_start: bool  # the steps made the mean loss worse: the starting weights were restored
    losses: list[float] = field(default_factory=list)


class _Trainable:
    """Only ``params`` get gradients inside the block; flags and train/eval mode are put back after it."""

    def __init__(self, modules: list[nn.Module], params: list[nn.Parameter]) -> None:
        self.modules, self.params = modules, params

    def __enter__(self) -> None:
        self.flags = {p: p.requires_grad for m in self.modules for p in m.parameters()}
        self.modes = [m.training for m in self.modules]
        for m in self.modules:
            m.eval()
            for p in m.parameters():
                p.requires_grad_(False)
        for p in self.params:
            p.requires_grad_(True)

    def __exit__(self, *exc: object) -> None:
        for p, flag in self.flags.items():
            p.requires_grad_(flag)
        for m, mode in zip(self.modules, self.modes):
            m.train(mode)
