"""The training run, top to bottom: set-up from a :class:`TrainConfig`, the epoch loop, checkpoints, final export."""
from __future__ import annotations

import hashlib
import math
import os
import re
import time
from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3, NativeScaler, random_seed
from torch.nn.parallel import DistributedDataParallel

from ..weights_io import WeightsError, atomic_write, export_safetensors, torch_load
from .checkpoint import (check_run_dir, check_same_run, load_training_checkpoint, prepare_run_dir, repair_run_dir,
                         rng_state, save_checkpoint, set_rng_state)
from .config import TrainConfig, save_config
from .data import (build_dataset, build_eval_loader, build_mixup, build_train_loader, check_classes,
                   eval_data_config, shard_size)
from .distributed import (DistInfo, all_reduce_sum, barrier, broadcast_object, cleanup_distributed,
                          init_distributed)
from .errors import ConfigError, DataError
from .loops import NonFiniteLossError, autocast_context, evaluate, train_one_epoch
from .model_factory import build_model, fit_state, load_weights
from .optim import build_optimizer
from .logger import RunLogger
from .preemption import SAMPLE_ORDER, StopRequest, make_skippable

def key_dim_of(model: torch.nn.Module, name: str, model_kwargs: Dict[str, Any]) -> Union[int, List[int]]:
    """The attention key/query dim of a ViT: one int, or one per block when they differ (a converted model)."""
    dims = [int(getattr(block.attn, 'key_dim', 0) or getattr(block.attn, 'attn_dim', 0))
            for block in getattr(model, 'blocks', [])]
    if dims and all(dims):
        return dims[0] if len(set(dims)) == 1 else dims
    key_dim = model_kwargs.get('key_dim')
    if key_dim is not None:
        return key_dim
    match = re.search(r'_k(\d+)$', name)
    return int(match.group(1)) if match else int(getattr(model, 'embed_dim', 0))


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def state_dict_sha256(state_dict: Dict[str, torch.Tensor]) -> str:
    """A fingerprint of a model's weights (to check that DDP ranks agree)."""
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        digest.update(key.encode())
        digest.update(state_dict[key].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _gather_rng(dist_info: DistInfo, state: Dict[str, Any]) -> list:
    """Every rank's ``state`` (an RNG state), in rank order (a list of one on a single process)."""
    if not dist_info.distributed:
        return [state]
    states = [None] * dist_info.world_size
    dist.all_gather_object(states, state)
    return states


def checkpoint_state(cfg: TrainConfig, model, optimizer, scheduler, loss_scaler, model_ema, epoch: int,
                     num_updates: int, best_top1: float, best_epoch: int, rng_all: list, model_kwargs: Dict[str, Any],
                     data_cfg: Dict[str, Any], metrics: Dict[str, Any], batches_done: int = 0) -> Dict[str, Any]:
    """The training checkpoint (keys documented in :mod:`collab_vit.training.checkpoint`); ``epoch`` is the last finished one
    and ``batches_done`` the batches already trained of the next (0 at an epoch boundary)."""
    return {
        'model': _unwrap(model).state_dict(), 'optimizer': optimizer.state_dict(),
        'scheduler': scheduler.state_dict(), 'scaler': loss_scaler.state_dict() if loss_scaler else None,
        'model_ema': model_ema.module.state_dict() if model_ema is not None else None,
        'epoch': epoch, 'batches_done': batches_done, 'step': num_updates, 'best_top1': best_top1,
        'best_epoch': best_epoch, 'rng': rng_all, 'config': cfg.to_dict(), 'model_name': cfg.model,
        'model_kwargs': model_kwargs,
        'data_config': {k: list(v) if isinstance(v, tuple) else v for k, v in data_cfg.items()},
        'metrics': metrics,
    }


def _check_on_rank0(fn, dist_info: DistInfo) -> None:
    """Run ``fn`` on rank 0 and raise its ConfigError on every rank (so no rank hangs in a collective)."""
    msg = None
    if dist_info.is_main:
        try:
            fn()
        except ConfigError as e:
            msg = str(e)
    msg = broadcast_object(msg)
    if msg:
        raise ConfigError(msg)


def train(cfg: TrainConfig) -> Dict[str, Any]:
    """Run (or resume) training as configured; returns the final summary (also printed on rank 0)."""
    dist_info = init_distributed(cfg.device)
    stop_request = StopRequest(cfg.output, dist_info.is_main)
    try:
        return _train(cfg, dist_info, stop_request)
    finally:
        stop_request.restore_handlers()
        cleanup_distributed()


def ema_evaluable(model_ema: Optional[ModelEmaV3], device: torch.device) -> bool:
    """Whether the EMA can be evaluated on the training device's batches during training.

    As timm's train.py (``model_ema_force_cpu``): an EMA kept on another device than the model (the CPU, beside a
    GPU model) is not evaluated during training; its weights are still checkpointed and exported.
    """
    if model_ema is None:
        return False
    ema_device = next(model_ema.module.parameters()).device
    return ema_device.type == device.type and (ema_device.index or 0) == (device.index or 0)


def nonfinite_weights(*modules: Optional[torch.nn.Module]) -> list:
    """Names of parameters/buffers that hold NaN or inf, over ``modules`` (first few only)."""
    bad = []
    for module in modules:
        if module is None:
            continue
        for name, tensor in module.state_dict().items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                bad.append(name)
                if len(bad) >= 3:
                    return bad
    return bad


def _last_good(output: str, dist_info: DistInfo) -> str:
    """Where the last good checkpoint is (for the message of a run stopped by a non-finite loss)."""
    path = os.path.join(output, 'last.pth')
    if not os.path.isfile(path):
        return 'no checkpoint was written'
    try:
        epoch = torch_load(path, mmap=True).get('epoch') if dist_info.is_main else None
    except (WeightsError, AttributeError):
        epoch = None
    return f'{path} (epoch {epoch}) is kept as it was' if epoch is not None else f'{path} is kept as it was'


def _train(cfg: TrainConfig, dist_info: DistInfo, stop_request: StopRequest) -> Dict[str, Any]:
    device = dist_info.device
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    if cfg.deterministic:
        os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    random_seed(cfg.seed, dist_info.rank)

    # Checks that write nothing come first: run directory, checkpoint to resume, model, data, start weights.
    last_path = os.path.join(cfg.output, 'last.pth')
    resume = cfg.resume or (cfg.auto_resume and bool(broadcast_object(os.path.isfile(last_path))))
    _check_on_rank0(lambda: check_run_dir(cfg.output, resume, cfg.to_dict()), dist_info)
    ckpt = load_training_checkpoint(last_path) if resume else None
    if ckpt is not None:
        check_same_run(ckpt, cfg.to_dict(), last_path)

    model_kwargs = {**cfg.model_kwargs, 'img_size': cfg.img_size, 'num_classes': cfg.num_classes}
    if cfg.in_chans != 3:
        model_kwargs['in_chans'] = cfg.in_chans
    model = build_model(cfg.model, cfg.num_classes, cfg.img_size, cfg.drop_path,
                        {k: v for k, v in model_kwargs.items() if k not in ('img_size', 'num_classes')})

    # data (the digits data set is written once, by rank 0, into an empty or new directory only)
    if cfg.dataset == 'sklearn/digits' and dist_info.is_main:
        build_dataset(cfg.dataset, cfg.data_dir, cfg.train_split, is_training=True)
    barrier()
    train_set = build_dataset(cfg.dataset, cfg.data_dir, cfg.train_split, True, cfg.batch_size, cfg.seed,
                              download=cfg.dataset_download, skip_bad_images=cfg.skip_bad_images)
    val_set = build_dataset(cfg.dataset, cfg.data_dir, cfg.val_split, False, cfg.batch_size, cfg.seed,
                            download=cfg.dataset_download, skip_bad_images=cfg.skip_bad_images)
    check_classes(train_set, val_set, cfg.data_dir, cfg.num_classes)

    if cfg.checkpoint and not resume:
        load_weights(model, cfg.checkpoint, allow_new_head=True,
                     conversion_method=cfg.model_kwargs.get('conversion_method', 'tucker'))
    if ckpt is not None:
        model.load_state_dict(fit_state(model, ckpt['model'], last_path), strict=True)

    # model, EMA, optimizer, loss
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
    autocast = autocast_context(device, cfg.amp, cfg.amp_dtype)
    model_ema = None
    if cfg.model_ema:
        model_ema = ModelEmaV3(model, decay=cfg.model_ema_decay, device='cpu' if cfg.model_ema_force_cpu else None)
    evaluate_ema = ema_evaluable(model_ema, device)
    if dist_info.distributed:
        model = DistributedDataParallel(model, device_ids=[dist_info.local_rank] if device.type == 'cuda' else None)
    prefetch = device.type == 'cuda'  # timm's GPU prefetcher path mixes in the collate function
    mixup = build_mixup(cfg, fast=prefetch)
    train_loader = build_train_loader(cfg, train_set, data_cfg, dist_info, collate_fn=mixup if prefetch else None)
    skipper = make_skippable(train_loader)  # mid-epoch resume skips the batches already trained
    val_loader = build_eval_loader(val_set, data_cfg, cfg.batch_size, cfg.num_workers, dist_info, cfg.pin_memory)
    val_samples = shard_size(len(val_set), dist_info)
    if len(train_loader) == 0:
        raise DataError(f'{len(train_set)} training images in {os.path.abspath(cfg.data_dir)} make no full batch of '
                        f'{cfg.batch_size} per process on {dist_info.world_size} process(es)')
    if mixup is not None:
        train_loss = SoftTargetCrossEntropy()
    elif cfg.smoothing > 0:
        train_loss = LabelSmoothingCrossEntropy(smoothing=cfg.smoothing)
    else:
        train_loss = torch.nn.CrossEntropyLoss()
    updates_per_epoch = math.ceil(len(train_loader) / cfg.accum_steps)
    scheduler, _ = create_scheduler_v2(optimizer, sched=cfg.sched, num_epochs=cfg.epochs, min_lr=cfg.min_lr,
                                       warmup_lr=cfg.warmup_lr, warmup_epochs=cfg.warmup_epochs,
                                       step_on_epochs=not cfg.sched_on_updates, updates_per_epoch=updates_per_epoch)

    # resume
    start_epoch, num_updates, best_top1, best_epoch, rng_states, batches_done = 0, 0, -1.0, -1, None, 0
    metrics: Dict[str, float] = {}
    old_order = False
    if ckpt is not None:
        optimizer.load_state_dict(ckpt['optimizer'])
        scheduler.load_state_dict(ckpt['scheduler'])
        if loss_scaler is not None and ckpt.get('scaler'):
            loss_scaler.load_state_dict(ckpt['scaler'])
        if model_ema is not None and ckpt.get('model_ema') is not None:
            model_ema.module.load_state_dict(fit_state(model_ema.module, ckpt['model_ema'], last_path + ' (EMA)'))
        start_epoch, num_updates = ckpt['epoch'] + 1, ckpt['step']
        best_top1, best_epoch = ckpt['best_top1'], ckpt['best_epoch']
        rng_states = ckpt['rng']
        batches_done = ckpt.get('batches_done', 0)  # > 0: stopped inside epoch start_epoch, rng is its start state
        if batches_done and len(ckpt['rng_at_stop']) == dist_info.world_size:
            skipper.rng_after_skip = ckpt['rng_at_stop'][dist_info.rank]
        old_order = bool(batches_done) and not dist_info.distributed and ckpt.get('sample_order') != SAMPLE_ORDER
        if not batches_done:  # the final summary of a run killed after its last checkpoint, before its export
            metrics = {k: v for k, v in (ckpt.get('metrics') or {}).items() if k in ('top1', 'top5')}
        if cfg.sched_on_updates:
            scheduler.step_update(num_updates)
        else:
            scheduler.step(start_epoch)

    # Only now is anything written: the run directory, repaired after a crash when resuming, and the config.
    repaired: list = []
    if dist_info.is_main:
        repaired = prepare_run_dir(cfg.output)
        if ckpt is not None:
            repaired += repair_run_dir(cfg.output, ckpt, cfg.checkpoint_every)
        atomic_write(os.path.join(cfg.output, 'config.yaml'), lambda tmp: save_config(cfg, tmp))
    barrier()
    log = RunLogger(cfg.output, dist_info.is_main, cfg.to_dict(), cfg.log_wandb, cfg.wandb_project,
                    cfg.experiment, resume)
    if stop_request.acknowledge():
        log.info(f'removed a stale {stop_request.stop_file} from an earlier invocation')
    if repaired:
        log.info(f'after an interrupted run: removed or rewrote {", ".join(os.path.basename(r) for r in repaired)}')
    if ckpt is not None:
        within = f', after batch {batches_done} of that epoch' if batches_done else ''
        log.info(f'resumed {cfg.output} at epoch {start_epoch}{within} (step {num_updates})')
    if old_order:
        log.info(f'warning: {cfg.output}/last.pth was written inside an epoch by an older version whose sample '
                 f'order differs: the rest of epoch {start_epoch} may repeat or miss some samples')
    del ckpt
    if model_ema is not None and not evaluate_ema:
        log.info('the EMA is kept on the cpu (model_ema_force_cpu): as in timm, it is not evaluated during training; '
                 'its weights are saved and exported (evaluate them with eval.py)')

    key_dim = key_dim_of(_unwrap(model), cfg.model, cfg.model_kwargs)
    log.info(f'{cfg.model} (key dim {key_dim}, {num_params / 1e6:.2f}M params) on {dist_info.world_size} x '
             f'{device.type}: {len(train_set)} train / {len(val_set)} val images, global batch {global_batch}, '
             f'lr {lr:.3g}, {cfg.epochs} epochs')
    if rng_states is not None:  # last thing before the loop, so nothing above shifts the streams
        if len(rng_states) == dist_info.world_size:
            set_rng_state(rng_states[dist_info.rank])
        else:
            log.info(f'warning: checkpoint has RNG states for {len(rng_states)} ranks, running on '
                     f'{dist_info.world_size}: RNG streams are not restored')

    def check_weights(when: str) -> None:
        """Never checkpoint or export NaN/inf weights (every rank holds the same weights, so all stop together)."""
        bad = nonfinite_weights(_unwrap(model), model_ema.module if model_ema is not None else None)
        if bad:
            raise NonFiniteLossError(f'non-finite weights ({", ".join(bad)}) {when}: not saved; '
                                     f'{_last_good(cfg.output, dist_info)}')

    epochs_run = 0
    bad_images = 0
    for epoch in range(start_epoch, cfg.epochs):
        start = time.perf_counter()
        epoch_rng = rng_state()  # what a mid-epoch checkpoint stores (the sampler's order depends on the epoch only)
        skipper.skip = batches_done * cfg.batch_size
        if hasattr(train_loader.sampler, 'set_epoch'):
            train_loader.sampler.set_epoch(epoch)
        try:
            record, num_updates = train_one_epoch(
                model, train_loader, optimizer, train_loss, dist_info, epoch, num_updates, scheduler=scheduler,
                sched_on_updates=cfg.sched_on_updates, accum_steps=cfg.accum_steps, clip_grad=cfg.clip_grad,
                clip_mode=cfg.clip_mode, mixup_fn=None if prefetch else mixup, autocast=autocast,
                loss_scaler=loss_scaler, model_ema=model_ema, progress=cfg.progress, stop_request=stop_request,
                log_interval=cfg.log_interval, skip_nonfinite=cfg.skip_nonfinite_loss,
                max_nonfinite_skips=cfg.max_nonfinite_skips)
        except NonFiniteLossError as e:
            hint = '' if cfg.skip_nonfinite_loss else ' (lower the lr, set clip_grad, or skip such batches with ' \
                                                      'skip_nonfinite_loss: true)'
            raise NonFiniteLossError(f'{e}: training stopped; {_last_good(cfg.output, dist_info)}{hint}') from None
        skipped = record.pop('nonfinite_skipped')
        if skipped:
            record['nonfinite_skipped'] = skipped
            log.info(f'warning: epoch {epoch}: skipped {skipped} batch(es) with a non-finite loss '
                     f'(skip_nonfinite_loss)')
        epoch_batches = skipper.skip // cfg.batch_size + len(train_loader)
        batches_done += record.pop('batches')
        stopped = record.pop('stopped')
        if stopped and batches_done < epoch_batches:
            check_weights(f'at the stop inside epoch {epoch}')
            rng_at_start, rng_at_stop = _gather_rng(dist_info, epoch_rng), _gather_rng(dist_info, rng_state())
            if dist_info.is_main:
                state = checkpoint_state(cfg, model, optimizer, scheduler, loss_scaler, model_ema, epoch - 1,
                                         num_updates, best_top1, best_epoch, rng_at_start, model_kwargs, data_cfg,
                                         record, batches_done)
                save_checkpoint({**state, 'rng_at_stop': rng_at_stop, 'sample_order': SAMPLE_ORDER},
                                os.path.join(cfg.output, 'last.pth'))
            barrier()
            stop_request.acknowledge()
            log.info(f'stop requested ({stop_request.decided}): saved {cfg.output}/last.pth inside epoch {epoch} '
                     f'after batch {batches_done} (step {num_updates}); continue with --resume')
            log.finish()
            return {'stopped_at_epoch': epoch, 'batches_done': batches_done, 'step': num_updates,
                    'output': cfg.output}
        batches_done = 0
        if not cfg.sched_on_updates:
            scheduler.step(epoch + 1)
        is_last = epoch + 1 == cfg.epochs
        if is_last or (epoch + 1) % max(cfg.eval_every, 1) == 0:
            metrics = evaluate(model, val_loader, dist_info, val_samples, autocast)
            record.update(top1=metrics['top1'], top5=metrics['top5'], val_loss=metrics['loss'])
            if evaluate_ema:
                ema_metrics = evaluate(model_ema.module, val_loader, dist_info, val_samples, autocast)
                record.update(ema_top1=ema_metrics['top1'], ema_top5=ema_metrics['top5'])
        if cfg.skip_bad_images:
            counts = all_reduce_sum(torch.tensor([float(getattr(train_set, 'skipped', lambda: 0)()),
                                                  float(getattr(val_set, 'skipped', lambda: 0)())],
                                                 dtype=torch.float64, device=device)).tolist()
            if sum(counts) > bad_images:
                log.info(f'warning: skipped {int(counts[0])} unreadable train and {int(counts[1])} val image(s) so '
                         f'far (skip_bad_images)')
            bad_images = sum(counts)
            if bad_images:
                record['bad_images_skipped'] = int(bad_images)
        is_best = 'top1' in record and record['top1'] > best_top1
        if is_best:
            best_top1, best_epoch = record['top1'], epoch
        record.update(epoch=epoch, step=num_updates, epoch_time=time.perf_counter() - start)

        # last.pth is the commit point: written first; best/epoch files and the log record are re-derived from it
        # by repair_run_dir when a kill falls between these writes
        check_weights(f'after epoch {epoch}')
        rng_all = _gather_rng(dist_info, rng_state())
        if dist_info.is_main:
            state = checkpoint_state(cfg, model, optimizer, scheduler, loss_scaler, model_ema, epoch, num_updates,
                                     best_top1, best_epoch, rng_all, model_kwargs, data_cfg, record)
            save_checkpoint(state, os.path.join(cfg.output, 'last.pth'))
            if is_best:
                save_checkpoint(state, os.path.join(cfg.output, 'best.pth'))
            if cfg.checkpoint_every and (epoch + 1) % cfg.checkpoint_every == 0:
                save_checkpoint(state, os.path.join(cfg.output, f'epoch_{epoch:04d}.pth'))
        log.log_epoch(record)
        epochs_run += 1
        stop_reason = 'stop_after' if cfg.stop_after and epochs_run >= cfg.stop_after else None
        if stopped or stop_reason:
            stop_reason = stop_reason or stop_request.decided
        if stop_reason and not is_last:
            stop_request.acknowledge()
            log.info(f'stopping after epoch {epoch} ({stop_reason}); continue with --resume')
            log.finish()
            return {'stopped_at_epoch': epoch, 'batches_done': 0, 'step': num_updates, 'output': cfg.output}

    stop_request.acknowledge()  # a stop asked for during the last epoch has nothing left to stop
    check_weights('at the end of training')
    summary = {'model': cfg.model, 'key_dim': key_dim, 'params': num_params, 'top1': metrics.get('top1'),
               'top5': metrics.get('top5'), 'best_top1': best_top1, 'best_epoch': best_epoch, 'output': cfg.output,
               'rank': dist_info.rank, 'weights_sha256': state_dict_sha256(_unwrap(model).state_dict())}
    if dist_info.is_main:
        extra = {'data_config': {k: list(v) if isinstance(v, tuple) else v for k, v in data_cfg.items()},
                 'metrics': {k: summary[k] for k in ('top1', 'top5')}}
        export_safetensors(_unwrap(model).state_dict(), os.path.join(cfg.output, 'model.safetensors'), cfg.model,
                           model_kwargs, extra)
        if model_ema is not None:
            export_safetensors(model_ema.module.state_dict(), os.path.join(cfg.output, 'model_ema.safetensors'),
                               cfg.model, model_kwargs, extra)
        log.info(format_summary(summary))
    log.finish(summary)
    return summary


def format_summary(s: Dict[str, Any]) -> str:
    """A small results table: model, key dim, params, final and best top-1."""
    top1 = 'n/a' if s['top1'] is None else f"{s['top1']:.2f}"
    rows = [('model', 'key dim', 'params', 'top-1', 'best top-1'),
            (s['model'], str(s['key_dim']), f"{s['params'] / 1e6:.2f}M", top1, f"{s['best_top1']:.2f}")]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [' | '.join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, '-+-'.join('-' * w for w in widths))
    return '\n'.join(lines)


def one_line(error: BaseException) -> str:
    """The user-facing line of an error; an error re-raised from a data-loader worker carries the worker's
    traceback in its message, whose last line is the original one."""
    text = str(error).strip()
    if 'Original Traceback' in text:
        last = text.splitlines()[-1]
        text = last.split(': ', 1)[1] if ': ' in last else last
    return text.splitlines()[0] if text else type(error).__name__


def main(argv: Optional[list] = None) -> int:
    """Console entry: ``train.py -c CONFIG [--key value ...]``. Config, data and weights errors are one line, exit 2;
    a run stopped by a non-finite loss is one line, exit 1."""
    import sys
    from .flags import parse_train_args
    try:
        cfg = parse_train_args(sys.argv[1:] if argv is None else argv)
        train(cfg)
    except (ConfigError, DataError, WeightsError) as e:
        print(f'error: {one_line(e)}', file=sys.stderr)
        return 2
    except NonFiniteLossError as e:
        print(f'error: {one_line(e)}', file=sys.stderr)
        return 1
    return 0
