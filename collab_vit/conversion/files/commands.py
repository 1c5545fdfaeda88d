"""``collab-vit convert`` and ``collab-vit analyze``: a timm ViT -> collaborative file or hub folder, spectrum.

The source is any timm model whose attention converts (``support.py``: timm's ViT family) by name (``--model``,
timm's pretrained weights), a weights file for that name (``--checkpoint``, e.g. a DeiT ``.pth``, loaded through
timm's pretrained path), or a file this package wrote (a training export or checkpoint): those record the model name
and keyword arguments, which are then used as they are (any size, image size, channels or classes).
"""
from __future__ import annotations

import copy
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional
from urllib.parse import urlparse

import timm
import torch
import torch.nn as nn

from .spectrum import check_spectra, format_spectrum_table, layer_spectra, plot_spectra, suggest_key_dim
from ...weights_io import (HUB_OUTPUT, atomic_write, check_fit, check_output_folder, export_writer, model_pipeline,
                           one_line, read_weights, write_folder, write_together)
from ..weights.whitening import DEFAULT_RIDGE
from ..calibration.capture import calibration_images
from ..weights.dims import KeyDimSpec, check_spec, layer_dims
from ..calibration import state
from ..calibration.objective import DESCRIPTIONS
from ..calibration.recipe import Recipe
from .record import converted_record, full_rank_record, rebuild_problem, swap_layers
from ..reparam import LayerReport, convert_model, probe_input_size, timm_attention_layers
from ..weights.rotary import is_rotary, rotary_like
from ..calibration.blockwise import PARAMS
from ..weights.support import Support, attention_forms, check_model


RANDOM = "none"  # --checkpoint none: the architecture's random initialisation (to try the tool, or offline)


def load_source(model: Optional[str], checkpoint: Optional[str] = None, model_kwargs: Optional[dict[str, Any]] = None,
                seed: int = 0) -> tuple[nn.Module, str, dict[str, Any], dict[str, Any]]:
    """The source model in eval mode, its name, its keyword arguments and the checkpoint's metadata.

    A checkpoint that records ``model_name`` / ``model_kwargs`` (this package's exports) is loaded strictly into
    that model; other files (timm / DeiT ``.pth``) go through timm's pretrained path for ``model``, with
    ``model_kwargs`` (e.g. ``img_size``, ``patch_size``, ``depth``, ``num_classes``) describing their architecture
    (the file's classifier is kept whatever its number of classes); a file that does not fit is one line naming
    the first keys and shapes that differ. ``checkpoint="none"`` builds ``model``'s random initialisation (seeded);
    with no checkpoint, timm's pretrained weights for ``model`` are downloaded (an unreachable hub is one line, at
    once, naming ``--checkpoint``).
    """
    kwargs = dict(model_kwargs or {})
    meta: dict[str, Any] = {}
    overlay: dict[str, Any] = {}
    if checkpoint == RANDOM:
        if not model:
            raise ValueError("--checkpoint none (random weights) needs --model")
        torch.manual_seed(seed)
        return _create(model, kwargs).eval(), model, kwargs, meta
    if checkpoint is not None:
        if not Path(checkpoint).is_file():
            raise FileNotFoundError(f"checkpoint not found: {checkpoint}")
        state, meta = read_weights(str(checkpoint))
        recorded = meta.get("model_name")
        if recorded:
            if model and model != recorded:
                raise ValueError(f"{checkpoint} holds {recorded!r}, not --model {model!r}")
            kwargs = {**(meta.get("model_kwargs") or {}), **kwargs}
            source = _create(recorded, kwargs)
            check_fit(source.state_dict(), state, str(checkpoint))
            source.load_state_dict(state, strict=True)
            return source.eval(), recorded, kwargs, meta
        if not model:
            raise ValueError(f"{checkpoint} does not record its model: give --model (e.g. deit_base_patch16_224)")
        overlay = dict(file=str(checkpoint))
        if "num_classes" in kwargs:  # the file's head: timm would drop a head whose size differs from its cfg's
            overlay["num_classes"] = kwargs["num_classes"]
        try:
            source = _create(model, kwargs, pretrained=True, pretrained_cfg_overlay=overlay)
        except RuntimeError as error:  # torch's load_state_dict: its lines after the first name the keys
            check_fit(_create(model, kwargs, device="meta").state_dict(), state, str(checkpoint))
            raise ValueError(" ".join(str(error).split())) from None
        return source.eval(), model, kwargs, meta
    if not model:
        raise ValueError("give --model (timm's pretrained weights) or --checkpoint FILE")
    return _download(model, kwargs).eval(), model, kwargs, meta


