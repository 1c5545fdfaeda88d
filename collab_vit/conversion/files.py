"""``collab-vit convert`` and ``collab-vit analyze``: pretrained DeiT -> collaborative file, redundancy spectrum."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional, Union

import timm
import torch.nn as nn

from .spectrum import format_spectrum_table, layer_spectra, plot_spectra, suggest_key_dim
from ..weights_io import atomic_write, export_safetensors
from .reparam import LayerReport, reparametrize_layers

DEIT_NAME = re.compile(r"^deit_(tiny|small|base)_patch16_224$")


def collaborative_name(source: str) -> str:
    """Registered collaborative model for a timm DeiT name; a one-line error for anything else."""
    match = DEIT_NAME.match(source)
    if not match:
        raise ValueError(f"collab-vit convert supports deit_{{tiny,small,base}}_patch16_224, got {source!r}; "
                         f"use collab_vit.reparametrize(model, ...) for other timm ViTs")
    return f"collab_deit_{match.group(1)}_patch16_224"


def load_source(model: str, checkpoint: Optional[str] = None, model_kwargs: Optional[dict[str, Any]] = None
                ) -> nn.Module:
    """A timm model with its pretrained weights (timm's hub) or the weights of ``checkpoint`` (.pth/.safetensors).

    ``model_kwargs`` (e.g. ``img_size``, ``patch_size``, ``depth``, ``num_classes``) describe the architecture of
    ``checkpoint``: its classifier is kept whatever its number of classes.
    """
    kwargs = dict(model_kwargs or {})
    overlay = {}
    if checkpoint is not None:
        if not Path(checkpoint).is_file():
            raise FileNotFoundError(f"checkpoint not found: {checkpoint}")
        overlay = dict(file=str(checkpoint))
        if "num_classes" in kwargs:  # the file's head: timm would drop a head whose size differs from its cfg's
            overlay["num_classes"] = kwargs["num_classes"]
    try:
        return timm.create_model(model, pretrained=True, pretrained_cfg_overlay=overlay or None, **kwargs).eval()
    except TypeError as error:  # an unknown keyword
        raise ValueError(f"model kwargs {kwargs} do not fit {model}: {error}") from None


def parse_key_dim(text: str) -> Union[int, float, list[int]]:
    """``384`` (all layers), ``0.95`` (energy threshold) or ``384,384,256,...`` (one per layer)."""
    try:
        if "," in text:
            return [int(part) for part in text.split(",")]
        return float(text) if "." in text else int(text)
    except ValueError:
        raise ValueError(f"--key-dim must be an int, a threshold like 0.95, or a comma list of ints, got {text!r}")


def format_report(reports: list[LayerReport]) -> str:
    lines = ["| layer | key dim | rel. error of T | rel. error of attention output | seconds |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r.name} | {r.key_dim} | {r.tensor_error:.4f} | {r.output_error:.4f} | {r.seconds:.2f} |"
              for r in reports]
    return "\n".join(lines)


def convert_to_file(model_name: str, key_dim: Union[None, int, float, list[int]], method: str, out: Path,
                    checkpoint: Optional[str] = None, seed: int = 0, model_kwargs: Optional[dict[str, Any]] = None,
                    **options) -> list[LayerReport]:
    """Convert, then write ``out`` (safetensors with name, key dims and errors in its metadata) and a JSON sidecar.

    ``model_kwargs`` (the source's architecture, see :func:`load_source`) are recorded with the key dims, so that
    ``eval.py`` and ``timm.create_model`` rebuild the converted model from the file alone.
    """
    target = collaborative_name(model_name)
    if out.suffix != ".safetensors":
        raise ValueError(f"--out must end in .safetensors, got {out}")
    model = load_source(model_name, checkpoint, model_kwargs)
    reports = reparametrize_layers(model, key_dim, method, seed, **options)
    model_kwargs = {**(model_kwargs or {}), "key_dim": [r.key_dim for r in reports]}
    if model.num_classes != 1000:
        model_kwargs["num_classes"] = model.num_classes
    info = {"source": checkpoint or model_name, "method": method, "seed": seed,
            "layers": [r.as_dict() for r in reports]}
    out.parent.mkdir(parents=True, exist_ok=True)
    export_safetensors(model.state_dict(), str(out), target, model_kwargs, extra={"conversion": info})
    sidecar = out.with_suffix(".json")
    text = json.dumps({"model_name": target, "model_kwargs": model_kwargs, **info}, indent=2)
    atomic_write(str(sidecar), lambda tmp: Path(tmp).write_text(text))
    return reports


def analyze_to_files(model_name: str, checkpoint: Optional[str], plot: Path, threshold: float = 0.95
                     ) -> tuple[str, int]:
    """Per-layer spectrum table (Markdown), PNG plot, and the key dim suggested at ``threshold``."""
    spectra = layer_spectra(load_source(model_name, checkpoint))
    plot_spectra(spectra, plot, title=f"{model_name}: key/query redundancy (section 3.1)")
    return format_spectrum_table(spectra), suggest_key_dim(spectra, threshold)
