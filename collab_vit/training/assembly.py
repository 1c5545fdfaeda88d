"""The parts of a training run, built from a :class:`TrainConfig`: model, EMA, DDP, data, optimizer, schedule."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3, NativeScaler
from torch.nn.parallel import DistributedDataParallel

from .config import TrainConfig
from .data import (build_dataset, build_eval_loader, build_mixup, build_train_loader, check_classes,
                   eval_data_config, eval_shard_size)
from .distributed import DistInfo, barrier
from .errors import DataError
from .loops import StepParts, autocast_context
from .model_factory import build_model, fit_state, load_weights
from .optim import build_optimizer
from .preemption import SkipFirstSampler, make_skippable


@dataclass
class RunParts:
    """Everything a run trains and evaluates with (see :func:`assemble`)."""

    model: torch.nn.Module  # DDP-wrapped when distributed
    step: StepParts
    scheduler: Any
    train_set: Any
    val_set: Any
    train_loader: Any
    val_loader: Any
    val_samples: Optional[int]  # real samples of this rank's eval shard; None: the loader yields each once
    skipper: SkipFirstSampler
    data_cfg: Dict[str, Any]
    model_kwargs: Dict[str, Any]
    num_params: int
    global_batch: int
    lr: float
    updates_per_epoch: int
    evaluate_ema: bool


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
    model_kwargs = {**cfg.model_kwargs, 'img_size': cfg.img_size, 'num_classes': cfg.num_classes}
    if cfg.in_chans != 3:
        model_kwargs['in_chans'] = cfg.in_chans
    model = build_model(cfg.model, cfg.num_classes, cfg.img_size, cfg.drop_path,
                        {k: v for k, v in model_kwargs.items() if k not in ('img_size', 'num_classes')})
    return model, model_kwargs


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


def assemble(cfg: TrainConfig, dist_info: DistInfo, ckpt: Optional[Dict[str, Any]], last_path: str,
             stop_request) -> RunParts:
    """Build every part of the run; with ``ckpt`` the model gets its weights (the rest is restored by
    :func:`~.resume.restore`)."""
    device = dist_info.device
    model, model_kwargs = _model(cfg)
    train_set, val_set = _datasets(cfg, dist_info)
    if cfg.checkpoint and ckpt is None:
        load_weights(model, cfg.checkpoint, allow_new_head=True,
                     conversion_method=cfg.model_kwargs.get('conversion_method', 'tucker'))
    if ckpt is not None:
        model.load_state_dict(fit_state(model, ckpt['model'], last_path), strict=True)
    model.to(device)
    num_params = sum(p.numel() for p in model.parameters())
    data_cfg = eval_data_config(cfg.img_size, cfg.crop_pct, model, cfg.in_chans, cfg.mean, cfg.std)
    global_batch = cfg.batch_size * dist_info.world_size * cfg.accum_steps
    lr = cfg.lr * global_batch / cfg.lr_base_batch
    opt_kwargs = {} if cfg.opt.lower().endswith(('sgd', 'momentum')) else {'eps': cfg.opt_eps}
    # timm's groups: no decay for 1-D params and model.no_weight_decay() (which names the mixing matrices)
    optimizer = build_optimizer(model, opt=cfg.opt, lr=lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum,
                                layer_decay=cfg.layer_decay or None, mixing_lr_scale=cfg.mixing_lr_scale,
                                **opt_kwargs)
    use_cuda_amp = cfg.amp and device.type == 'cuda'
    loss_scaler = NativeScaler(device='cuda') if use_cuda_amp and cfg.amp_dtype in ('float16', 'fp16') else None
    if dist_info.distributed:  # DDP broadcasts rank 0's weights and buffers: every rank now trains from them
        model = DistributedDataParallel(model, device_ids=[dist_info.local_rank] if device.type == 'cuda' else None)
    model_ema = None
    if cfg.model_ema:  # after the broadcast, so every rank's EMA starts from the weights it trains
        inner = model.module if dist_info.distributed else model
        model_ema = ModelEmaV3(inner, decay=cfg.model_ema_decay, device='cpu' if cfg.model_ema_force_cpu else None)
    prefetch = device.type == 'cuda'  # timm's GPU prefetcher path mixes in the collate function
    mixup = build_mixup(cfg, fast=prefetch)
    train_loader = build_train_loader(cfg, train_set, data_cfg, dist_info, collate_fn=mixup if prefetch else None)
    skipper = make_skippable(train_loader)  # mid-epoch resume skips the batches already trained
    val_loader = build_eval_loader(val_set, data_cfg, cfg.batch_size, cfg.num_workers, dist_info, cfg.pin_memory)
    if len(train_loader) == 0:
        raise DataError(f'{len(train_set)} training images in {os.path.abspath(cfg.data_dir)} make no full batch of '
                        f'{cfg.batch_size} per process on {dist_info.world_size} process(es)')
    updates_per_epoch = math.ceil(len(train_loader) / cfg.accum_steps)
    scheduler, _ = create_scheduler_v2(optimizer, sched=cfg.sched, num_epochs=cfg.epochs, min_lr=cfg.min_lr,
                                       warmup_lr=cfg.warmup_lr, warmup_epochs=cfg.warmup_epochs,
                                       step_on_epochs=not cfg.sched_on_updates, updates_per_epoch=updates_per_epoch)
    step = StepParts(
        optimizer=optimizer, loss_fn=_train_loss(cfg, mixup), dist_info=dist_info, scheduler=scheduler,
        sched_on_updates=cfg.sched_on_updates, accum_steps=cfg.accum_steps, clip_grad=cfg.clip_grad,
        clip_mode=cfg.clip_mode, mixup_fn=None if prefetch else mixup,
        autocast=autocast_context(device, cfg.amp, cfg.amp_dtype), loss_scaler=loss_scaler, model_ema=model_ema,
        stop_request=stop_request, progress=cfg.progress, log_interval=cfg.log_interval,
        skip_nonfinite=cfg.skip_nonfinite_loss, max_nonfinite_skips=cfg.max_nonfinite_skips)
    return RunParts(model, step, scheduler, train_set, val_set, train_loader, val_loader,
                    eval_shard_size(val_set, dist_info, cfg.num_workers), skipper, data_cfg, model_kwargs,
                    num_params, global_batch, lr, updates_per_epoch, ema_evaluable(model_ema, device))
