"""Key dims per layer: one for all, one each, an energy threshold (section 3.1), or a total budget spread over the
layers by marginal gain (docs/math.md, "A budget across layers").

A :class:`Budget` is a fraction of the source's q/k projection parameters: the converted layers together get
``floor(fraction * sum_l D_l)`` shared key dims (``2 D K_l`` q/k weights each, against the source's ``2 D D_l``;
the mixing matrices' ``Nh K_l`` on top). Each layer starts with one dim; each further dim goes to the layer whose
next dim adds the most normalised energy (its spectrum: of the weights, or of the whitened forms with calibration).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence, Union

from torch import Tensor

from ..checks import fraction, is_integer, is_number, positive_int
from .decompose import rank_for_energy

BUDGET_PREFIX = "budget="


@dataclass(frozen=True)
class Budget:
    """A total key-dim budget: ``fraction`` of the source's q/k projection parameters, in (0, 1]."""

    fraction: float

    def __post_init__(self) -> None:
        fraction(self.fraction, "a budget (a fraction of the source's q/k parameters)")

    def total(self, full: Sequence[int]) -> int:
        """Key dims summed over the layers (``full``: each layer's ``heads x head_dim``)."""
        total = math.floor(self.fraction * sum(full) + 1e-9)
        if total < len(full):
            raise ValueError(f"budget={self.fraction} gives {total} key dims for {len(full)} attention layers "
                             f"(at least one each)")
        return total

    @classmethod
    def parse(cls, text: str) -> "Budget":
        """``"budget=0.25"``."""
        try:
            return cls(float(text[len(BUDGET_PREFIX):]))
        except ValueError:
            raise ValueError(f"a budget is written budget=F with F in (0, 1], got {text!r}") from None


KeyDimSpec = Union[None, int, float, Sequence[int], Budget, str]


def as_spec(spec: KeyDimSpec) -> KeyDimSpec:
    """``"budget=F"`` as a :class:`Budget`; a checked int, threshold or list; None (full rank)."""
    if isinstance(spec, str):
        if not spec.startswith(BUDGET_PREFIX):
            raise ValueError(f"key_dim must be an int, a list, a threshold in (0, 1] or budget=F, got {spec!r}")
        return Budget.parse(spec)
    if spec is None or isinstance(spec, Budget):
        return spec
    if isinstance(spec, (list, tuple)):
        return [positive_int(k, "key_dim") for k in spec]
    if is_integer(spec):
        return positive_int(spec, "key_dim")
    if is_number(spec):
        return fraction(spec, "an energy threshold key_dim")
    raise ValueError(f"key_dim must be an int, a list, an energy threshold in (0, 1] or budget=F, got {spec!r}")


def allocate(total: int, spectra: Sequence[Tensor]) -> list[int]:
    """``total`` key dims over the layers, greedily by marginal gain (docs/math.md): one each, then each next dim to
    the layer whose next dim adds the most of its normalised cumulative energy (``spectra``, non-decreasing, last 1).

    The gains are non-increasing along each spectrum, so the greedy choice maximises the summed kept energy; ties go
    to the earlier layer. Returns one key dim per layer, summing to ``min(total, sum of lengths)``.
    """
    dims = [1] * len(spectra)
    heap = [(-float(s[1] - s[0]), i) for i, s in enumerate(spectra) if s.numel() > 1]
    heapq.heapify(heap)
    for _ in range(total - len(dims)):
        if not heap:
            break
        _, i = heapq.heappop(heap)
        dims[i] += 1
        s = spectra[i]
        if dims[i] < s.numel():
            heapq.heappush(heap, (-float(s[dims[i]] - s[dims[i] - 1]), i))
    return dims


def key_dims(spec: KeyDimSpec, full: Sequence[int], spectra: Sequence[Tensor]) -> tuple[list[int], str]:
    """One key dim per layer from ``spec`` (``as_spec``) and where it came from; ``spectra``: each layer's normalised
    cumulative energy (thresholds and budgets read it)."""
    spec = as_spec(spec)
    if spec is None:
        return list(full), "given"
    if isinstance(spec, list):
        if len(spec) != len(full):
            raise ValueError(f"key_dim list has {len(spec)} entries but the model has {len(full)} attention layers")
        return spec, "given"
    if is_integer(spec):
        return [spec] * len(full), "given"
    if isinstance(spec, Budget):
        return allocate(spec.total(full), spectra), "budget"
    return [rank_for_energy(s, spec) for s in spectra], "threshold"
