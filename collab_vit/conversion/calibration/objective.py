"""What the calibrated conversion preserves of the source's outputs: the one home of its objective.

A classifier (a model with a head) keeps its predictions: each held-out image is scored by ``KL(softmax(source
logits) || softmax(converted logits))`` (``"kl"``). A model whose output is features (no head: timm's
``num_classes=0``, e.g. a DINOv2 or the image tower of a CLIP or SigLIP) keeps its pooled features ``f`` near the
source's ``f0``, scored per image by ``FEATURE_OBJECTIVE``:

* ``"cosine"``: ``1 - cos(f, f0)`` (the direction of the features, what a cosine kNN or a normalised probe reads);
* ``"mse"``: ``||f - f0||^2 / ||f0||^2`` (the relative squared error);
* ``"kl"``: the softmax over the feature dimensions, as every model was scored before feature models had an
  objective of their own (an experiment sets this module's constant in its own process; on a real DINOv2 it beat
  the cosine at D/8 on one calibration set and tied on the other: RESULTS.md, "A real pretrained model: DINOv2
  ViT-S/14").

Lower is better for all three, and each is zero at the source. The blockwise refinement weighs a layer's output
error ``dy`` by the objective's curvature at the source, in the Fisher form ``E_s[(g_s . dy)^2]`` (``directions``:
each sample's ``g_s`` is the gradient of one scalar of the model's outputs). ``E_s[(g_s . dy)^2]`` is ``dy``'s
quadratic form under the objective's Hessian at the source (Gauss-Newton), so twice the objective to second order,
for all three:

* ``"kl"``: ``g = d log p(c) / dy``, ``c`` drawn from the source's ``p``: ``E_c[g g^T]`` is the Fisher information,
  the Hessian of the KL;
* ``"mse"``: ``g = sqrt(2) J^T v / ||f0||`` with ``v ~ N(0, I)`` in feature space (``J = df/dy``):
  ``E_v[g g^T] = 2 J^T J / ||f0||^2``, the Hessian of ``||f - f0||^2 / ||f0||^2``;
* ``"cosine"``: ``g = J^T P v / ||f0||`` with ``P = I - u u^T``, ``u = f0 / ||f0||``: writing ``f - f0 = a u + w``
  (``w`` orthogonal to ``u``), ``1 - cos(f, f0) = ||w||^2 / (2 ||f0||^2)`` to second order, whose Hessian is
  ``J^T P J / ||f0||^2 = E_v[g g^T]``.

Every reader (``guard``, ``recipe.capture``, ``blockwise``) asks ``objective_for`` when it runs, so a process that
sets ``FEATURE_OBJECTIVE`` before converting gets that objective everywhere.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

OBJECTIVES = ("kl", "cosine", "mse")
FEATURE_OBJECTIVE = "cosine"  # of a model without a head: a prior (docs/post_hoc.md, "Objective"); the real
# DINOv2's measurement (RESULTS.md, "A real pretrained model: DINOv2 ViT-S/14") has not settled it
DESCRIPTIONS = {"kl": "KL to the source's outputs", "cosine": "1 - cosine to the source's features",
                "mse": "relative squared error to the source's features"}


def has_features(model: nn.Module) -> bool:
    """Whether ``model``'s output is features, not logits: timm's ``num_classes == 0``, or a head that is an
    ``nn.Identity`` (``get_classifier()``)."""
    if getattr(model, "num_classes", None) == 0:
        return True
    classifier = getattr(model, "get_classifier", None)
    return callable(classifier) and isinstance(classifier(), nn.Identity)


def objective_for(model: nn.Module) -> str:
    """``"kl"`` for a classifier, ``FEATURE_OBJECTIVE`` (read now) for a model whose output is features."""
    if not has_features(model):
        return "kl"
    if FEATURE_OBJECTIVE not in OBJECTIVES:
        raise ValueError(f"FEATURE_OBJECTIVE must be one of {OBJECTIVES}, got {FEATURE_OBJECTIVE!r}")
    return FEATURE_OBJECTIVE


def _features(outputs: Tensor) -> Tensor:
    """Each image's outputs as one float64 vector (pooled features: (B, D); token features flattened)."""
    return outputs.flatten(1).double()


def cosine(outputs: Tensor, source: Tensor) -> Tensor:
    """Per image, the cosine of ``outputs`` to the ``source``'s, float64 (zero where either is zero)."""
    f, f0 = _features(outputs), _features(source).to(outputs.device)
    return (f * f0).sum(1) / (f.norm(dim=1) * f0.norm(dim=1)).clamp_min(torch.finfo(torch.float64).tiny)


def scores(outputs: Tensor, source: Tensor, objective: str) -> Tensor:
    """Per image, the ``objective``'s score of ``outputs`` against the ``source``'s outputs on the same images (lower
    is closer; module docstring), float64 on the CPU."""
    if objective == "kl":
        kl = F.kl_div(F.log_softmax(outputs.float(), dim=-1), F.log_softmax(source.float(), dim=-1).to(outputs.device),
                      log_target=True, reduction="none")
        return kl.flatten(1).sum(1).detach().double().cpu()
    if objective == "cosine":
        return (1 - cosine(outputs, source)).detach().cpu()
    if objective == "mse":
        f, f0 = _features(outputs), _features(source).to(outputs.device)
        squared = (f0 * f0).sum(1).clamp_min(torch.finfo(torch.float64).tiny)
        return ((f - f0).pow(2).sum(1) / squared).detach().cpu()
    raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")


def directions(outputs: Tensor, samples: int, generator: torch.Generator, objective: str) -> list[Tensor]:
    """``samples`` scalars of ``outputs`` (the model's, with their graph), each summed over the images: the gradient
    of scalar ``s`` with respect to a layer's output is that layer's sensitivities ``g_s`` of the Fisher form
    (module docstring), drawn per image by ``generator`` (classes for ``"kl"``, Gaussian directions in feature
    space for the others)."""
    if objective == "kl":
        log_p = torch.log_softmax(outputs.to(torch.promote_types(outputs.dtype, torch.float32)), dim=-1)
        drawn = torch.multinomial(log_p.detach().exp().cpu(), samples, replacement=True, generator=generator)
        return [log_p.gather(1, drawn[:, s:s + 1].to(log_p.device)).sum() for s in range(samples)]
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    f = outputs.flatten(1).to(torch.promote_types(outputs.dtype, torch.float32))
    f0 = f.detach()
    norm = f0.norm(dim=1, keepdim=True).clamp_min(torch.finfo(f0.dtype).tiny)
    v = torch.randn((f.shape[0], samples, f.shape[1]), generator=generator, dtype=f0.dtype).to(f0.device)
    if objective == "cosine":
        u = (f0 / norm).unsqueeze(1)
        v = v - (v * u).sum(-1, keepdim=True) * u
    else:  # the Hessian of the relative squared error is twice J^T J / ||f0||^2
        v = v * math.sqrt(2)
    v = v / norm.unsqueeze(1)
    return [(v[:, s] * f).sum() for s in range(samples)]
