"""How much do heads have in common? The redundancy spectrum of a timm ViT's attention layers and its plot.

Paper: Cordonnier, Loukas, Jaggi, "Multi-Head Attention: Collaborate Instead of Concatenate" (arXiv 2006.16362),
section 3.1: the key/query projections of individual heads are not low rank, but their concatenation over heads is;
about a third of the dimensions hold almost all the energy of the products ``W_q,i W_k,i^T``. A collaborative layer
(section 3.2) with shared key/query dim ``D~k`` can then replace the ``Nh * dh`` concatenated dims.

For every timm ``Attention`` layer this module computes the normalised cumulative energy of the concatenated
products ``[W_q,0 W_k,0^T, .., W_q,Nh-1 W_k,Nh-1^T]`` (``decompose.energy_spectrum``), the number of dims needed
for 90 / 95 / 99 % of it, a suggested ``key_dim``, a Markdown table and a PNG plot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor, nn

from ...checks import fraction, positive_int
from ..weights.whitening import DEFAULT_RIDGE, whitening
from ..calibration.capture import source_tokens
from ..weights.decompose import energy_spectrum, rank_for_energy, split_qkv_heads
from ..reparam import timm_attention_layers
from ..weights import rotary_fit
from ..weights.rotary import is_rotary
from ...weights_io import atomic_write

__all__ = [
    "THRESHOLDS",
    "LayerSpectrum",
    "layer_spectra",
    "suggest_key_dim",
    "format_spectrum_table",
    "plot_spectra",
]

THRESHOLDS: tuple[float, ...] = (0.90, 0.95, 0.99)


@dataclass
class LayerSpectrum:
    """Redundancy spectrum of one attention layer (paper section 3.1).

    Attributes:
        name: Module path in the model, e.g. ``"blocks.3.attn"``.
        cumulative_energy: float64, 1-D, non-decreasing, last entry 1.0; entry ``r - 1`` is the fraction of the
            energy (sum of squared singular values) of the concatenated products ``[W_q,i W_k,i^T]_i`` (a
            ``D x Nh*D`` matrix) held by its top ``r`` singular directions. This is the query-side output of
            ``decompose.energy_spectrum``: the query-mode unfolding of ``T[i] = W_q,i W_k,i^T`` is exactly that
            concatenation, its column space is the concatenated query projections' (what section 3.1 shows to be
            low rank), and unlike the raw ``[W_q,i]_i`` it does not change under per-head reparametrisations that
            leave the logits unchanged. Length ``min(D, Nh*dh)``.
        dims_needed: ``{0.90: r90, 0.95: r95, 0.99: r99}``, the fewest dims holding that energy fraction
            (``decompose.rank_for_energy``).
    """

    name: str
    cumulative_energy: Tensor
    dims_needed: dict[float, int]
    whitened: bool = False  # True: the spectrum of the forms whitened by calibration tokens (docs/math.md)
    dims_per_entry: int = 1  # 2 for a rotary layer: an entry of its spectrum is one shared pair (two dims)
    pair_shares: Optional[Tensor] = None  # rotary: (frequencies, 3) share of a frequency's energy in 1, 2, 3 pairs

    @property
    def total_dims(self) -> int:
        """The dims a full-rank layer may use: ``min(D, Nh*dh)`` (rotary: ``Nh*dh``, in pairs of dims)."""
        return int(self.cumulative_energy.numel()) * self.dims_per_entry


SHARED_PAIRS = (1, 2, 3)  # a rotary layer's table: each frequency's energy share in its first 1, 2, 3 shared pairs


def rotary_spectrum(name: str, attn: nn.Module) -> LayerSpectrum:
    """Section 3.1 under rope: a rotary layer's heads share a frequency's complex pairs (``rotary_fit.py``), so its
    spectrum counts shared pairs (the per-frequency fits at every rank, pairs spread over the frequencies as the
    weight-only conversion spreads them) and each frequency's share of its heads' joint energy held by its first 1,
    2, 3 shared pairs (RESULTS.md (c) under rope)."""
    freqs = rotary_fit.frequencies(attn)
    planned = rotary_fit.plan(freqs)
    energy = freqs.energy.sum(1).clamp_min(1e-300)
    shares = torch.tensor([[1 - fits[min(r, len(fits) - 1)].error / float(energy[p]) for r in SHARED_PAIRS]
                           for p, fits in enumerate(planned.fits)], dtype=torch.float64)
    cumulative = planned.spectrum().double()
    dims = {t: 2 * rank_for_energy(cumulative, t) for t in THRESHOLDS}
    return LayerSpectrum(name, cumulative, dims, dims_per_entry=2, pair_shares=shares)


@torch.no_grad()
def check_spectra(model: nn.Module, layers: list[tuple[str, nn.Module]], calibrated: bool) -> bool:
    """Whether ``layers`` are rotary (then all of them, and no calibration images: a one-line ``ValueError``), checked
    before any calibration image is read."""
    if not any(is_rotary(attn, model) for _, attn in layers):
        return False
    rotary_fit.only_rotary(model, layers)
    if calibrated:
        raise ValueError("the whitened spectrum of rotary attention (calibration images): not yet; without "
                         "--calibration-* the weights' spectrum per frequency is given")
    return True


def layer_spectra(model: nn.Module, calibration: Tensor | None = None, ridge: float = DEFAULT_RIDGE
                  ) -> list[LayerSpectrum]:
    """The section 3.1 spectrum of every timm ``Attention`` layer of ``model`` (weights copied to float64 on CPU).

    With ``calibration`` images (B, C, H, W), the spectrum of the whitened forms ``Lq^T T_i Lk`` instead: the dims
    that carry the logits on the tokens each layer sees (docs/math.md, "Data-aware conversion").

    Only the query/key weights enter: biases shift logits by terms that the collaborative layer carries in its
    content bias, and with ``qk_norm`` the per-head normalisation sits between the projections (the spectrum then
    describes the weights, not the logits). The model is left unchanged.

    Raises:
        ValueError: if the model has no ``Attention`` layer, rotary layers with ``calibration`` (not yet) or beside
            standard ones, or a layer's head dims do not fill the embedding dim (``attn_head_dim`` set), which
            ``decompose.split_qkv_heads`` does not handle.
    """
    spectra = []
    layers = timm_attention_layers(model)
    if check_spectra(model, layers, calibration is not None):
        return [rotary_spectrum(name, attn) for name, attn in layers]
    moments = None
    if calibration is not None:
        was_training = model.training
        moments, _, _, _ = source_tokens(model.eval(), layers, calibration, calibration.shape[0], 64)
        model.train(was_training)
    for index, (name, attn) in enumerate(layers):
        weight = attn.qkv.weight.detach().to(device="cpu", dtype=torch.float64)
        if weight.shape[0] != 3 * weight.shape[1]:
            raise ValueError(f"{name}: qkv weight {tuple(weight.shape)} is not (3D, D); attn_head_dim is not supported")
        wq, wk = split_qkv_heads(weight, attn.num_heads)
        if moments is not None:
            side_q, side_k = whitening(moments[index], ridge)
            wq, wk = side_q.root.T @ wq, side_k.root.T @ wk
        query_energy, _ = energy_spectrum(wq, wk)
        dims = {t: rank_for_energy(query_energy, t) for t in THRESHOLDS}
        spectra.append(LayerSpectrum(name, query_energy, dims, moments is not None))
    return spectra


def _dims_at(spectrum: LayerSpectrum, threshold: float) -> int:
    return spectrum.dims_needed.get(threshold) or \
        spectrum.dims_per_entry * rank_for_energy(spectrum.cumulative_energy, threshold)


def suggest_key_dim(spectra: list[LayerSpectrum], threshold: float = 0.95, multiple_of: int = 1) -> int:
    """A collaborative ``key_dim`` (``D~k``, section 3.2) that keeps ``threshold`` of the energy in every layer.

    Args:
        spectra: From ``layer_spectra``.
        threshold: Energy fraction in (0, 1].
        multiple_of: Round the result up to a multiple of this (e.g. 8 or the head count), positive int.

    Returns:
        The max over layers of the dims needed at ``threshold``, rounded up to ``multiple_of``.
    """
    fraction(threshold, "threshold")
    positive_int(multiple_of, "multiple_of")
    if not spectra:
        raise ValueError("spectra is empty")
    need = max(_dims_at(s, threshold) for s in spectra)
    return math.ceil(need / multiple_of) * multiple_of


def format_spectrum_table(spectra: list[LayerSpectrum]) -> str:
    """Markdown table, one row per layer: dims needed for 90 / 95 / 99 % of the energy and the total dims."""
    rotary = spectra[0].pair_shares is not None
    head = ["layer"] + [f"dims for {t:.0%}".replace("%", " %") for t in THRESHOLDS] + ["total dims"]
    head += [f"energy share in {r} shared pair{'s' if r > 1 else ''}" for r in SHARED_PAIRS] if rotary else []
    rows = [head, ["---"] + ["---:"] * (len(head) - 1)]
    for s in spectra:
        shares = [f"{v:.3f}" for v in s.pair_shares.mean(0).tolist()] if rotary else []
        rows.append([s.name] + [str(_dims_at(s, t)) for t in THRESHOLDS] + [str(s.total_dims)] + shares)
    note = ("\nrotary: dims count pairs (each carries one frequency); a frequency's energy share in its first 1, 2, "
            "3 shared pairs, mean over its frequencies\n") if rotary else ""
    return "\n".join("| " + " | ".join(row) + " |" for row in rows) + "\n" + note


def plot_spectra(spectra: list[LayerSpectrum], path: Path, title: str = "") -> Path:
    """PNG of cumulative energy vs number of dims, one line per layer coloured by depth (Figure 1 of section 3.1).

    Drawn with matplotlib's object-oriented API on an Agg canvas (no pyplot, no display, no global backend change),
    with guides at 90 / 95 / 99 %. The file is written by ``weights_io.atomic_write`` (readers never see a partial
    PNG; a full disk is a one-line ``WriteError``).

    Returns:
        ``path``.
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    if not spectra:
        raise ValueError("spectra is empty")
    path = Path(path)
    fig = Figure(figsize=(7.0, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    cmap = colormaps["viridis"]
    norm = Normalize(vmin=0, vmax=max(len(spectra) - 1, 1))
    for depth, s in enumerate(spectra):
        energy = s.cumulative_energy.detach().cpu().double().numpy()
        step = s.dims_per_entry
        ax.plot(range(step, step * len(energy) + 1, step), energy, color=cmap(norm(depth)), lw=1.4, label=s.name)
    total = max(s.total_dims for s in spectra)
    for t in THRESHOLDS:
        ax.axhline(t, color="0.45", ls="--", lw=0.8, zorder=0)
        ax.annotate(f"{t:.0%}".replace("%", " %"), (1.0, t), xycoords=("axes fraction", "data"), xytext=(3, 0),
                    textcoords="offset points", va="center", fontsize=8, color="0.35")
    ax.set_xlim(0, total)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("number of dimensions (top singular directions kept)")
    ax.set_ylabel("cumulative energy of concatenated $W_{q,i} W_{k,i}^T$")
    ax.set_title(title or "Key/query redundancy across heads (sec. 3.1)")
    ax.grid(alpha=0.25)
    if len(spectra) <= 4:
        ax.legend(loc="lower right", fontsize=8)
    else:
        bar = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, pad=0.08)
        bar.set_label("layer (depth)")
        bar.set_ticks(range(len(spectra)))
        if len(spectra) > 16:
            bar.set_ticks(range(0, len(spectra), math.ceil(len(spectra) / 12)))
    fig.tight_layout()

    atomic_write(str(path), lambda f: fig.savefig(f, format="png"))
    return path
