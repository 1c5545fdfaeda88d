"""Swap the timm ``Attention`` layers of a model for collaborative ones (paper section 3.3): the public entries.

``reparametrize(model, key_dim, calibration=...)`` converts a whole model in place and returns it;
``reparametrize_attention(attn, key_dim)`` one layer. At ``key_dim >= heads x head_dim`` the swap is exact
(concatenate construction). Below, the per-head bilinear forms ``T_i = Wq_i Wk_i^T`` get a rank-``key_dim``
decomposition (``fit.py``); the query bias stays exact through the content bias ``c_i = Wk_i bq_i`` and the key
bias is dropped (constant along softmax rows). With calibration images the recommended recipe runs (``recipe.py``): candidates measured on held-out
images, never worse than weight-only there.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence, Union

import torch
import torch.nn as nn
from timm.layers import Attention

from .. import console
from ..layers.attention import CollaborativeAttention
from ..layers.construction import not_convertible, replace_submodule
from .weights.whitening import TokenMoments, whitening
from .weights.dims import KeyDimSpec, check_spec, layer_dims
from .weights.convert import convert_layer
from .weights.fit import fit_attention, layer_from_decomposition, output_error
from .calibration.capture import Calibration, normalising, peek
from .calibration.recipe import Recipe, calibrated, check_effort
from .weights.rotary import is_rotary, layer_calls
from .weights.rotary_fit import only_rotary
from .weights.support import all_or_nothing, attention_forms

__all__ = ["ConversionReport", "LayerReport", "reparametrize", "reparametrize_attention",
           "layer_from_decomposition", "output_error"]


@dataclass
class LayerReport:
    """What the swap of one attention layer did."""

    name: str
    key_dim: int
    tensor_error: float  # ||T - T~|| / ||T|| of the bilinear forms (of the layer kept, refined or not)
    output_error: float  # ||attn~(x) - attn(x)|| / ||attn(x)|| on the probe / held-out tokens (``error_tokens``)
    seconds: float  # the decomposition's
    error_tokens: str = "random probe images"  # what output_error was measured on

    def as_dict(self) -> dict:
        return asdict(self)


class ConversionReport(list):
    """The ``LayerReport`` of every layer (a list), and ``summary``: with calibration, what the recipe did (images
    fitted / held out, every candidate's held-out KL, which won and its gain over weight-only, seconds)."""

    def __init__(self, reports: Sequence[LayerReport] = (), summary: Optional[dict] = None) -> None:
        super().__init__(reports)
        self.summary = summary or {}
        self.kept: dict[str, str] = {}  # attention-like parts left as they are, and why (``support.check_model``)


def timm_attention_layers(model: nn.Module) -> list[tuple[str, Attention]]:
    """Every timm ``Attention`` layer of ``model``; a one-line ``ValueError`` naming the first attention layer that
    cannot be converted and why (qk_norm, mixed rope, ...), or if there is none (``support.check_model``); BEiT / EVA
    layers in timm's form (``support.attention_forms``)."""
    return attention_forms(model)


def reparametrize_attention(attn: Attention, key_dim: Optional[int] = None, *,
                            calibration: Union[None, torch.Tensor, TokenMoments] = None) -> CollaborativeAttention:
    """The ``CollaborativeAttention`` replacing the timm ``attn`` at ``key_dim`` (section 3.3); ``attn`` is unchanged.

    Exact at ``key_dim >= heads x head_dim`` (or None). Below, a Tucker decomposition of the bilinear forms
    ``T_i = Wq_i Wk_i^T``: weight-only without ``calibration``; with it (the ``(B, N, D)`` tokens the layer sees, or
    their ``TokenMoments``), of the forms whitened by the tokens' statistics, keeping the logits on those tokens
    (docs/math.md, "Data-aware conversion"). One layer has no model output to guard against: :func:`reparametrize`
    measures the candidates on the model's outputs.
    """
    if not isinstance(attn, Attention):  # before any weight is read
        raise not_convertible(attn, "not a timm Attention")
    spec = check_spec(key_dim)
    if isinstance(spec, list):
        raise ValueError("reparametrize_attention takes one layer: an int or None (lists are for reparametrize)")
    sides = None
    if calibration is not None:
        moments = calibration if isinstance(calibration, TokenMoments) else TokenMoments.of(calibration)
        if moments.dim != attn.qkv.in_features:
            raise ValueError(f"calibration tokens have D={moments.dim}, the layer has D={attn.qkv.in_features}")
        sides = whitening(moments)
    return fit_attention(attn, attn.attn_dim if spec is None else spec, sides).layer


def probe_input_size(model: nn.Module) -> tuple[int, int, int]:
    """(channels, height, width) the model takes: its patch embedding's, else its pretrained cfg's, else 224 px."""
    patch_embed = getattr(model, "patch_embed", None)
    if patch_embed is not None and getattr(patch_embed, "img_size", None):
        return (patch_embed.proj.in_channels, *patch_embed.img_size)
    return tuple(getattr(model, "pretrained_cfg", {}).get("input_size", (3, 224, 224)))


def reparametrize(model: nn.Module, key_dim: KeyDimSpec = None, *, calibration: Optional[Calibration] = None,
                  effort: str = "default", seed: int = 0, device: Union[None, str, torch.device] = None,
                  progress: bool = True, return_report: bool = False
                  ) -> Union[nn.Module, tuple[nn.Module, ConversionReport]]:
    """Replace every timm ``Attention`` of ``model`` (in place) by a ``CollaborativeAttention``; return ``model``.

    Args:
        key_dim: int for every layer, a list (one per layer), or None (full rank, exact). Each layer's bilinear
            forms get a Tucker decomposition of that rank (section 3.3).
        calibration: unlabelled images (a (B, C, H, W) tensor, or batches: ``(images, labels)`` or images) in the
            model's input format. Then the recipe of RESULTS.md (b) runs: a quarter of them (1-256) held out; the
            weight-only fit, the whitened closed form (rotary layers: also the strongest-pairs selection) and, by
            ``effort``, the better one refined layer by layer (``blockwise.py``) are measured on the held-out images
            as they are, by the objective (``objective.py``: the KL of a classifier's outputs to the source's; of
            a model without a head, ``1 - cosine`` of its features to the source's); the best whose win the held-out
            images resolve is kept, else weight-only. The refinement gains with the images (2048: RESULTS.md (b),
            "The constants").
        effort: ``"fast"`` (closed forms only), ``"default"`` (the better one refined: every layer alone, in
            ``recipe.PASSES["default"]`` passes over the fitting images, its output error weighted by its effect on
            the model's output) or ``"full"`` (``recipe.PASSES["full"]`` passes: the recipe for a GPU).
        seed: seeds the held-out draw and the refinement's minibatches (deterministic on one device; the
            decompositions are deterministic).
        device: move the model there first (the forward passes and the refinement run there, the token capture in
            bfloat16 on CUDA; the decompositions on the CPU).
        progress: progress bars.
        return_report: return ``(model, report)``: a ``ConversionReport``, one ``LayerReport`` per layer, and its
            ``summary`` (candidates, which won, the held-out score and its ``objective``; of a model without a
            head also the held-out cosine to the source's features).

    Rotary attention (DINOv3, EVA-02, PE, RoPE-ViT) converts exactly at full rank (``key_dim=None``; calibration has
    nothing to fit there) and below it per frequency (``rotary_fit.py``: even key dims; the recipe's candidates with
    calibration). A model with an attention layer that cannot be converted
    (qk_norm, mixed rope, ...) is refused with one line before any work; one that fails half way is put back as it
    was.
    """
    spec = check_spec(key_dim)
    check_effort(effort)
    if device is not None:
        model.to(device)
    report = convert_model(model, spec, calibration, effort, seed, progress, Recipe())
    return (model, report) if return_report else model


@all_or_nothing
def convert_model(model: nn.Module, key_dim: KeyDimSpec, calibration: Optional[Calibration], effort: str, seed: int,
                  progress: bool, recipe: Recipe, probe: Optional[torch.Tensor] = None) -> ConversionReport:
    """:func:`reparametrize` with the inside options (``recipe``; ``probe``: the images of the weight-only output
    error, default 2 random ones); returns the report."""
    check_effort(effort)
    layers = timm_attention_layers(model)
    rotary = any(is_rotary(attn, model) for _, attn in layers)
    if rotary:
        only_rotary(model, layers)
    dims = layer_dims(check_spec(key_dim), layers, even=rotary)
    if calibration is None or (rotary and key_dim is None):  # rotary at full rank: exact, nothing to calibrate
        return _weight_only(model, layers, dims, rotary, _probe(model, probe, seed), progress)
    images = peek(calibration, probe_input_size(model), recipe.batch_size)  # counted; the first few read
    was_training = model.training
    model.eval()
    try:  # ``held``: each layer's call on the held-out images (the guard's seeded split), for the output errors
        with normalising(model, calibration):  # uint8 pixels normalised where they enter the model
            fits, held, summary = calibrated(model, layers, dims, images, effort, seed, progress, recipe, rotary)
    finally:
        model.train(was_training)
    where = f"{summary['images_held_out']} held-out calibration images" if summary["images_held_out"] \
        else "the fitting image (none held out)"
    reports = []
    for (name, attn), fitted, call in zip(layers, fits, held):
        error = output_error(fitted.layer, attn, call) if call is not None else float("nan")
        reports.append(LayerReport(name, fitted.key_dim, fitted.tensor_error, error, fitted.seconds, where))
    return ConversionReport(reports, summary)


def _probe(model: nn.Module, probe: Optional[torch.Tensor], seed: int) -> torch.Tensor:
    """``probe``, else 2 random images of the model's input size (the weight-only output errors are measured there)."""
    if probe is not None:
        return probe
    return torch.randn(2, *probe_input_size(model), generator=torch.Generator().manual_seed(seed))


def _weight_only(model: nn.Module, layers: list[tuple[str, nn.Module]], dims: list[int], rotary: bool,
                 probe: torch.Tensor, progress: bool) -> ConversionReport:
    """The weight-only conversion at ``dims``: each layer by ``convert.convert_layer`` (``rotary`` layers per
    frequency), its output error on the call it gets on the ``probe`` images (``rotary.layer_calls``, read before any
    layer is swapped)."""
    calls = layer_calls(model, layers, probe)
    what = "rotary re-parametrisation (per frequency)" if rotary else "tucker re-parametrisation"
    reports = []
    bar = console.progress(len(layers), what, progress)  # a bar on a terminal, plain lines in a log
    try:
        for (name, attn), rank, call in zip(layers, dims, calls):
            fitted = convert_layer(attn, rank, rotary)
            reports.append(LayerReport(name, rank, fitted.tensor_error, output_error(fitted.layer, attn, call),
                                       fitted.seconds))
            replace_submodule(model, name, fitted.layer)
            bar.update()
    finally:
        bar.close()
    return ConversionReport(reports)
