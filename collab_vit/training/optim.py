"""The optimizer: timm's ``create_optimizer_v2`` and its param groups, with an lr multiplier for the mixing matrices.

Why a multiplier (``docs/math.md``, "A learning rate for the mixing"): under Adam(W) every parameter moves by about
the learning rate per update, whatever its scale. The mixing entries start at order one (concatenate init: 1;
random init: std ``sqrt(head_dim / key_dim)``) while the shared projections start at timm's std 0.02, so at one lr
the projections are rewritten while the mixing barely leaves its init. ``mixing_lr_scale`` multiplies the lr of
every ``*.mixing`` parameter through the param group's ``lr_scale``, which timm's schedulers honour and which
composes with ``layer_decay`` (the layer's own scale times this one). 1.0 (the default) leaves timm's groups as they
are.
"""
from __future__ import annotations

import torch
from timm.optim import create_optimizer_v2, param_groups_layer_decay, param_groups_weight_decay


def mixing_param_groups(model: torch.nn.Module, weight_decay: float, layer_decay: float | None,
                        mixing_lr_scale: float) -> list[dict]:
    """timm's param groups (weight decay, optional layer decay), each split into its mixing and other parameters;
    the mixing part gets ``lr_scale`` times ``mixing_lr_scale``."""
    no_decay = set(model.no_weight_decay()) if hasattr(model, 'no_weight_decay') else set()
    if layer_decay:
        groups = param_groups_layer_decay(model, weight_decay=weight_decay, no_weight_decay_list=no_decay,
                                          layer_decay=layer_decay)
    else:
        groups = param_groups_weight_decay(model, weight_decay=weight_decay, no_weight_decay_list=no_decay)
    mixing_ids = {id(p) for name, p in model.named_parameters() if name.endswith('.mixing')}
    split = []
    for group in groups:
        params = list(group['params'])
        for is_mixing in (False, True):
            part = [p for p in params if (id(p) in mixing_ids) == is_mixing]
            if not part:
                continue
            new = {**group, 'params': part}
            if is_mixing:
                new['lr_scale'] = group.get('lr_scale', 1.0) * mixing_lr_scale
            split.append(new)
    return split


def build_optimizer(model: torch.nn.Module, opt: str, lr: float, weight_decay: float, momentum: float,
                    layer_decay: float | None, mixing_lr_scale: float = 1.0, **opt_kwargs) -> torch.optim.Optimizer:
    """``create_optimizer_v2`` on the model (timm's own groups) or, with ``mixing_lr_scale != 1``, on
    ``mixing_param_groups``."""
    if mixing_lr_scale <= 0:
        raise ValueError(f'mixing_lr_scale must be positive, got {mixing_lr_scale}')
    if mixing_lr_scale == 1.0:
        return create_optimizer_v2(model, opt=opt, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                   layer_decay=layer_decay, **opt_kwargs)
    groups = mixing_param_groups(model, weight_decay, layer_decay, mixing_lr_scale)
    return create_optimizer_v2(groups, opt=opt, lr=lr, weight_decay=weight_decay, momentum=momentum, **opt_kwargs)
