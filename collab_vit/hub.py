"""Collaborative models in timm's own hub format: ``save_pretrained`` writes a folder timm loads by itself.

``save_pretrained(model, DIR)`` writes, as timm's ``save_for_hf`` does, ``DIR/config.json`` (``architecture``: a
registered entry point; ``model_args``: its keywords; ``pretrained_cfg``: the evaluation pipeline the model carries,
i.e. its source's) and ``DIR/model.safetensors``. After ``import collab_vit``,
``timm.create_model("local-dir:DIR", pretrained=True)`` rebuilds the model with identical outputs;
``push_to_hf_hub(model, "USER/REPO")`` publishes the same files through timm's ``push_to_hf_hub``, and
``hf-hub:USER/REPO`` loads them back.

What is recorded (:func:`model_record`): a model converted from a timm model, as its source
(``conversion/files/record.py``: ``collab_vit_converted`` with the source's timm name and arguments and each converted
layer's class and key dim; a converted timm DeiT as ``collab_deit_{size}_patch16_224``). The source is ``source=(timm
name, kwargs)`` where given (``collab-vit convert`` gives it), else the model's own record: the architecture of its
``pretrained_cfg`` and the arguments ``timm.create_model`` noted on it. A model built by one of this package's entry
points (``collab_deit_*``, ``concat_deit_*``, ``collab_vit_*_rope*``, ``collab_vit_generic``, ``collab_vit_converted``)
is recorded under its own name. Before anything is written the model is rebuilt from the record and must give
bit-identical outputs on a probe input, else one line.

Provenance (:func:`provenance`): ``config.json`` has a top-level ``provenance`` key (timm ignores keys it does not
know) with the source's timm name and arguments, where the weights came from (``weights=``: timm's pretrained tag
``name.tag``, ``"checkpoint FILE"``, ...; "not stated" when the caller does not say) and where the evaluation pipeline
came from. timm's cfg of an architecture carries the tag of timm's weights for it (with their license and paper)
whether those weights were loaded or not: the folder keeps those entries only when ``weights`` names that tag.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch.nn as nn
from timm.layers import Attention
from timm.models import get_model_args, push_to_hf_hub as timm_push_to_hf_hub
from timm.models._hub import save_config_for_hf

from .conversion.weights.forms import is_beit_attention, is_eva_attention
from .conversion.files.record import CONVERTED_MODEL, LAYERS, SOURCE, converted_record, layer_record, rebuild_problem
from .layers.attention import CollaborativeAttention, ConcatAttention
from .models import OWN_MODELS
from .models_rope import ROPE_MODELS
from .weights_io import (EVAL_KEYS, HUB_CONFIG, HUB_OUTPUT, HUB_WEIGHTS, check_output_folder, model_pipeline,
                         safetensors_writer, write_file, write_folder)

Source = tuple[str, dict[str, Any]]  # a timm model name and the keyword arguments it was created with
TRAITS = ("img_size", "in_chans", "num_classes", "global_pool")  # what timm's save_for_hf adds from the model
ON_LOAD = ("conversion_options",)  # how standard weights were converted on load: not recorded
WEIGHT_CLAIMS = ("tag", "license", "description", "origin_url", "paper_name", "paper_ids", "notes", "label_names",
                 "label_descriptions")  # what a pretrained_cfg says of timm's weights for its tag
NOT_STATED = "not stated"
CHECKPOINT = "checkpoint "  # weights="checkpoint FILE": read from FILE


def _key_dim_arg(key_dims: list[int]) -> Any:
    """One key dim where all layers share it, else one per layer (the registered models' ``key_dim``)."""
    return key_dims[0] if len(set(key_dims)) == 1 else key_dims


def _source_args(model: nn.Module, kwargs: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The keyword arguments that create ``model``'s architecture: ``kwargs`` (else those ``timm.create_model``
    recorded on it), with its current input size, channels, classes and pooling (timm's ``get_model_args``)."""
    try:
        args = get_model_args(model, None if kwargs is None else dict(kwargs))
    except ValueError as error:  # an explicit argument that disagrees with the model
        raise ValueError(f"save_pretrained: {error}") from None
    args = {k: v for k, v in args.items() if k not in ON_LOAD and (kwargs is None or k in kwargs or k in TRAITS)}
    for key, value in args.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise ValueError(f"save_pretrained: the source's argument {key}={value!r} is not JSON; pass "
                             f"source=(timm name, kwargs) with values timm takes by name") from None
    return args


def _check_collaborative(model: nn.Module) -> None:
    """A one-line ``ValueError`` unless every attention layer of ``model`` is collaborative (or cut)."""
    standard = next((name for name, m in model.named_modules()
                     if isinstance(m, Attention) or is_beit_attention(m) or is_eva_attention(m)), None)
    if standard is not None or not any(isinstance(m, (CollaborativeAttention, ConcatAttention))
                                       for m in model.modules()):
        where = f"{standard} is standard attention" if standard is not None else "it has no collaborative layer"
        raise ValueError(f"save_pretrained needs every block's attention collaborative (collab_vit.reparametrize); "
                         f"{where}")


def model_record(model: nn.Module, source: Optional[Source] = None) -> tuple[str, dict[str, Any], Source]:
    """The registered entry point and keyword arguments that rebuild ``model`` (module docstring), checked: the
    model rebuilt from them gives bit-identical outputs, else a one-line ``ValueError``; and the source's timm name
    and arguments (the record itself for a model of this package's entry points)."""
    _check_collaborative(model)
    own = (getattr(model, "pretrained_cfg", None) or {}).get("architecture")
    name, kwargs = source if source is not None else (own, None)
    if not name:
        raise ValueError("save_pretrained: the model does not say which timm model it was converted from (no "
                         "pretrained_cfg architecture); pass source=(timm name, kwargs)")
    args = _source_args(model, kwargs)
    origin: Source = (name, dict(args))
    if name == CONVERTED_MODEL:
        origin = (args.get(SOURCE, name), {k: v for k, v in args.items() if k not in (SOURCE, LAYERS)})
        args[LAYERS] = layer_record(model)
    elif name in OWN_MODELS or name in ROPE_MODELS:
        args["key_dim"] = _key_dim_arg([m.key_dim for m in model.modules()
                                       if isinstance(m, (CollaborativeAttention, ConcatAttention))])
        origin = (name, dict(args))
    else:
        name, args = converted_record(model, name, args)
    why = rebuild_problem(model, name, args)
    if why is not None:
        hint = "" if source is not None else "; pass source=(timm name, kwargs) to save_pretrained"
        raise ValueError(f"save_pretrained cannot rebuild this {type(model).__name__}: {why}{hint}")
    return name, args, origin


def timm_weights(cfg: dict[str, Any]) -> set[str]:
    """The names timm gives the weights a ``pretrained_cfg`` describes: ``architecture.tag`` and its hub id's
    (e.g. a ``collab_deit_*`` cfg describes timm's ``deit_*.fb_in1k``); none without a tag."""
    if not cfg.get("tag"):
        return set()
    hub_id = cfg.get("hf_hub_id") or ""
    return {f"{cfg.get('architecture')}.{cfg['tag']}"} | ({hub_id.rpartition("/")[2]} if hub_id else set())


def provenance(model: nn.Module, origin: Source, weights: Optional[str], data_config: Optional[dict[str, Any]]
               ) -> dict[str, Any]:
    """The ``provenance`` entry of ``config.json`` (module docstring): the source's timm name and arguments, where
    the weights came from and where the pipeline did (``data_config`` where it is not the model's own)."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    own = model_pipeline(model)
    given = {k: list(v) if isinstance(v, tuple) else v for k, v in (data_config or {}).items() if k in EVAL_KEYS}
    if given and {**own, **given} != own:
        pipeline = ("the checkpoint's record" if (weights or "").startswith(CHECKPOINT)
                    else "data_config given to save_pretrained")
    elif cfg.get("source") in ("local-dir", "hf-hub"):
        pipeline = f"the {cfg['source']} record the model was loaded from"
    elif cfg.get("tag"):
        pipeline = f"timm's cfg for {cfg.get('architecture')}.{cfg['tag']}"
    else:
        pipeline = "the model's pretrained_cfg"
    return {"source_model": origin[0], "source_args": origin[1], "weights": weights or NOT_STATED,
            "data_config": pipeline}


@contextmanager
def _described(model: nn.Module, data_config: Optional[dict[str, Any]], source: Optional[Source],
               weights: Optional[str]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """``model_record`` (else a one-line ValueError), then, for the block, give ``model`` the ``pretrained_cfg``
    timm's ``save_for_hf`` records (architecture ours, the pipeline its source's or ``data_config``'s, the claims
    about timm's weights only where ``weights`` names them) and no factory arguments but the record's; yields the
    ``model_args`` and the top-level ``config.json`` keys (``provenance``)."""
    name, args, origin = model_record(model, source)
    cfg = dict(getattr(model, "pretrained_cfg", None) or {})
    extra = {"provenance": provenance(model, origin, weights, data_config)}
    if weights not in timm_weights(cfg):
        cfg = {k: v for k, v in cfg.items() if k not in WEIGHT_CLAIMS}
    cfg.update({k: tuple(v) if isinstance(v, list) else v for k, v in (data_config or {}).items() if k in EVAL_KEYS})
    cfg.update(architecture=name, num_classes=model.num_classes)
    cfg.setdefault("input_size", (model.patch_embed.proj.in_channels, *model.patch_embed.img_size))
    saved = {k: getattr(model, k) for k in ("pretrained_cfg", "_model_args") if k in model.__dict__}
    try:
        model.pretrained_cfg, model._model_args = cfg, {}  # what timm reads: ours only, not the source's kwargs
        yield args, extra
    finally:
        for key in ("pretrained_cfg", "_model_args"):
            if key in saved:
                setattr(model, key, saved[key])
            elif key in model.__dict__:
                delattr(model, key)


def save_pretrained(model: nn.Module, directory: str, data_config: Optional[dict[str, Any]] = None,
                    source: Optional[Source] = None, files: Optional[dict[str, str]] = None,
                    weights: Optional[str] = None) -> str:
    """Write ``model`` to ``directory`` in timm's hub layout (module docstring); returns the architecture name.

    ``data_config`` (keys of timm's data config: ``input_size``, ``crop_pct``, ``crop_mode``, ``interpolation``,
    ``mean``, ``std``) replaces those of the model's ``pretrained_cfg`` (its source's evaluation). ``source``: the
    timm name and keyword arguments the converted model was created with (default: the model's own record). ``files``
    (name -> text) are written beside the weights (``collab-vit convert``'s ``conversion.json``). ``weights``: where
    the weights came from, recorded in ``config.json``'s ``provenance``: timm's pretrained tag (``"name.tag"``, as
    ``timm.create_model(..., pretrained=True)`` loaded them; the folder then keeps that tag of the model's
    ``pretrained_cfg``, else it records none), ``"checkpoint FILE"`` (a ``data_config`` given with it is recorded as
    that checkpoint's record) or any text; default "not stated". A model its record
    cannot rebuild is a one-line ``ValueError`` and nothing is written. The folder is written all or none
    (``weights_io.write_folder``: staged beside it, then renamed; a full disk is a one-line ``WriteError``); an
    existing folder may hold only an earlier output (``HUB_OUTPUT``), which is replaced, never other files.
    """
    check_output_folder(directory, HUB_OUTPUT)
    with _described(model, data_config, source, weights) as (args, extra):
        def fill(staging: str) -> None:  # what timm's save_for_hf writes, through weights_io's writers
            write_file(os.path.join(staging, HUB_WEIGHTS), safetensors_writer(model.state_dict()))
            save_config_for_hf(model, os.path.join(staging, HUB_CONFIG), model_config=extra, model_args=args)
            for name, text in (files or {}).items():
                write_file(os.path.join(staging, name), lambda f, t=text: f.write(t.encode()))

        write_folder(directory, fill, HUB_OUTPUT)
        return model.pretrained_cfg["architecture"]


def push_to_hf_hub(model: nn.Module, repo_id: str, data_config: Optional[dict[str, Any]] = None,
                   source: Optional[Source] = None, weights: Optional[str] = None, **kwargs: Any) -> Any:
    """timm's ``push_to_hf_hub`` of the files ``save_pretrained`` writes (same check, same ``config.json``, only
    ``model.safetensors`` unless ``safe_serialization`` says otherwise); ``kwargs`` go to timm's function
    (``token``, ``private``, ``commit_message``, ``model_card``, ...)."""
    with _described(model, data_config, source, weights) as (args, extra):
        kwargs.setdefault("safe_serialization", True)
        return timm_push_to_hf_hub(model, repo_id, model_config=extra, model_args=args, **kwargs)
