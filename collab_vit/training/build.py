"""Building a run from its :class:`~.config.TrainConfig`: the model (timm's registry with ours registered; weights
converted on load), the optimizer, the EMA, loss, schedule and loaders, gathered in :class:`Run`, which the trainer's
loop passes. :func:`build_model` and :func:`fit_state` serve evaluation too.

The optimizer is timm's ``create_optimizer_v2`` with its param groups (an lr multiplier for the mixing matrices was
measured inconclusive and removed: RESULTS_HISTORY.md).
"""
from __future__ import annotations

import difflib
import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import timm
import torch
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.models import parse_model_name
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3, NativeScaler, unwrap_model
from torch.nn.parallel import DistributedDataParallel

from .. import models  # noqa: F401  (registers collab_deit_* / concat_deit_* with timm)
from ..conversion.files.pretrained import collab_filter_fn
from ..layers.attention import CollaborativeAttention
from ..weights_io import WeightsError, check_fit, model_pipeline, one_line, read_weights
from .checkpoint import Progress
from .config import ConfigError, DataError, TrainConfig
from .data import (SkipFirstSampler, build_dataset, build_eval_loader, build_mixup, build_train_loader,
                   check_classes, eval_data_config, eval_shard_size, make_skippable)
from .distributed import DistInfo, barrier
from .engine import StepParts, autocast_context
from .runlog import RunLogger
from .stop import StopRequest


@dataclass
class Run:
    """One training run, the one object the trainer's loop passes: what it trains with (built once by
    :func:`assemble`; ``step`` is the engine's share), where it stands (``progress``, what checkpoints record) and
    its log (opened by the trainer once the run directory is written)."""

    cfg: TrainConfig
    model: torch.nn.Module  # DDP-wrapped when distributed
    step: StepParts  # what one training pass uses: optimizer, schedule, loss, EMA, loss scaler, stop request
    train_loader: Any
    val_loader: Any
    skipper: SkipFirstSampler  # the training loader's sampler: a mid-epoch resume skips the batches trained
    val_samples: Optional[int]  # real samples of this rank's eval shard; None: the loader yields each once
    data_cfg: Dict[str, Any]  # the evaluation pipeline (recorded in checkpoints and exports)
    model_kwargs: Dict[str, Any]  # as recorded in checkpoints and exports
    progress: Progress = field(default_factory=Progress)
    log: Optional[RunLogger] = None

    @property
    def dist_info(self) -> DistInfo:
        return self.step.dist_info

    @property
    def unwrapped(self) -> torch.nn.Module:
        """The model without its DDP and ``torch.compile`` wrappers (timm's ``unwrap_model``): plain parameter names."""
        return unwrap_model(self.model)

    @property
    def updates_per_epoch(self) -> int:
        """Optimizer updates in a full pass over the training loader (the last window may be short)."""
        return math.ceil(len(self.train_loader) / self.cfg.accum_steps)

    @property
    def evaluate_ema(self) -> bool:
        """See :func:`ema_evaluable`."""
        return ema_evaluable(self.step.model_ema, self.dist_info.device)


def scaled_lr(cfg: TrainConfig, world_size: int) -> Tuple[int, float]:
    """The global batch and the lr for it (``lr`` is given at ``lr_base_batch``, scaled linearly)."""
    global_batch = cfg.batch_size * world_size * cfg.accum_steps
    return global_batch, cfg.lr * global_batch / cfg.lr_base_batch


def ema_evaluable(model_ema: Optional[ModelEmaV3], device: torch.device) -> bool:
    """Whether the EMA can be evaluated on the training device's batches during training.

    As timm's train.py (``model_ema_force_cpu``): an EMA kept on another device than the model (the CPU, beside a
    GPU model) is not evaluated during training; its weights are still checkpointed and exported.
    """
    if model_ema is None:
        return False
    ema_device = next(model_ema.module.parameters()).device
    return ema_device.type == device.type and (ema_device.index or 0) == (device.index or 0)


def _model(cfg: TrainConfig):
    """The model (at its init) and the keywords checkpoints record."""
    model_kwargs = {**cfg.model_kwargs, 'img_size': cfg.img_size, 'num_classes': cfg.num_classes}
    if cfg.in_chans != 3:
        model_kwargs['in_chans'] = cfg.in_chans
    model = build_model(cfg.model, cfg.num_classes, cfg.img_size, cfg.drop_path,
                        {k: v for k, v in model_kwargs.items() if k not in ('img_size', 'num_classes')})
    return model, model_kwargs


def _load_start_weights(model: torch.nn.Module, cfg: TrainConfig, ckpt: Optional[Dict[str, Any]],
                        ckpt_path: str) -> None:
    """``ckpt``'s weights when resuming, else those of ``cfg.checkpoint`` (fine-tuning), else none (the init)."""
    if ckpt is not None:
        model.load_state_dict(fit_state(model, ckpt['model'], ckpt_path), strict=True)
    elif cfg.checkpoint:
        load_weights(model, cfg.checkpoint, allow_new_head=True)


