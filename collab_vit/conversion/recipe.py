"""The calibrated conversion: candidates measured on held-out calibration images, never worse than weight-only.

With calibration images the conversion holds part of them out, fits the others, and measures every candidate the
same label-free way the refinement trains: the mean ``KL(softmax(source outputs) || softmax(converted outputs))`` on
the held-out images (logits, or features for a model without a head). Candidates (RESULTS.md (b): each wins
somewhere): the weight-only fit; the whitened closed form with the class token weighted by the ``"balanced"`` rule
(docs/math.md, "Query weights"); and, by ``effort``, the refinement (``refine.refine_logits``) of the better of the
two or of both. The weight-only fit is always measured and kept unless another candidate is better beyond what the
held-out images resolve (``guard.py``: a seeded bootstrap interval of the per-image gain), so the result is never
worse than weight-only on the held-out images, and is another candidate only where its win there is resolved.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import Attention
from torch import Tensor
from tqdm import tqdm

from ..checks import is_integer
from ..layers.construction import replace_submodule
from .budget import Budget, KeyDimSpec, as_spec, key_dims
from .calibration import DEFAULT_RIDGE, prefix_weight_for, whitened_spectrum, whitening
from .decompose import energy_spectrum, relative_error
from .capture import model_outputs, prefix_tokens, source_tokens
from .fit import LayerFit, fit_attention, head_factors
from .guard import Verdict, held_out_split, judge
from .refine import per_image_kl, refine_logits

# effort: refinement passes over the fitting images (steps = passes x images / batch), and which starts are refined.
# 80 passes: 280 steps for 224 fitting images at batch 64 (the step counts measured against it: RESULTS.md (b)).
EFFORTS: dict[str, tuple[int, int]] = {"fast": (0, 0), "default": (80, 1)}  # "thorough" (both refined): RESULTS.md (b)
STARTS = ("weight", "whitened")


def check_effort(effort: object) -> str:
    if effort not in EFFORTS:
        raise ValueError(f"effort must be one of {tuple(EFFORTS)}, got {effort!r}")
    return str(effort)


@dataclass
class Recipe:
    """What the calibrated conversion does beyond the public options (the measured defaults)."""

    ridge: float = DEFAULT_RIDGE
    prefix_weight: object = "balanced"  # of the whitened start: a number, or the "balanced" rule
    refine_steps: Optional[int] = None  # None: from effort and the number of images
    refine_lr: float = 1e-3
    batch_size: int = 64
    amp: bool = False  # bfloat16 autocast for the forward passes that capture the tokens
    holdout: Optional[int] = None  # held-out images; None: an eighth, 1 to 32 (drawn by the seed: guard.py)
    confidence: float = 0.95  # of the guard's interval: a candidate beats weight-only beyond it (guard.py)
    max_images: Optional[int] = None
    candidates: Optional[Sequence[str]] = None  # pin them (e.g. ("whitened+refine",)); None: from effort
    decomposition: dict = field(default_factory=dict)  # max_iter, tol, dtype


def split(n: int, holdout: Optional[int]) -> int:
    """Fitting images out of ``n`` (the rest is held out): an eighth held out by default, 1 to 32."""
    if holdout is None:
        holdout = min(max(1, n // 8), 32) if n >= 2 else 0
    if not is_integer(holdout) or not 0 <= holdout < n:
        raise ValueError(f"holdout must be an integer in [0, {n}) for {n} calibration images, got {holdout!r}")
    return n - holdout


def refine_steps(recipe: Recipe, effort: str, fit: int) -> int:
    if recipe.refine_steps is not None:
        return recipe.refine_steps
    return math.ceil(EFFORTS[effort][0] * fit / recipe.batch_size)


def candidate_names(effort: str, ranked: Sequence[str]) -> list[str]:
    """The refined candidates of ``effort``: the best ``n`` starts (``ranked``: best first) followed by the refinement."""
    return [f"{start}+refine" for start in ranked[:EFFORTS[effort][1]]]


def tensor_error(attn: Attention, layer: nn.Module) -> float:
    """``||T - T~|| / ||T||`` of a fitted (e.g. refined) layer."""
    wq, wk = head_factors(attn)
    weights = (layer.query.weight.T, layer.key.weight.T, layer.mixing)
    return relative_error(wq, wk, *(w.detach().cpu() for w in weights))


def start_dims(layers: list[tuple[str, Attention]], spec: KeyDimSpec, moments: list, ridge: float,
               prefix_weight: float) -> tuple[dict[str, list[int]], str]:
    """Each start's key dims: a threshold or budget reads the weight spectra for the weight-only start (so that
    candidate is the weight-only conversion itself) and the whitened ones for the whitened start (thresholds weigh
    every token alike, as measured; budgets use the class-token weighting of the fit)."""
    by_weight, dims_from = weight_dims(layers, spec)
    if not isinstance(spec, (float, Budget)):
        return {start: by_weight for start in STARTS}, dims_from
    white = [whitened_spectrum(*head_factors(attn), whitening(m, ridge, prefix_weight if isinstance(spec, Budget)
                                                               else 1.0)) for (_, attn), m in zip(layers, moments)]
    full = [a.attn_dim for _, a in layers]
    return {"weight": by_weight, "whitened": key_dims(spec, full, white)[0]}, dims_from


def weight_dims(layers: list[tuple[str, Attention]], spec: KeyDimSpec) -> tuple[list[int], str]:
    """The weight-only conversion's key dims (thresholds and budgets read the weight spectra) and where they came
    from: ``_weight_only`` and the recipe's weight-only candidate both take them from here."""
    spectra = [energy_spectrum(*head_factors(a))[0] for _, a in layers] if isinstance(spec, (float, Budget)) else []
    return key_dims(spec, [a.attn_dim for _, a in layers], spectra)


