"""Swap the timm ``Attention`` layers of a model for collaborative ones (paper section 3.3).

At ``key_dim >= heads x head_dim`` the swap is exact (concatenate construction). Below, the per-head bilinear forms
``T[i] = Wq_i Wk_i^T`` get a rank-``key_dim`` Tucker or CP decomposition (``collab_vit.decompose``); the query bias
stays exact through the content bias ``c_i = Wk_i bq_i`` and the key bias is dropped (constant along softmax rows).
With calibration images the decomposition is of the forms whitened by the tokens each layer sees (``calibration``,
``capture``), optionally followed by a label-free refinement towards the source's logits (``refine``).
"""
from __future__ import annotations

import copy
import numbers
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
import torch.nn as nn
from timm.layers import Attention
from tqdm import tqdm

from ..layers.attention import CollaborativeAttention, check_key_dim
from .calibration import (DEFAULT_RIDGE, Calibration, TokenMoments, Whitening, calibration_images, prefix_weight_for,
                          whitened_decomposition, whitened_rank, whitening)
from .capture import CAPTURES, block_tokens, check_sequential, model_outputs, prefix_tokens, source_tokens
from .decompose import (Decomposition, cp_decompose, energy_spectrum, exact_decomposition, parafac_decompose,
                        rank_for_energy, split_qkv_heads, tucker_decompose)
from .refine import RefineResult, check_layerwise, check_loss, check_steps, refine_layer, refine_logits
from .forms import keeps_form
from .support import all_or_nothing, attention_forms, attention_reason

# "tucker" and "cp" never form the dense tensor; "parafac" is the paper's procedure (tensorly on the dense tensor).
METHODS: dict[str, Callable[..., Decomposition]] = {"tucker": tucker_decompose, "cp": cp_decompose,
                                                    "parafac": parafac_decompose}
KeyDimSpec = Union[None, int, float, Sequence[int]]


@dataclass
class LayerReport:
    """What the swap of one attention layer did."""

    name: str
    key_dim: int
    tensor_error: float  # ||T - T~|| / ||T|| of the bilinear forms
    output_error: float  # ||attn~(x) - attn(x)|| / ||attn(x)|| on the probe / held-out tokens (``error_tokens``)
    seconds: float
    whitened_error: Optional[float] = None  # pooled relative logit error on the calibration tokens (calibrated)
    error_tokens: str = "random probe images"  # what output_error was measured on
    key_dim_from: str = "given"  # "given", "weight spectrum" or "whitened spectrum" (energy thresholds)
    refined_output_error: Optional[float] = None  # output_error after the refinement stage, if it ran

    def as_dict(self) -> dict:
        return asdict(self)


def timm_attention_layers(model: nn.Module) -> list[tuple[str, Attention]]:
    """Every timm ``Attention`` layer of ``model``; a one-line ``ValueError`` naming the first attention layer that
    cannot be converted and why (qk_norm, rope, ...), or if there is none (``support.check_model``); BEiT / EVA
    layers in timm's form (``support.attention_forms``)."""
    return attention_forms(model)


def resolve_key_dims(spec: KeyDimSpec, layers: list[tuple[str, Attention]]) -> list[int]:
    """One key dim per layer from an int (all layers), a list (one per layer) or an energy threshold in (0, 1].

    A threshold keeps, per layer, the fewest dims holding that fraction of the query-side energy (section 3.1).
    ``None`` means full rank (exact).
    """
    full = [attn.num_heads * attn.head_dim for _, attn in layers]
    if spec is None:
        return full
    if isinstance(spec, bool):
        raise ValueError(f"key_dim must be a positive integer, a list or a threshold in (0, 1], got {spec!r}")
    if isinstance(spec, numbers.Integral):
        return [check_key_dim(int(spec))] * len(layers)
    if isinstance(spec, numbers.Real):
        if not 0 < spec <= 1:
            raise ValueError(f"an energy threshold key_dim must be in (0, 1], got {spec!r}")
        return [rank_for_energy(energy_spectrum(*split_qkv_heads(a.qkv.weight.detach(), a.num_heads))[0], spec)
                for _, a in layers]
    if isinstance(spec, (list, tuple)):
        if len(spec) != len(layers):
            raise ValueError(f"key_dim list has {len(spec)} entries but the model has {len(layers)} attention layers")
        return [check_key_dim(k) for k in spec]
    raise ValueError(f"key_dim must be a positive integer, a list or a threshold in (0, 1], got {spec!r}")


