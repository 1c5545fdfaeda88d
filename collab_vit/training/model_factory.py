"""Model construction shared by training and evaluation: timm's registry (with ours registered) and weight loading."""
from __future__ import annotations

import difflib
import logging
import re
from typing import Any, Dict, Optional

import timm
import torch
from timm.models import parse_model_name

from .. import models  # noqa: F401  (registers collab_deit_* / concat_deit_* with timm)
from ..conversion.pretrained import collab_filter_fn, conversion
from ..layers.attention import CollaborativeAttention
from ..weights_io import WeightsError, check_fit, model_pipeline, read_weights
from .errors import ConfigError

_logger = logging.getLogger(__name__)


def _has_source(name: str) -> bool:
    """``local-dir:DIR`` or ``hf-hub:ID``: timm reads the architecture from the folder's or repository's config."""
    try:
        return parse_model_name(name)[0] is not None
    except ValueError:  # a path without a source prefix, or an unknown prefix
        return False


def build_model(name: str, num_classes: int, img_size: Optional[int] = None, drop_path: float = 0.0,
                model_kwargs: Optional[Dict[str, Any]] = None) -> torch.nn.Module:
    """``timm.create_model`` with our models registered; ``img_size=None`` keeps the model's default.

    ``local-dir:DIR`` (a ``collab_vit.save_pretrained`` folder) and ``hf-hub:ID`` names are timm's: the architecture
    and keywords its ``config.json`` records (the weights are loaded separately, e.g. ``--checkpoint DIR``).

    An unknown model name, a keyword the model does not take, or a value it rejects (``key_dim`` <= 0, a per-block
    list of the wrong length, ...) is a one-line ConfigError.
    """
    kwargs = dict(model_kwargs or {})
    if img_size is not None:
        kwargs['img_size'] = img_size
    if drop_path:
        kwargs['drop_path_rate'] = drop_path
    if not timm.is_model(name) and not _has_source(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=1)
        raise ConfigError(f"unknown model '{name}'" + (f"; did you mean '{close[0]}'?" if close else ''))
    try:
        return timm.create_model(name, num_classes=num_classes, **kwargs)
    except TypeError as e:
        unknown = re.search(r"unexpected keyword argument '(\w+)'", str(e))
        if unknown is None:
            raise
        raise ConfigError(f"model '{name}' does not take the keyword '{unknown.group(1)}' (model_kwargs)") from None
    except ValueError as e:
        raise ConfigError(f"bad model_kwargs for '{name}': {str(e).strip().splitlines()[0]}") from None


def source_weights_pipeline(name: str, model: torch.nn.Module) -> Optional[Dict[str, Any]]:
    """For standard-attention weights converted on load into ``name``: the evaluation pipeline of the weights its
    registered pretrained tag converts (``collab_deit_*.fb_in1k``: timm's cfg of its DeiT weights), at the model's
    input size; None where the name has no such tag (the model's own cfg then applies)."""
    try:
        cfg = timm.models.get_pretrained_cfg(name)
    except (RuntimeError, ValueError):
        return None
    if cfg is None or not (cfg.hf_hub_id or cfg.url):
        return None
    return model_pipeline(model, cfg.to_dict())


def is_standard_attention_state(state: Dict[str, torch.Tensor]) -> bool:
    """True for weights of timm's standard ``Attention`` (a fused ``qkv`` projection), e.g. a DeiT release."""
    return any(k.endswith('attn.qkv.weight') for k in state)


def fit_state(model: torch.nn.Module, state: Dict[str, torch.Tensor], source: str, allow_new_head: bool = False,
              conversion_method: str = 'tucker') -> Dict[str, torch.Tensor]:
    """``state`` made ready for ``model.load_state_dict``, or a WeightsError listing what does not fit.

    Standard-attention weights (a timm/DeiT ``.pth``) for a collaborative model are converted exactly as
    ``pretrained=True`` converts them (``collab_vit.conversion.pretrained.collab_filter_fn``: timm's ViT filter, then
    the re-parametrisation of section 3.3 at the model's key dims). With ``allow_new_head`` a classifier of another
    size (fine-tuning to a new dataset) is left at its init.
    """
    collaborative = any(isinstance(m, CollaborativeAttention) for m in model.modules())
    if collaborative and is_standard_attention_state(state):
        _logger.info('converting the standard attention weights in %s to collaborative (%s)', source,
                     conversion_method)
        try:
            with conversion(conversion_method):
                state = collab_filter_fn(dict(state), model)
        except (ValueError, RuntimeError, KeyError) as e:
            raise WeightsError(f'cannot convert the standard attention weights in {source} for this model '
                               f'({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}); '
                               f'convert them first with `collab-vit convert`') from None
    own = model.state_dict()
    if allow_new_head:
        for key in list(state):
            if key.startswith('head.') and key in own and state[key].shape != own[key].shape:
                _logger.warning('not loading %s: shape %s, model has %s', key, tuple(state[key].shape),
                                tuple(own[key].shape))
                del state[key]
    check_fit(own, state, source, ignore_missing=('head.',) if allow_new_head else ())
    return state


def load_weights(model: torch.nn.Module, path: str, use_ema: bool = False, allow_new_head: bool = False,
                 conversion_method: str = 'tucker') -> Dict:
    """Load weights from our checkpoint, a ``.safetensors`` export or a timm/DeiT ``.pth`` into ``model``.

    See :func:`fit_state`; a file that does not fit is a WeightsError naming the mismatched keys and shapes.
    Returns the file's metadata.
    """
    state, meta = read_weights(path, use_ema=use_ema)
    model.load_state_dict(fit_state(model, state, path, allow_new_head, conversion_method), strict=False)
    return meta