def _datasets(cfg: TrainConfig, dist_info: DistInfo):
    """Train and val sets (the digits set is written once, by rank 0, into an empty or new directory only)."""
    if cfg.dataset == 'sklearn/digits' and dist_info.is_main:
        build_dataset(cfg.dataset, cfg.data_dir, cfg.train_split, is_training=True)
    barrier()
    train_set = build_dataset(cfg.dataset, cfg.data_dir, cfg.train_split, True, cfg.batch_size, cfg.seed,
                              download=cfg.dataset_download, skip_bad_images=cfg.skip_bad_images)
    val_set = build_dataset(cfg.dataset, cfg.data_dir, cfg.val_split, False, cfg.batch_size, cfg.seed,
                            download=cfg.dataset_download, skip_bad_images=cfg.skip_bad_images)
    check_classes(train_set, val_set, cfg.data_dir, cfg.num_classes)
    return train_set, val_set


def _train_loss(cfg: TrainConfig, mixup) -> torch.nn.Module:
    if mixup is not None:
        return SoftTargetCrossEntropy()
    if cfg.smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=cfg.smoothing)
    return torch.nn.CrossEntropyLoss()


def _optimizer(cfg: TrainConfig, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """timm's groups: no decay for 1-D params and model.no_weight_decay() (which names the mixing matrices)."""
    opt_kwargs = {} if cfg.opt.lower().endswith(('sgd', 'momentum')) else {'eps': cfg.opt_eps}
    return build_optimizer(model, opt=cfg.opt, lr=lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum,
                           layer_decay=cfg.layer_decay or None, **opt_kwargs)


def _wrap(cfg: TrainConfig, model: torch.nn.Module, dist_info: DistInfo, ckpt: Optional[Dict[str, Any]],
          ckpt_path: str) -> Tuple[torch.nn.Module, Optional[ModelEmaV3]]:
    """DDP (which broadcasts rank 0's weights and buffers: every rank then trains from them), then the EMA, from the
    weights each rank trains (with ``ckpt``'s EMA weights when resuming), then ``torch.compile`` (``torchcompile``),
    in timm's train.py's order: the EMA, checkpoints and exports hold the plain model."""
    if dist_info.distributed:
        device = dist_info.device
        model = DistributedDataParallel(model, device_ids=[dist_info.local_rank] if device.type == 'cuda' else None)
    model_ema = None
    if cfg.model_ema:
        inner = model.module if dist_info.distributed else model
        model_ema = ModelEmaV3(inner, decay=cfg.model_ema_decay, device='cpu' if cfg.model_ema_force_cpu else None)
        if ckpt is not None and ckpt.get('model_ema') is not None:
            ema = model_ema.module
            ema.load_state_dict(fit_state(ema, ckpt['model_ema'], ckpt_path + ' (EMA)'))
    if cfg.torchcompile:
        model = torch.compile(model, backend=cfg.torchcompile)
    return model, model_ema


def _step_parts(cfg: TrainConfig, dist_info: DistInfo, optimizer, mixup, model_ema,
                stop_request: Optional[StopRequest]) -> StepParts:
    device, prefetch = dist_info.device, dist_info.device.type == 'cuda'
    use_fp16 = cfg.amp and device.type == 'cuda' and cfg.amp_dtype in ('float16', 'fp16')
    return StepParts(
        optimizer=optimizer, loss_fn=_train_loss(cfg, mixup), dist_info=dist_info, scheduler=None,
        sched_on_updates=cfg.sched_on_updates, accum_steps=cfg.accum_steps, clip_grad=cfg.clip_grad,
        clip_mode=cfg.clip_mode, mixup_fn=None if prefetch else mixup,
        autocast=autocast_context(device, cfg.amp, cfg.amp_dtype),
        loss_scaler=NativeScaler(device='cuda') if use_fp16 else None, model_ema=model_ema,
        stop_request=stop_request, progress=cfg.progress, log_interval=cfg.log_interval,
        skip_nonfinite=cfg.skip_nonfinite_loss, max_nonfinite_skips=cfg.max_nonfinite_skips)


def assemble(cfg: TrainConfig, dist_info: DistInfo, ckpt: Optional[Dict[str, Any]], ckpt_path: str,
             stop_request: Optional[StopRequest]) -> Run:
    """Build every part of the run, at its start; with ``ckpt`` the model and EMA get its weights (the rest is
    restored by :func:`~.checkpoint.restore`)."""
    model, model_kwargs = _model(cfg)
    train_set, val_set = _datasets(cfg, dist_info)
    _load_start_weights(model, cfg, ckpt, ckpt_path)
    model.to(dist_info.device)
    data_cfg = eval_data_config(cfg.img_size, cfg.crop_pct, model, cfg.in_chans, cfg.mean, cfg.std)
    optimizer = _optimizer(cfg, model, scaled_lr(cfg, dist_info.world_size)[1])
    model, model_ema = _wrap(cfg, model, dist_info, ckpt, ckpt_path)
    prefetch = dist_info.device.type == 'cuda'  # timm's GPU prefetcher path mixes in the collate function
    mixup = build_mixup(cfg, fast=prefetch)
    train_loader = build_train_loader(cfg, train_set, data_cfg, dist_info, collate_fn=mixup if prefetch else None)
    skipper = make_skippable(train_loader)
    val_loader = build_eval_loader(val_set, data_cfg, cfg.batch_size, cfg.num_workers, dist_info, cfg.pin_memory)
    if len(train_loader) == 0:
        raise DataError(f'{len(train_set)} training images in {os.path.abspath(cfg.data_dir)} make no full batch of '
                        f'{cfg.batch_size} per process on {dist_info.world_size} process(es)')
    step = _step_parts(cfg, dist_info, optimizer, mixup, model_ema, stop_request)
    val_samples = eval_shard_size(val_set, dist_info, cfg.num_workers)
    run = Run(cfg, model, step, train_loader, val_loader, skipper, val_samples, data_cfg, model_kwargs)
    step.scheduler, _ = create_scheduler_v2(
        optimizer, sched=cfg.sched, num_epochs=cfg.epochs, min_lr=cfg.min_lr, warmup_lr=cfg.warmup_lr,
        warmup_epochs=cfg.warmup_epochs, step_on_epochs=not cfg.sched_on_updates,
        updates_per_epoch=run.updates_per_epoch)
    return run


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
        raise ConfigError(f"bad model_kwargs for '{name}': {one_line(e)}") from None


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


def fit_state(model: torch.nn.Module, state: Dict[str, torch.Tensor], source: str,
              allow_new_head: bool = False) -> Dict[str, torch.Tensor]:
    """``state`` made ready for ``model.load_state_dict``, or a WeightsError listing what does not fit.

    Standard-attention weights (a timm/DeiT ``.pth``) for a collaborative model are converted exactly as
    ``pretrained=True`` converts them (``collab_vit.conversion.files.pretrained.collab_filter_fn``: timm's ViT filter,
    then the re-parametrisation of section 3.3 at the model's key dims). With ``allow_new_head`` a classifier of another
    size (fine-tuning to a new dataset; every classifier timm's cfg names) is left at its init.
    """
    collaborative = any(isinstance(m, CollaborativeAttention) for m in model.modules())
    if collaborative and is_standard_attention_state(state):
        _logger.info('converting the standard attention weights in %s to collaborative', source)
        try:
            state = collab_filter_fn(dict(state), model)
        except (ValueError, RuntimeError, KeyError) as e:
            raise WeightsError(f'cannot convert the standard attention weights in {source} for this model '
                               f'({one_line(e)}); convert them first with `collab-vit convert`') from None
    own = model.state_dict()
    heads = classifier_prefixes(model)
    if allow_new_head:
        for key in list(state):
            if key.startswith(heads) and key in own and state[key].shape != own[key].shape:
                _logger.warning('not loading %s: shape %s, model has %s', key, tuple(state[key].shape),
                                tuple(own[key].shape))
                del state[key]
    check_fit(own, state, source, ignore_missing=heads if allow_new_head else ())
    return state


def classifier_prefixes(model: torch.nn.Module) -> Tuple[str, ...]:
    """The classifier's parameter prefixes, from timm's cfg (a distilled DeiT has two: ``head.``, ``head_dist.``)."""
    names = (getattr(model, 'pretrained_cfg', None) or {}).get('classifier') or 'head'
    return tuple(f'{name}.' for name in ((names,) if isinstance(names, str) else names))


def load_weights(model: torch.nn.Module, path: str, use_ema: bool = False, allow_new_head: bool = False) -> Dict:
    """Load weights from our checkpoint, a ``.safetensors`` export or a timm/DeiT ``.pth`` into ``model``.

    See :func:`fit_state`; a file that does not fit is a WeightsError naming the mismatched keys and shapes.
    Returns the file's metadata.
    """
    state, meta = read_weights(path, use_ema=use_ema)
    model.load_state_dict(fit_state(model, state, path, allow_new_head), strict=False)
    return meta


def build_optimizer(model: torch.nn.Module, opt: str, lr: float, weight_decay: float, momentum: float,
                    layer_decay: float | None, **opt_kwargs) -> torch.optim.Optimizer:
    """``create_optimizer_v2`` on the model: timm's own groups."""
    return create_optimizer_v2(model, opt=opt, lr=lr, weight_decay=weight_decay, momentum=momentum,
                               layer_decay=layer_decay, **opt_kwargs)