@dataclass(frozen=True)
class Builder:
    """How one kind of layer's candidates are built: their key dims per start (``start_dims``), the whitening of a
    layer's moments, the fit (``fit_attention``'s arguments) and the tensor error of a refined layer. None: standard
    attention's (this module's functions, looked up when called); rotary layers: ``rotary_fit.ROTARY``."""

    dims: Optional[Callable] = None
    sides: Optional[Callable] = None
    fit: Optional[Callable] = None
    tensor_error: Optional[Callable] = None


STANDARD = Builder()


@dataclass
class Candidate:
    name: str
    fits: list[LayerFit]
    held_kl: float = math.nan
    refine: Optional[dict] = None
    held: Optional[Tensor] = None  # the per-image held-out KL


def calibrated(model: nn.Module, layers: list[tuple[str, Attention]], spec: KeyDimSpec, method: str, images: Tensor,
               effort: str, seed: int, progress: bool, recipe: Recipe, builder: Builder = STANDARD
               ) -> tuple[list[LayerFit], list[Optional[Tensor]], dict]:
    """Fit, refine and measure the candidates at the key dims of ``spec`` (thresholds and budgets: each start's own
    spectra, ``start_dims``); swap the best into ``model``. Returns its fits, the held-out tokens of every layer (for
    the report's output errors) and a summary (key dims, candidates, held-out KL, which won, by how much)."""
    fit = split(images.shape[0], recipe.holdout)
    images = images[held_out_split(images.shape[0], seed)]  # which images are held out: by the seed
    held_images = images[fit:] if fit < images.shape[0] else images
    start = time.perf_counter()
    device_type = next(model.parameters()).device.type
    with torch.autocast(device_type, torch.bfloat16, enabled=recipe.amp):
        moments, held, peak, outputs = source_tokens(model, layers, images, fit, recipe.batch_size)
    if recipe.amp:  # the tokens were captured in bfloat16; the KL targets are taken at full precision
        outputs = model_outputs(model, images, recipe.batch_size)
    targets = outputs[:fit]
    held_target = F.log_softmax((outputs[fit:] if fit < images.shape[0] else outputs).float(), dim=-1)
    captured = time.perf_counter() - start
    options = dict(seed=seed, **recipe.decomposition)
    patches = getattr(getattr(model, "patch_embed", None), "num_patches", None)
    weight = recipe.prefix_weight
    if weight == "balanced" and patches is None:
        weight = 1.0  # the rule needs the patch count; without it every token counts alike
    weight = prefix_weight_for(weight, prefix_tokens(model), patches)
    fit_layer, sides_of = builder.fit or fit_attention, builder.sides or whitening
    dims, dims_from = (builder.dims or start_dims)(layers, as_spec(spec), moments, recipe.ridge, weight)
    pinned = list(recipe.candidates) if recipe.candidates is not None else None
    starts = [s for s in STARTS if pinned is None or any(c.split("+")[0] == s for c in pinned)]
    originals = [attn for _, attn in layers]

    def install(fits: list[LayerFit]) -> None:
        for (name, _), fitted in zip(layers, fits):
            replace_submodule(model, name, fitted.layer.eval())

    def measure(candidate: Candidate) -> Candidate:
        install(candidate.fits)
        candidate.held = per_image_kl(model, held_images, held_target, recipe.batch_size)
        candidate.held_kl = float(candidate.held.mean())
        return candidate

    bar = tqdm(total=len(layers) * len(starts), desc=f"calibrated {method}", disable=not progress)
    found: dict[str, Candidate] = {}
    with torch.autocast(device_type, enabled=False):  # the fits, the refinement and the measures at full precision
        for start_name in starts:
            fits = []
            for (_, attn), rank, layer_moments in zip(layers, dims[start_name], moments):
                sides = sides_of(layer_moments, recipe.ridge, weight) if start_name == "whitened" else None
                fits.append(fit_layer(attn, rank, method, sides, **options))
                bar.update()
            found[start_name] = measure(Candidate(start_name, fits))
        bar.close()
        ranked = sorted(starts, key=lambda s: found[s].held_kl)
        steps = refine_steps(recipe, effort, fit)
        refined = [c for c in pinned if c.endswith("+refine")] if pinned is not None else (
            candidate_names(effort, ranked) if steps else [])
        for name in refined:
            base = found[name.split("+")[0]]
            fits = [copy.copy(f) for f in base.fits]
            for f in fits:
                f.layer = copy.deepcopy(f.layer)
            install(fits)
            result = refine_logits(model, [f.layer for f in fits], images[:fit], targets, steps, recipe.refine_lr,
                                   recipe.batch_size, seed, progress)
            for (_, attn), f in zip(layers, fits):
                f.tensor_error = (builder.tensor_error or tensor_error)(attn, f.layer)
            found[name] = measure(Candidate(name, fits, refine={
                "steps": result.steps, "lr": recipe.refine_lr, "seconds": result.seconds,
                "kl_before": result.kl_before, "kl_after": result.kl_after, "kept_start": result.kept_start}))
    pool = [found[c] for c in pinned] if pinned is not None else list(found.values())
    best = min(pool, key=lambda c: c.held_kl)  # weight-only first: another candidate wins only if strictly better
    reference = found.get("weight")
    verdict = guarded(best, reference, recipe.confidence, seed)
    if verdict is not None and not verdict.kept:
        best = reference
    install(best.fits)
    for original in originals:
        original.eval()
    summary = {
        "images_fit": fit, "images_held_out": images.shape[0] - fit,
        "measured_on": "held-out calibration images" if fit < images.shape[0] else "the fitting images (one image)",
        "key_dims_from": dims_from if dims_from == "given" else f"{dims_from} ({best.name.split('+')[0]} spectra)",
        "effort": effort, "candidate_key_dims": {c.name: [f.key_dim for f in c.fits] for c in found.values()},
        "prefix_weight": weight, "ridge": recipe.ridge, "amp": recipe.amp,
        "peak_token_bytes": peak, "capture_seconds": captured, "refine_steps": steps if refined else 0,
        "candidates": {c.name: c.held_kl for c in found.values()}, "chosen": best.name,
        "held_out_kl": best.held_kl,
        "weight_only_kl": None if reference is None else reference.held_kl,
        "gain_over_weight_only": None if reference is None else reference.held_kl - best.held_kl,
    }
    if verdict is not None:
        summary["guard"] = verdict.as_dict()
    if best.refine is not None:
        summary["refine"] = best.refine
    return best.fits, held, summary


def guarded(best: Candidate, reference: Optional[Candidate], confidence: float, seed: int) -> Optional[Verdict]:
    """The guard's verdict on the best candidate against the weight-only fit (``guard.judge``); None where there is
    nothing to judge (the best is the weight-only fit, or it was not a candidate)."""
    if reference is None or best is reference:
        return None
    return judge(best.name, reference.held, best.held, confidence, seed)
