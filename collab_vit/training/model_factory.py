"""Model construction shared by training and evaluation: timm's registry (with ours registered) and weight loading."""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import timm
import torch

from .. import models  # noqa: F401  (registers collab_deit_* / concat_deit_* with timm)
from ..weights_io import read_weights

_logger = logging.getLogger(__name__)


def build_model(name: str, num_classes: int, img_size: Optional[int] = None, drop_path: float = 0.0,
                 model_kwargs: Optional[Dict[str, Any]] = None) -> torch.nn.Module:
    """``timm.create_model`` with our models registered; ``img_size=None`` keeps the model's default."""
    kwargs = dict(model_kwargs or {})
    if img_size is not None:
        kwargs['img_size'] = img_size
    if drop_path:
        kwargs['drop_path_rate'] = drop_path
    return timm.create_model(name, num_classes=num_classes, **kwargs)


def load_weights(model: torch.nn.Module, path: str, use_ema: bool = False, allow_new_head: bool = False) -> Dict:
    """Load weights from our checkpoint, a ``.safetensors`` export or a timm/DeiT ``.pth`` into ``model``.

    With ``allow_new_head`` a classifier of another size (fine-tuning to a new dataset) is left at its init.
    Returns the file's metadata.
    """
    state, meta = read_weights(path, use_ema=use_ema)
    own = model.state_dict()
    if allow_new_head:
        for key in list(state):
            if key.startswith('head.') and key in own and state[key].shape != own[key].shape:
                _logger.warning('not loading %s: shape %s, model has %s', key, tuple(state[key].shape),
                                tuple(own[key].shape))
                del state[key]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (allow_new_head and k.startswith('head.'))]
    if missing or unexpected:
        raise RuntimeError(f'weights in {path} do not fit the model: missing {missing[:5]}, '
                           f'unexpected {unexpected[:5]}' + (' ...' if len(missing) + len(unexpected) > 10 else ''))
    return meta