def _download(model: str, kwargs: dict[str, Any]) -> nn.Module:
    """``model`` with timm's pretrained weights; where their host cannot be reached (probed for a few seconds,
    unless a proxy or the hub's offline mode is set), a one-line error naming ``--checkpoint`` instead of the hub
    library's retries."""
    why = unreachable(weights_host(model))
    hint = (f"give --checkpoint FILE (the weights of {model}, .pth or .safetensors) or --checkpoint none (random "
            f"weights)")
    if why:
        raise ValueError(f"cannot download timm's pretrained weights for {model} ({why}): {hint}")
    try:
        return _create(model, kwargs, pretrained=True)
    except (OSError, RuntimeError) as error:  # the hub library's errors (connection, missing file, ...)
        raise ValueError(f"cannot download timm's pretrained weights for {model} ({one_line(error)}): {hint}") from None


def weights_host(model: str) -> Optional[str]:
    """The host timm downloads ``model``'s weights from (the Hugging Face hub's, or its cfg's URL), None if none."""
    from huggingface_hub import constants
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(model)
    if cfg is None or not (cfg.hf_hub_id or cfg.url):
        return None
    return urlparse(constants.ENDPOINT if cfg.hf_hub_id else cfg.url).hostname


def unreachable(host: Optional[str], timeout: float = 5.0) -> Optional[str]:
    """Why ``host`` cannot be reached on HTTPS within ``timeout`` s (None: reachable, or not ours to probe: no host,
    a proxy set, or the hub's offline mode, which reads its cache)."""
    from huggingface_hub import constants

    proxies = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
    if host is None or constants.HF_HUB_OFFLINE or any(os.environ.get(name) for name in proxies):
        return None
    endpoint = urlparse(constants.ENDPOINT)
    port = endpoint.port if host == endpoint.hostname else None
    try:
        socket.create_connection((host, port or 443), timeout=timeout).close()
    except OSError as error:
        return f"{host} unreachable: {error.strerror or error}"
    return None


def _create(name: str, kwargs: dict[str, Any], **extra: Any) -> nn.Module:
    try:
        return timm.create_model(name, **extra, **kwargs)
    except TypeError as error:  # an unknown keyword
        raise ValueError(f"model kwargs {kwargs} do not fit {name}: {error}") from None


def weights_origin(model: nn.Module, checkpoint: Optional[str]) -> str:
    """Where the source's weights came from, as a hub folder records it: ``"checkpoint FILE"`` (the file's name) for
    ``--checkpoint``, else timm's pretrained tag (``name.tag``) :func:`load_source` downloaded."""
    if checkpoint == RANDOM:
        return "random initialisation (--checkpoint none)"
    if checkpoint is not None:
        return f"checkpoint {Path(checkpoint).name}"
    cfg = model.pretrained_cfg
    return f"{cfg['architecture']}.{cfg['tag']}" if cfg.get("tag") else str(cfg.get("hf_hub_id") or cfg["architecture"])


def parse_key_dim(text: str) -> KeyDimSpec:
    """``--key-dim``: ``384`` (all layers) or ``384,384,256,...`` (one per layer), read once here and checked by
    ``dims.check_spec``."""
    value: object = text
    try:
        value = [int(part) for part in text.split(",")] if "," in text else int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            pass
    return check_spec(value)