def layer_from_decomposition(attn: Attention, decomposition: Decomposition) -> CollaborativeAttention:
    """The collaborative layer of ``attn`` with ``W~q, W~k, M`` from ``decomposition`` (section 3.3): the one
    construction, exact with ``decompose.exact_decomposition`` (the concatenate construction). Values, projection
    and norm are copied; the query bias becomes the content bias ``c_i = Wk_i bq_i`` (section 2.2); the key bias is
    dropped (constant along each softmax row)."""
    dim, heads, weight = attn.qkv.in_features, attn.num_heads, attn.qkv.weight
    has_bias = attn.qkv.bias is not None
    layer = CollaborativeAttention(
        dim, heads, key_dim=decomposition.query.shape[1], qkv_bias=has_bias, proj_bias=attn.proj.bias is not None,
        attn_drop=attn.attn_drop.p, proj_drop=attn.proj_drop.p, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        layer.query.weight.copy_(decomposition.query.T)
        layer.key.weight.copy_(decomposition.key.T)
        layer.mixing.copy_(decomposition.mixing)
        layer.value.weight.copy_(weight[2 * dim:])
        if has_bias:
            b_q, _, b_v = attn.qkv.bias.chunk(3)
            layer.value.bias.copy_(b_v)
            _, wk = split_qkv_heads(weight, heads)  # (Nh, D, dh): c_i = Wk_i bq_i
            layer.content_bias.weight.copy_((wk @ b_q.reshape(heads, -1, 1)).squeeze(-1))
        layer.proj.load_state_dict(attn.proj.state_dict())
    layer.norm = copy.deepcopy(attn.norm)  # scale_norm, with its exact eps and weights
    layer.fused_attn = attn.fused_attn
    return layer.train(attn.training)


@dataclass
class LayerFit:
    """One converted layer and how it was fitted."""

    layer: CollaborativeAttention
    key_dim: int
    tensor_error: float  # ||T - T~|| / ||T||
    whitened_error: Optional[float]  # ||Lq^T (T - T~) Lk|| / ||Lq^T T Lk|| (None without calibration)
    key_dim_from: str  # "given", "weight spectrum" or "whitened spectrum"


def layer_key_dim(spec: Union[None, int, float], wq: torch.Tensor, wk: torch.Tensor,
                  sides: Optional[tuple[Whitening, Whitening]]) -> tuple[int, str]:
    """The key dim of one layer and where it came from: given, or an energy threshold on the weight spectrum
    (section 3.1), or on the whitened spectrum when calibration statistics are given."""
    if spec is None:
        return wq.shape[0] * wq.shape[2], "given"
    if isinstance(spec, numbers.Real) and not isinstance(spec, (bool, numbers.Integral)):
        if not 0 < spec <= 1:
            raise ValueError(f"an energy threshold key_dim must be in (0, 1], got {spec!r}")
        if sides is not None:
            return whitened_rank(wq, wk, sides, spec), "whitened spectrum"
        return rank_for_energy(energy_spectrum(wq, wk)[0], spec), "weight spectrum"
    return check_key_dim(spec), "given"


@keeps_form
def fit_attention(attn: Attention, key_dim: Union[None, int, float], method: str = "tucker",
                  calibration: Union[None, torch.Tensor, TokenMoments] = None, ridge: float = DEFAULT_RIDGE,
                  prefix_weight: float = 1.0, **options) -> LayerFit:
    """:func:`reparametrize_attention` with the errors of the fit (see there)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {tuple(METHODS)}, got {method!r}")
    why = attention_reason(attn) if isinstance(attn, Attention) else "not a timm Attention"
    if why is not None:  # before the decomposition
        raise ValueError(f"cannot convert this {type(attn).__name__}: {why}")
    sides = None
    if calibration is not None:
        moments = calibration if isinstance(calibration, TokenMoments) else TokenMoments.of(calibration)
        if moments.dim != attn.qkv.in_features:
            raise ValueError(f"calibration tokens have D={moments.dim}, the layer has D={attn.qkv.in_features}")
        sides = whitening(moments, ridge, prefix_weight)
    wq, wk = split_qkv_heads(attn.qkv.weight.detach().cpu(), attn.num_heads)
    # energy thresholds read the unweighted whitened spectrum: the weighted one is the class token's (RESULTS.md (b))
    weighted_threshold = sides is not None and prefix_weight != 1.0 and isinstance(key_dim, float)
    spectrum = whitening(moments, ridge) if weighted_threshold else sides
    rank, source = layer_key_dim(key_dim, wq, wk, spectrum)
    if rank >= attn.num_heads * attn.head_dim:
        return LayerFit(layer_from_decomposition(attn, exact_decomposition(wq, wk, rank)), rank, 0.0,
                        None if sides is None else 0.0, source)
    whitened = None
    with single_thread():
        if sides is None:
            decomposition = METHODS[method](wq, wk, rank, **options)
        else:
            decomposition, whitened = whitened_decomposition(wq, wk, rank, sides, METHODS[method], **options)
    return LayerFit(layer_from_decomposition(attn, decomposition), rank, decomposition.relative_error, whitened,
                    source)


def reparametrize_attention(attn: Attention, key_dim: Union[None, int, float], method: str = "tucker",
                            calibration: Union[None, torch.Tensor, TokenMoments] = None,
                            **options) -> CollaborativeAttention:
    """The ``CollaborativeAttention`` replacing the timm ``attn`` at ``key_dim`` (section 3.3); ``attn`` is unchanged.

    Exact at ``key_dim >= heads x head_dim`` (or None), with or without calibration. Below, a ``method``
    decomposition (``"tucker"``, ``"cp"``, ``"parafac"``; ``options``: ``seed, max_iter, tol, dtype``) of the
    bilinear forms ``T_i = Wq_i Wk_i^T``: weight-only without ``calibration``; with it (the ``(B, N, D)`` tokens the
    layer sees, or their streamed ``TokenMoments``), of the forms whitened by the tokens' statistics, so that the
    logits on those tokens are kept (docs/math.md, "Data-aware conversion"; ``ridge`` relative to the mean
    eigenvalue). ``key_dim`` may be an energy threshold in (0, 1]: on the whitened spectrum when calibrated.
    """
    return fit_attention(attn, key_dim, method, calibration, **options).layer


@contextmanager
def single_thread() -> Iterator[None]:
    """Run the decomposition on one thread: its matrices are small (D x key_dim), and measured on 2 shared cores
    one thread took 38 s for DeiT-B's 12 layers where two took 256 s (benchmarks/decompose_notes.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def probe_input_size(model: nn.Module) -> tuple[int, int, int]:
    """(channels, height, width) the model takes: its patch embedding's, else its pretrained cfg's, else 224 px."""
    patch_embed = getattr(model, "patch_embed", None)
    if patch_embed is not None and getattr(patch_embed, "img_size", None):
        return (patch_embed.proj.in_channels, *patch_embed.img_size)
    return tuple(getattr(model, "pretrained_cfg", {}).get("input_size", (3, 224, 224)))


def _capture_inputs(model: nn.Module, layers: list[tuple[str, Attention]], probe: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tokens each attention layer sees when the original model runs on ``probe`` images."""
    was_training = model.training
    model.eval()
    try:
        _, held, _ = source_tokens(model, layers, probe, 0, probe.shape[0])
    finally:
        model.train(was_training)
    return {name: tokens for (name, _), tokens in zip(layers, held)}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@torch.no_grad()
def _output_error(layer: nn.Module, original: nn.Module, tokens: torch.Tensor) -> float:
    device = next(layer.parameters()).device
    was = layer.training, original.training
    out, ref = layer.eval()(tokens.to(device)), original.eval()(tokens.to(device))
    layer.train(was[0])
    original.train(was[1])
    return _relative(out, ref)


class ConversionReport(list):
    """The ``LayerReport`` of every layer (a list), and ``summary``: what the calibration stage did (capture,
    images fitted / held out, peak bytes of calibration tokens held, seconds, refinement losses)."""

    def __init__(self, reports: Sequence[LayerReport] = (), summary: Optional[dict] = None) -> None:
        super().__init__(reports)
        self.summary = summary or {}
        self.kept: dict[str, str] = {}  # attention-like parts left as they are, and why (``support.check_model``)


def _swap(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, layer)


def _layer_specs(spec: KeyDimSpec, layers: list[tuple[str, Attention]]) -> list[Union[None, int, float]]:
    """Per-layer key dim specs (an int, a threshold, or None) after the checks of ``resolve_key_dims``."""
    if isinstance(spec, (list, tuple)):
        resolve_key_dims(spec, layers)
        return list(spec)
    if spec is not None and not (isinstance(spec, numbers.Real) and not isinstance(spec, bool)):
        raise ValueError(f"key_dim must be a positive integer, a list or a threshold in (0, 1], got {spec!r}")
    if isinstance(spec, numbers.Integral):
        check_key_dim(int(spec))
    elif spec is not None and not 0 < spec <= 1:
        raise ValueError(f"an energy threshold key_dim must be in (0, 1], got {spec!r}")
    return [spec] * len(layers)


def _split_holdout(images: torch.Tensor, holdout: Union[None, int, torch.Tensor], size: Sequence[int]
                   ) -> tuple[torch.Tensor, int]:
    """All images (fitting ones first) and the number that fit. Default hold-out: an eighth, 1 to 32 images."""
    if isinstance(holdout, torch.Tensor):
        return torch.cat([images, calibration_images(holdout, size)]), images.shape[0]
    n = images.shape[0]
    if holdout is None:
        holdout = min(max(1, n // 8), 32) if n >= 2 else 0
    if isinstance(holdout, bool) or not isinstance(holdout, numbers.Integral) or not 0 <= holdout < n:
        raise ValueError(f"holdout must be an int in [0, {n}) for {n} calibration images, or an image tensor, "
                         f"got {holdout!r}")
    return images, n - int(holdout)


@all_or_nothing
def reparametrize_layers(
        model: nn.Module,
        key_dim: KeyDimSpec = None,
        method: str = "tucker",
        seed: int = 0,
        max_iter: int = 100,
        tol: float = 1e-6,
        dtype: torch.dtype = torch.float64,
        probe: Optional[torch.Tensor] = None,
        progress: bool = True,
        *,
        calibration: Optional[Calibration] = None,
        max_images: Optional[int] = None,
        holdout: Union[None, int, torch.Tensor] = None,
        capture: str = "source",
        ridge: float = DEFAULT_RIDGE,
        refine_steps: int = 0,
        refine_lr: float = 1e-3,
        refine_loss: str = "model-kl",
        refine_values: bool = False,
        batch_size: int = 64,
        amp: bool = False,
        prefix_weight: Union[float, str] = 1.0,
        whiten: bool = True,
) -> ConversionReport:
    """Swap every timm ``Attention`` of ``model`` in place; return one ``LayerReport`` per layer.

    Checked first (``support.check_model``): a model with an attention layer that cannot be converted (qk_norm,
    rope, ...) is refused with one line before any work; one that fails half way is put back as it was.

    Args:
        key_dim: int for every layer, a list (one per layer), an energy threshold in (0, 1], or None (exact).
        method: ``"tucker"`` (compress, then CP of the core), ``"cp"`` (ALS on the full factored tensor) or
            ``"parafac"`` (the paper's procedure: tensorly's CP-ALS on the dense tensor, random start).
        seed, max_iter, tol, dtype: passed to the decomposition (deterministic given the seed).
        probe: images for the attention-output error without calibration (default: 2 random images).
        calibration: images (a (B, C, H, W) tensor, or an iterable of batches: ``(images, labels)`` or images) in
            the model's input format. Each layer is then fitted to keep its logits on the tokens it sees
            (``reparametrize_attention``), and its output error is measured on held-out calibration images.
        max_images: read at most this many calibration images.
        holdout: calibration images kept out of the fit for the output error (default an eighth, 1-32), or a
            tensor of separate held-out images.
        capture: ``"source"`` (tokens of the unconverted model) or ``"sequential"`` (of the partially converted
            one, layer after layer; ``capture.py``).
        ridge: relative ridge of the token moments (``calibration.DEFAULT_RIDGE``).
        refine_steps, refine_lr: Adam steps (and their lr) of the label-free refinement of ``W~q, W~k, M`` towards
            the source model's logits on the fitting images (``refine.py``; seeded by ``seed``); 0: none.
        refine_loss: ``"model-kl"`` (the model's output logits, all layers at once), or layer by layer right after
            each fit, ``refine_steps`` per layer on that layer's tokens: ``"attention-kl"`` (every head's attention
            probabilities) or ``"logit-mse"`` (the exact within-image logit objective). The layer-wise losses need
            timm ``Attention`` layers in a ViT-like ``model.blocks``.
        refine_values: ``model-kl`` also refines the value and output projections (RESULTS.md (b) measures it).
        batch_size: images per forward pass of the calibration stage.
        prefix_weight: how many times the prefix tokens (class token, registers: ``model.num_prefix_tokens``) count
            in the query moment; ``"balanced"``: as much as all patch tokens together (patches / prefix tokens).
            The head reads the class token, 1 of N tokens (RESULTS.md (b)); 1: every token alike (default).
        amp: bfloat16 autocast for the token capture's forward passes (the moments are still summed in float64;
            held-out tokens kept in float32; the fits, the refinement and its targets run unchanged).
        whiten: fit the whitened forms (data-aware); False: the weight-only fit, the calibration images then serve
            the refinement and the held-out output error only.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {tuple(METHODS)}, got {method!r}")
    layers = timm_attention_layers(model)
    options = dict(seed=seed, max_iter=max_iter, tol=tol, dtype=dtype)
    if calibration is None:
        if refine_steps:
            raise ValueError("refine_steps needs calibration images")
        return _weight_only(model, layers, key_dim, method, probe, progress, options)
    if capture not in CAPTURES:
        raise ValueError(f"capture must be one of {CAPTURES}, got {capture!r}")
    check_steps(refine_steps)
    layerwise = bool(refine_steps) and check_loss(refine_loss) != "model-kl"
    if refine_values and (layerwise or not refine_steps):
        raise ValueError("refine_values needs refine_steps > 0 and refine_loss='model-kl'")
    if layerwise:
        check_sequential(model, layers)
        check_layerwise(layers, refine_loss)
    specs = _layer_specs(key_dim, layers)
    prefix = prefix_tokens(model)
    prefix_weight = prefix_weight_for(prefix_weight, prefix, getattr(getattr(model, "patch_embed", None),
                                                                      "num_patches", None))
    size = probe_input_size(model)
    images, fit = _split_holdout(calibration_images(calibration, size, max_images, batch_size), holdout, size)
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    device_type = next(model.parameters()).device.type
    targets = model_outputs(model, images[:fit], batch_size) if refine_steps and not layerwise else None
    fits: dict[int, tuple[LayerFit, float]] = {}
    refined: dict[int, RefineResult] = {}
    closed: dict[int, nn.Module] = {}
    bar = tqdm(total=len(layers), desc=f"data-aware {method} ({capture} tokens)", disable=not progress)

    @torch.autocast(device_type, enabled=False)  # the fits and the refinement at full precision under ``amp``
    def convert(index: int, moments: TokenMoments, inputs: Optional[torch.Tensor] = None) -> None:
        name, attn = layers[index]
        began = time.perf_counter()
        fitted = fit_attention(attn, specs[index], method, moments if whiten else None, ridge, prefix_weight,
                               **options)
        fits[index] = fitted, time.perf_counter() - began
        if layerwise:  # the closed form's copy, for the report's output error before the refinement
            closed[index] = copy.deepcopy(fitted.layer)
            with torch.enable_grad():
                refined[index] = refine_layer(fitted.layer, attn, inputs, model.blocks[index].norm1, refine_steps,
                                              refine_loss, refine_lr, batch_size, seed, progress, name)
        _swap(model, name, fitted.layer.eval())
        bar.update()

    try:
        if capture == "source" and not layerwise:
            with torch.autocast(device_type, torch.bfloat16, enabled=amp):
                moments, held, peak = source_tokens(model, layers, images, fit, batch_size)
            for index, layer_moments in enumerate(moments):
                convert(index, layer_moments)
        else:
            with torch.autocast(device_type, torch.bfloat16, enabled=amp):
                held, peak = block_tokens(model, layers, images, fit, batch_size, convert, capture == "sequential")
    finally:
        bar.close()
    captured = (time.perf_counter() - start - sum(seconds for _, seconds in fits.values())
                - sum(r.seconds for r in refined.values()))
    where = (f"{images.shape[0] - fit} held-out calibration images" if fit < images.shape[0]
             else f"the {fit} fitting images (none held out)")
    reports = []
    for index, (name, attn) in enumerate(layers):
        fitted, seconds = fits[index]
        tokens = held[index] if held[index] is not None else None
        error = _output_error(closed.get(index, fitted.layer), attn, tokens) if tokens is not None else float("nan")
        reports.append(LayerReport(name, fitted.key_dim, fitted.tensor_error, error, seconds, fitted.whitened_error,
                                   where, fitted.key_dim_from))
    summary = {"capture": capture, "amp": amp, "prefix_weight": prefix_weight, "prefix_tokens": prefix,
               "images_fit": fit, "images_held_out": images.shape[0] - fit, "ridge": ridge,
               "peak_token_bytes": peak, "capture_seconds": captured}
    if layerwise:
        results = [refined[i] for i in range(len(layers))]
        summary["refine"] = {"loss": refine_loss, "steps": refine_steps, "per_layer": True, "lr": refine_lr,
                             "seconds": sum(r.seconds for r in results),
                             "loss_before": [r.kl_before for r in results], "loss_after": [r.kl_after for r in results],
                             "kept_start": [r.kept_start for r in results]}
    elif refine_steps:
        result = refine_logits(model, [fits[i][0].layer for i in range(len(layers))], images[:fit], targets,
                               refine_steps, refine_lr, batch_size, seed, progress, refine_values)
        summary["refine"] = {"loss": refine_loss, "values": refine_values, "steps": result.steps, "seconds": result.seconds, "lr": refine_lr,
                             "first_loss": result.first_loss, "last_loss": result.last_loss,
                             "kl_before": result.kl_before, "kl_after": result.kl_after,
                             "kept_start": result.kept_start}
    if refine_steps:
        for index, report in enumerate(reports):
            if held[index] is not None:
                report.refined_output_error = _output_error(fits[index][0].layer, layers[index][1], held[index])
    model.train(was_training)
    return ConversionReport(reports, summary)


def _weight_only(model: nn.Module, layers: list[tuple[str, Attention]], key_dim: KeyDimSpec, method: str,
                 probe: Optional[torch.Tensor], progress: bool, options: dict) -> ConversionReport:
    """The weight-only conversion, output errors on the tokens of ``probe`` images (default 2 random ones)."""
    key_dims = resolve_key_dims(key_dim, layers)
    if probe is None:
        probe = torch.randn(2, *probe_input_size(model), generator=torch.Generator().manual_seed(options["seed"]))
    device = next(model.parameters()).device
    inputs = _capture_inputs(model, layers, probe.to(device))
    reports = []
    for (name, attn), rank in zip(tqdm(layers, desc=f"{method} re-parametrisation", disable=not progress), key_dims):
        start = time.perf_counter()
        fitted = fit_attention(attn, rank, method, **options)
        seconds = time.perf_counter() - start
        output_error = _output_error(fitted.layer, attn, inputs[name])
        _swap(model, name, fitted.layer)
        from_ = "weight spectrum" if isinstance(key_dim, float) else "given"
        reports.append(LayerReport(name, rank, fitted.tensor_error, output_error, seconds, key_dim_from=from_))
    return ConversionReport(reports)


def reparametrize(model: nn.Module, key_dim: KeyDimSpec = None, method: str = "tucker", seed: int = 0,
                  **options) -> nn.Module:
    """Replace every timm ``Attention`` in ``model`` (in place) by a ``CollaborativeAttention``; return ``model``.

    Exact with ``key_dim=None`` or ``key_dim >= heads x head_dim``; otherwise a rank-``key_dim`` ``method``
    decomposition, weight-only or, with ``calibration=`` images, data-aware (see ``reparametrize_layers`` for the
    options and for the per-layer report).
    """
    reparametrize_layers(model, key_dim, method, seed, **options)
    return model


convert = reparametrize_layers  # the name before 0.2