def format_report(reports: list[LayerReport]) -> str:
    """Markdown table of the per-layer reports; says what the output error was measured on."""
    head = ["layer", "key dim", "rel. error of T", "rel. error of attention output", "seconds"]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for r in reports:
        cells = [r.name, str(r.key_dim), f"{r.tensor_error:.4f}", f"{r.output_error:.4f}", f"{r.seconds:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    notes = {f"attention-output error on {r.error_tokens}" for r in reports}
    return "\n".join(lines) + "\n\n" + "; ".join(sorted(notes))


def format_summary(summary: dict[str, Any]) -> str:
    """One line per candidate of the calibrated recipe (its held-out score of the conversion's objective: the KL to
    the source's outputs for a classifier, ``objective.DESCRIPTIONS``), and which was kept (of a feature model, with
    its held-out cosine to the source's features)."""
    objective = summary.get("objective", "kl")
    short = {"kl": "KL", "cosine": "1 - cosine", "mse": "relative squared error"}[objective]
    lines = [f"candidates, {DESCRIPTIONS[objective]} (objective: {objective}) on "
             f"{summary['images_held_out'] or summary['images_fit']} {summary['measured_on']}:"]
    lines += [f"  {name}: {score:.4g}" + ("  <- kept" if name == summary["chosen"] else "")
              for name, score in summary["candidates"].items()]
    guard = summary.get("guard")
    if guard:
        verdict = "kept" if guard["kept"] else "not resolved: weight-only kept"
        lines.append(f"guard: {guard['candidate']} gains {guard['gain']:.4g} per held-out image over weight-only "
                     f"({guard['confidence']:.0%} interval [{guard['low']:.4g}, {guard['high']:.4g}]): {verdict}")
    gain = summary.get("gain_over_weight_only")
    if gain is not None:
        lines.append(f"kept {summary['chosen']}: held-out {short} {summary['held_out_kl']:.4g}, weight-only "
                     f"{summary['weight_only_kl']:.4g} ({gain:.4g} lower)")
    if summary.get("held_out_cosine") is not None:
        weight = summary.get("weight_only_cosine")
        lines.append(f"held-out cosine to the source's features: {summary['held_out_cosine']:.6f}"
                     + ("" if weight is None else f", weight-only {weight:.6f}"))
    return "\n".join(lines)


def check_parent(out: Path, flag: str = "--out") -> None:
    """A one-line ``ValueError`` unless ``out``'s folder exists and this process can create a file in it (a probe
    file, created and removed: mode bits, ACLs, a read-only mount or a root-squashed share all answer it). A missing
    folder is refused, never created, so a mistyped path does not go unnoticed; checked before any work."""
    out = out.absolute()
    parent = out.parent
    if not parent.is_dir():
        what = "is not a folder" if parent.exists() else "does not exist"
        raise ValueError(f"{flag} {out}: its folder {parent} {what} (create it first: the command does not create "
                         f"folders, so a mistyped path is not silently followed)")
    try:
        handle, probe = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".probe", dir=parent)
    except OSError as error:
        raise ValueError(f"{flag} {out}: cannot write into {parent} ({error.strerror or one_line(error)}): choose a "
                         f"folder you can write to") from None
    os.close(handle)
    os.unlink(probe)


def output_kind(out: Path) -> str:
    """``"file"`` for ``X.safetensors``, ``"folder"`` for a folder path (timm's hub layout); else a one-line error.
    Its folder is checked first (:func:`check_parent`)."""
    check_parent(out)
    if out.suffix == ".safetensors":
        if out.is_dir():
            raise ValueError(f"--out {out} is a folder; a .safetensors output must be a file")
        return "file"
    if out.suffix and not out.is_dir():
        raise ValueError(f"--out must be a .safetensors file or a folder (timm's hub layout), got {out}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    check_output_folder(str(out), HUB_OUTPUT)  # an earlier output is replaced; other files are never mixed in
    return "folder"


def check_source(model_name: str, model_kwargs: Optional[dict[str, Any]] = None,
                 key_dim: KeyDimSpec = None) -> Support:
    """The support of ``model_name``'s architecture, built without weights on the meta device (nothing downloaded,
    no memory; on the CPU where a model cannot be built on ``meta``): a one-line ``ValueError`` for a model that
    cannot be converted (``support.check_model``), or a key dim it does not take (``dims.layer_dims``: beyond a
    layer's full rank, odd on a rotary layer, a list of another length)."""
    try:
        skeleton = _create(model_name, dict(model_kwargs or {}), device="meta")
    except NotImplementedError:  # an init that needs real tensors
        skeleton = _create(model_name, dict(model_kwargs or {}))
    support = check_model(skeleton)
    check_dims(skeleton, support.layers, key_dim, beyond=False)
    return support


def check_dims(model: nn.Module, layers: list[tuple[str, nn.Module]], key_dim: KeyDimSpec, beyond: bool = True
               ) -> None:
    """``--key-dim`` against ``model``'s attention ``layers`` (``dims.layer_dims``; works on meta): a list of
    another length, odd on a rotary layer, and with ``beyond`` (layers in timm's form: ``timm_attention_layers``)
    above a layer's full rank."""
    if key_dim is not None:  # full rank: nothing to check
        layer_dims(key_dim, layers, even=any(is_rotary(attn, model) for _, attn in layers),
                   beyond="--key-dim" if beyond else None)


REPORT_BYTES = (4096, 1024)  # a JSON report of the output (its sidecar, its metadata, a folder's config.json) at
# most: a fixed part and a part per attention layer (measured: 2145 bytes for two layers, its layers' lines 250 each)
TENSOR_HEADER = 96  # bytes of a tensor's entry in a safetensors header beside its name (dtype, shape, offsets)


def output_files(model: nn.Module, key_dim: KeyDimSpec, kind: str) -> tuple[list[int], list[int]]:
    """The bytes of each file the conversion of ``model`` at ``key_dim`` writes (``kind``: ``output_kind``'s) and of
    each refined layer's weights as the state folder commits them (``blockwise.PARAMS``): from a copy of ``model`` on
    the meta device whose attention layers are swapped for the collaborative ones (``record.swap_layers``), each
    weights file with its header, and its reports (``REPORT_BYTES``)."""
    memo: dict[int, Any] = {id(t): torch.empty_like(t, device="meta") for t in model.buffers()}
    memo.update({id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad) for p in model.parameters()})
    skeleton = copy.deepcopy(model, memo)  # no tensor copied
    record = full_rank_record(skeleton)
    forms = attention_forms(skeleton)
    for (name, form), dim in zip(forms, layer_dims(key_dim, forms)):
        record[name]["key_dim"] = dim
        if is_rotary(form, skeleton):
            record[name]["layer"] = type(rotary_like(form, dim)).__name__

    def stored(tensors: dict[str, torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() + len(name) + TENSOR_HEADER for name, t in tensors.items())

    weights = stored(swap_layers(skeleton, record).state_dict())
    layers = [stored({k: p for k, p in skeleton.get_submodule(name).named_parameters() if k in PARAMS})
              for name in record]
    report = REPORT_BYTES[0] + REPORT_BYTES[1] * len(record)
    return [weights + report, report] + ([report] if kind == "folder" else []), layers


def convert_to_file(model_name: Optional[str], key_dim: KeyDimSpec, out: Path,
                    checkpoint: Optional[str] = None, seed: int = 0, model_kwargs: Optional[dict[str, Any]] = None,
                    calibration: Optional[Callable[[nn.Module, dict[str, Any]], Any]] = None, device: str = "cpu",
                    save_folder: Optional[Callable[..., Any]] = None, **options) -> list[LayerReport]:
    """Convert, then write ``out``: a ``.safetensors`` file (name, key dims and errors in its metadata) and a JSON
    sidecar, written together, or, for a folder path, ``save_folder(model, out, data_config, source, files,
    weights=...)`` (``collab_vit.save_pretrained``: timm's hub layout; ``weights``: :func:`weights_origin`) with the
    report in ``out/conversion.json``.

    Any timm model whose attention layers convert (``support.py``); the architecture is checked without weights
    before anything is downloaded or written. The file records the collaborative model as its source
    (``record.py``: the source's name and keyword arguments, see :func:`load_source`, and each layer's class and key
    dim; a timm DeiT as ``collab_deit_*``) and the source's evaluation data config, so ``eval.py`` and
    ``timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=out))`` rebuild the converted model
    from the file alone. ``calibration(source_model, metadata)`` gives calibration
    images (the calibrated recipe; ``options``: ``effort``, ``progress``, and ``recipe`` for the tests); nothing is
    written when they are bad.
    ``device`` runs the model's forward passes and the refinement there (the decompositions run on the CPU).
    """
    kind = output_kind(out)
    if kind == "folder" and save_folder is None:
        raise ValueError(f"--out {out}: a folder output needs save_folder (collab_vit.save_pretrained)")
    if model_name:
        check_source(model_name, model_kwargs, key_dim)  # an unsupported model fails before any download
    if calibration is not None:
        state.hold()  # one run per output: another one on the same --out is refused here, before any work
    model, model_name, source_kwargs, meta = load_source(model_name, checkpoint, model_kwargs, seed)
    support = check_model(model)
    check_dims(model, timm_attention_layers(model), key_dim)
    model.to(device)
    if calibration is not None:
        state.expect_output(*output_files(model, key_dim, kind))  # counted in the disk check before the first image
        options["calibration"] = calibration(model, meta)
    reports = convert_model(model, key_dim, options.get("calibration"), options.get("effort", "default"),
                            seed, options.get("progress", True), options.get("recipe") or Recipe())
    info = {"source": checkpoint or model_name, "method": "tucker", "seed": seed,
            "layers": [r.as_dict() for r in reports], "kept": support.kept}
    if getattr(reports, "summary", None):
        info["calibration"] = reports.summary
    data_config = meta.get("data_config") or model_pipeline(model)
    model.cpu()
    if kind == "folder":  # written all or none, with its report (weights_io.write_folder)
        text = json.dumps({"source_model": model_name, **info}, indent=2)
        save_folder(model, str(out), data_config, (model_name, source_kwargs), {"conversion.json": text},
                    weights=weights_origin(model, checkpoint))
        return reports
    args = {**source_kwargs, "num_classes": model.num_classes} if model.num_classes != 1000 else source_kwargs
    target, model_kwargs = converted_record(model, model_name, args)
    why = rebuild_problem(model, target, model_kwargs)
    if why is not None:  # a bug of the record: nothing is written
        raise ValueError(f"{model_name} converted but its record does not rebuild it: {why}")
    extra: dict[str, Any] = {"conversion": info, "data_config": data_config}
    text = json.dumps({"model_name": target, "model_kwargs": model_kwargs, **info}, indent=2)
    write_together({str(out): export_writer(model.state_dict(), target, model_kwargs, extra),  # all or none
                    str(out.with_suffix(".json")): lambda f: f.write(text.encode())})
    return reports


ANALYZE_OUTPUT = ("spectrum.md", "spectrum.png")  # what ``collab-vit analyze`` writes into its --out folder


def analyze_to_files(model_name: Optional[str], checkpoint: Optional[str], out: Path, threshold: float = 0.95,
                     calibration: Optional[Callable[[nn.Module, dict[str, Any]], Any]] = None,
                     model_kwargs: Optional[dict[str, Any]] = None, seed: int = 0) -> tuple[str, int]:
    """Per-layer spectrum table (Markdown) and the key dim suggested at ``threshold``; with ``calibration(model,
    metadata)`` images, of the whitened forms (the table's last line says which). ``out``, a folder written all or
    none, gets ``spectrum.md`` (the table and the suggestions) and ``spectrum.png`` (the plot); ``seed``: of a
    ``checkpoint="none"`` source's weights."""
    check_parent(out)  # before any work: a folder that exists and takes files
    check_output_folder(str(out), ANALYZE_OUTPUT)  # other files are never mixed in
    if model_name:
        check_source(model_name, model_kwargs)
    model, model_name, _, meta = load_source(model_name, checkpoint, model_kwargs, seed)
    check_spectra(model, timm_attention_layers(model), calibration is not None)  # before any image is read
    images = None if calibration is None else calibration_images(calibration(model, meta), probe_input_size(model))
    spectra = layer_spectra(model, images, DEFAULT_RIDGE)
    which = "weights" if images is None else f"whitened by {images.shape[0]} calibration images"
    table = format_spectrum_table(spectra) + f"\nspectrum of the bilinear forms: {which}\n"
    key_dim = suggest_key_dim(spectra, threshold)
    text = (f"# {model_name}: key/query redundancy (section 3.1)\n\n{table}\nsuggested key_dim ({threshold:.0%} of "
            f"the energy in every layer): {key_dim}\n")

    def fill(folder: str) -> None:
        plot_spectra(spectra, Path(folder) / "spectrum.png", title=f"{model_name}: key/query redundancy (section "
                     f"3.1; {which})")
        atomic_write(str(Path(folder) / "spectrum.md"), lambda f: f.write(text.encode()))

    write_folder(str(out), fill, ANALYZE_OUTPUT)
    return table, key_dim
