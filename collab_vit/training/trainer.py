"""The training run, top to bottom: set-up from a :class:`TrainConfig`, resume, the epoch loop, checkpoints, export.

``_train`` reads as timm's and DeiT's engines: parts (:mod:`.assembly`), resume (:mod:`.resume`), then per epoch
one training pass (:mod:`.loops`), evaluation, and the checkpoint; a stop request checkpoints inside the epoch.
"""
from __future__ import annotations

import hashlib
import os
import re
import time
from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist
from timm.utils import random_seed
from torch.nn.parallel import DistributedDataParallel

from ..weights_io import WeightsError, WriteError, export_safetensors, one_line, torch_load
from .assembly import RunParts, assemble, ema_evaluable  # noqa: F401  (ema_evaluable: re-exported)
from .checkpoint import (check_run_dir, check_same_run, load_training_checkpoint, prepare_run_dir, repair_run_dir,
                         rng_state, save_checkpoint, set_rng_state)
from .config import TrainConfig, save_config
from .distributed import DistInfo, all_reduce_sum, barrier, broadcast_object, cleanup_distributed, init_distributed
from .errors import ConfigError, DataError
from .logger import RunLogger
from .loops import NonFiniteLossError, evaluate, train_one_epoch
from .preemption import SAMPLE_ORDER, StopRequest
from .resume import ResumePoint, check_geometry, geometry, restore


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


def checkpoint_state(cfg: TrainConfig, run: RunParts, point: ResumePoint, epoch: int, rng_all: list,
                     metrics: Dict[str, Any], batches_done: int = 0) -> Dict[str, Any]:
    """The training checkpoint (keys documented in :mod:`collab_vit.training.checkpoint`); ``epoch`` is the last
    finished one and ``batches_done`` the batches already trained of the next (0 at an epoch boundary)."""
    step = run.step
    return {
        'model': _unwrap(run.model).state_dict(), 'optimizer': step.optimizer.state_dict(),
        'scheduler': run.scheduler.state_dict(), 'scaler': step.loss_scaler.state_dict() if step.loss_scaler else None,
        'model_ema': step.model_ema.module.state_dict() if step.model_ema is not None else None,
        'epoch': epoch, 'batches_done': batches_done, 'step': point.num_updates, 'best_top1': point.best_top1,
        'best_epoch': point.best_epoch, 'rng': rng_all, 'config': cfg.to_dict(), 'model_name': cfg.model,
        'model_kwargs': run.model_kwargs,
        'geometry': geometry(cfg.batch_size, step.dist_info.world_size, cfg.accum_steps),
        'data_config': {k: list(v) if isinstance(v, tuple) else v for k, v in run.data_cfg.items()},
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


def nonfinite_weights(*modules: Optional[torch.nn.Module]) -> list:
    """Names of parameters/buffers that hold NaN or inf, over ``modules`` (first few only; one host read per
    module, before a checkpoint or export)."""
    bad = []
    for module in modules:
        if module is None:
            continue
        named = [(n, t) for n, t in module.state_dict().items() if t.is_floating_point()]
        finite = torch.stack([torch.isfinite(t).all() for _, t in named]).tolist() if named else []
        bad += [n for (n, _), ok in zip(named, finite) if not ok]
    return bad[:3]


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


def _set_up_process(cfg: TrainConfig, dist_info: DistInfo) -> None:
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    if cfg.deterministic:
        os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    random_seed(cfg.seed, dist_info.rank)  # per rank; DDP then broadcasts rank 0's initial weights


def _open_run_dir(cfg: TrainConfig, dist_info: DistInfo, stop_request: StopRequest, ckpt: Optional[Dict[str, Any]],
                  point: ResumePoint, resume: bool) -> RunLogger:
    """Only now is anything written: the run directory, repaired after a crash when resuming, and the config."""
    repaired: list = []
    if dist_info.is_main:
        repaired = prepare_run_dir(cfg.output)
        if ckpt is not None:
            repaired += repair_run_dir(cfg.output, ckpt, cfg.checkpoint_every)
        save_config(cfg, os.path.join(cfg.output, 'config.yaml'))
    barrier()
    log = RunLogger(cfg.output, dist_info.is_main, cfg.to_dict(), cfg.log_wandb, cfg.wandb_project,
                    cfg.experiment, resume)
    if stop_request.acknowledge():
        log.info(f'removed a stale {stop_request.stop_file} from an earlier invocation')
    if repaired:
        log.info(f'after an interrupted run: removed or rewrote {", ".join(os.path.basename(r) for r in repaired)}')
    if ckpt is not None:
        within = f', after batch {point.batches_done} of that epoch' if point.batches_done else ''
        log.info(f'resumed {cfg.output} at epoch {point.start_epoch}{within} (step {point.num_updates})')
    for note in point.notes:
        log.info(note)
    return log


def _train(cfg: TrainConfig, dist_info: DistInfo, stop_request: StopRequest) -> Dict[str, Any]:
    _set_up_process(cfg, dist_info)
    # Checks that write nothing come first: run directory, checkpoint to resume, model, data, start weights.
    last_path = os.path.join(cfg.output, 'last.pth')
    resume = cfg.resume or (cfg.auto_resume and bool(broadcast_object(os.path.isfile(last_path))))
    _check_on_rank0(lambda: check_run_dir(cfg.output, resume, cfg.to_dict()), dist_info)
    ckpt = load_training_checkpoint(last_path) if resume else None
    now = geometry(cfg.batch_size, dist_info.world_size, cfg.accum_steps)
    if ckpt is not None:
        check_same_run(ckpt, cfg.to_dict(), last_path)
        check_geometry(ckpt, now, last_path)
    run = assemble(cfg, dist_info, ckpt, last_path, stop_request)
    point = ResumePoint() if ckpt is None else restore(
        ckpt, last_path, run.step, run.scheduler, run.skipper, now, run.updates_per_epoch, cfg.sched_on_updates,
        dist_info)
    log = _open_run_dir(cfg, dist_info, stop_request, ckpt, point, resume)
    del ckpt
    if run.step.model_ema is not None and not run.evaluate_ema:
        log.info('the EMA is kept on the cpu (model_ema_force_cpu): as in timm, it is not evaluated during training; '
                 'its weights are saved and exported (evaluate them with eval.py)')
    key_dim = key_dim_of(_unwrap(run.model), cfg.model, cfg.model_kwargs)
    log.info(f'{cfg.model} (key dim {key_dim}, {run.num_params / 1e6:.2f}M params) on {dist_info.world_size} x '
             f'{dist_info.device.type}: {len(run.train_set)} train / {len(run.val_set)} val images, global batch '
             f'{run.global_batch}, lr {run.lr:.3g}, {cfg.epochs} epochs')
    if point.rng_states is not None:  # last thing before the loop, so nothing above shifts the streams
        if len(point.rng_states) == dist_info.world_size:
            set_rng_state(point.rng_states[dist_info.rank])
        else:
            log.info(f'warning: checkpoint has RNG states for {len(point.rng_states)} ranks, running on '
                     f'{dist_info.world_size}: RNG streams are not restored')

    epochs_run, bad_images = 0, 0.0
    for epoch in range(point.start_epoch, cfg.epochs):
        start = time.perf_counter()
        epoch_rng = rng_state()  # what a mid-epoch checkpoint stores (the sampler's order depends on the epoch only)
        record = _train_epoch(cfg, run, point, epoch, log)
        stopped = record.pop('stopped')
        if stopped and point.batches_done:
            return _stop_inside_epoch(cfg, run, point, epoch, epoch_rng, record, log, stop_request)
        if not cfg.sched_on_updates:
            run.scheduler.step(epoch + 1)
        bad_images = _evaluate_epoch(cfg, run, point, epoch, record, bad_images, log)
        record.update(epoch=epoch, step=point.num_updates, epoch_time=time.perf_counter() - start)
        _save_epoch(cfg, run, point, epoch, record)
        log.log_epoch(record)
        epochs_run += 1
        stop_reason = 'stop_after' if cfg.stop_after and epochs_run >= cfg.stop_after else None
        if stopped or stop_reason:
            stop_reason = stop_reason or stop_request.decided
        if stop_reason and epoch + 1 < cfg.epochs:
            stop_request.acknowledge()
            log.info(f'stopping after epoch {epoch} ({stop_reason}); continue with --resume')
            log.finish()
            return {'stopped_at_epoch': epoch, 'batches_done': 0, 'step': point.num_updates, 'output': cfg.output}
    stop_request.acknowledge()  # a stop asked for during the last epoch has nothing left to stop
    return _finish(cfg, run, point, key_dim, log)


def _train_epoch(cfg: TrainConfig, run: RunParts, point: ResumePoint, epoch: int, log: RunLogger) -> Dict[str, Any]:
    """One training pass (the rest of the epoch after a mid-epoch resume); ``point`` advances. A non-finite loss
    becomes the run's one-line error."""
    run.skipper.skip = point.batches_done * cfg.batch_size
    if hasattr(run.train_loader.sampler, 'set_epoch'):
        run.train_loader.sampler.set_epoch(epoch)
    try:
        record, point.num_updates = train_one_epoch(run.model, run.train_loader, run.step, epoch, point.num_updates)
    except NonFiniteLossError as e:
        hint = '' if cfg.skip_nonfinite_loss else ' (lower the lr, set clip_grad, or skip such batches with ' \
                                                  'skip_nonfinite_loss: true)'
        raise NonFiniteLossError(f'{e}: training stopped; {_last_good(cfg.output, run.step.dist_info)}{hint}') \
            from None
    skipped = record.pop('nonfinite_skipped')
    if skipped:
        record['nonfinite_skipped'] = skipped
        log.info(f'warning: epoch {epoch}: skipped {skipped} batch(es) with a non-finite loss (skip_nonfinite_loss)')
    epoch_batches = run.skipper.skip // cfg.batch_size + len(run.train_loader)
    point.batches_done += record.pop('batches')
    if not (record['stopped'] and point.batches_done < epoch_batches):
        point.batches_done = 0  # the epoch is complete
    return record


def _evaluate_epoch(cfg: TrainConfig, run: RunParts, point: ResumePoint, epoch: int, record: Dict[str, Any],
                    bad_images: float, log: RunLogger) -> float:
    """Evaluation (model and EMA) when due, unreadable-image counts, best top-1; returns the bad-image count."""
    dist_info = run.step.dist_info
    if epoch + 1 == cfg.epochs or (epoch + 1) % max(cfg.eval_every, 1) == 0:
        point.metrics = evaluate(run.model, run.val_loader, dist_info, run.val_samples, run.step.autocast)
        record.update(top1=point.metrics['top1'], top5=point.metrics['top5'], val_loss=point.metrics['loss'],
                      val_samples=point.metrics['num_samples'])
        if run.evaluate_ema:
            ema = evaluate(run.step.model_ema.module, run.val_loader, dist_info, run.val_samples, run.step.autocast)
            record.update(ema_top1=ema['top1'], ema_top5=ema['top5'], ema_val_loss=ema['loss'])
    if cfg.skip_bad_images:
        counts = all_reduce_sum(torch.tensor([float(getattr(run.train_set, 'skipped', lambda: 0)()),
                                              float(getattr(run.val_set, 'skipped', lambda: 0)())],
                                             dtype=torch.float64, device=dist_info.device)).tolist()
        if sum(counts) > bad_images:
            log.info(f'warning: skipped {int(counts[0])} unreadable train and {int(counts[1])} val image(s) so far '
                     f'(skip_bad_images)')
        bad_images = sum(counts)
        if bad_images:
            record['bad_images_skipped'] = int(bad_images)
    if 'top1' in record and record['top1'] > point.best_top1:
        point.best_top1, point.best_epoch = record['top1'], epoch
    return bad_images


def _check_weights(cfg: TrainConfig, run: RunParts, when: str) -> None:
    """Never checkpoint or export NaN/inf weights (every rank holds the same weights, so all stop together)."""
    ema = run.step.model_ema
    bad = nonfinite_weights(_unwrap(run.model), ema.module if ema is not None else None)
    if bad:
        raise NonFiniteLossError(f'non-finite weights ({", ".join(bad)}) {when}: not saved; '
                                 f'{_last_good(cfg.output, run.step.dist_info)}')


def _save_epoch(cfg: TrainConfig, run: RunParts, point: ResumePoint, epoch: int, record: Dict[str, Any]) -> None:
    """last.pth is the commit point: written first; best/epoch files and the log record are re-derived from it
    by repair_run_dir when a kill falls between these writes."""
    dist_info = run.step.dist_info
    _check_weights(cfg, run, f'after epoch {epoch}')
    rng_all = _gather_rng(dist_info, rng_state())
    if dist_info.is_main:
        state = checkpoint_state(cfg, run, point, epoch, rng_all, record)
        save_checkpoint(state, os.path.join(cfg.output, 'last.pth'))
        if point.best_epoch == epoch:
            save_checkpoint(state, os.path.join(cfg.output, 'best.pth'))
        if cfg.checkpoint_every and (epoch + 1) % cfg.checkpoint_every == 0:
            save_checkpoint(state, os.path.join(cfg.output, f'epoch_{epoch:04d}.pth'))


def _stop_inside_epoch(cfg: TrainConfig, run: RunParts, point: ResumePoint, epoch: int, epoch_rng: Dict[str, Any],
                       record: Dict[str, Any], log: RunLogger, stop_request: StopRequest) -> Dict[str, Any]:
    """Checkpoint a stop inside ``epoch`` (its start RNG states and those at the stop) and leave."""
    dist_info = run.step.dist_info
    _check_weights(cfg, run, f'at the stop inside epoch {epoch}')
    rng_at_start, rng_at_stop = _gather_rng(dist_info, epoch_rng), _gather_rng(dist_info, rng_state())
    if dist_info.is_main:
        state = checkpoint_state(cfg, run, point, epoch - 1, rng_at_start, record, point.batches_done)
        save_checkpoint({**state, 'rng_at_stop': rng_at_stop, 'sample_order': SAMPLE_ORDER},
                        os.path.join(cfg.output, 'last.pth'))
    barrier()
    stop_request.acknowledge()
    log.info(f'stop requested ({stop_request.decided}): saved {cfg.output}/last.pth inside epoch {epoch} after batch '
             f'{point.batches_done} (step {point.num_updates}); continue with --resume')
    log.finish()
    return {'stopped_at_epoch': epoch, 'batches_done': point.batches_done, 'step': point.num_updates,
            'output': cfg.output}


def _finish(cfg: TrainConfig, run: RunParts, point: ResumePoint, key_dim, log: RunLogger) -> Dict[str, Any]:
    """Export the final weights (and EMA) as safetensors and print the summary."""
    _check_weights(cfg, run, 'at the end of training')
    model, ema, dist_info = _unwrap(run.model), run.step.model_ema, run.step.dist_info
    summary = {'model': cfg.model, 'key_dim': key_dim, 'params': run.num_params, 'top1': point.metrics.get('top1'),
               'top5': point.metrics.get('top5'), 'best_top1': point.best_top1, 'best_epoch': point.best_epoch,
               'output': cfg.output, 'rank': dist_info.rank, 'weights_sha256': state_dict_sha256(model.state_dict())}
    if ema is not None:
        summary['ema_sha256'] = state_dict_sha256(ema.module.state_dict())
    if dist_info.is_main:
        extra = {'data_config': {k: list(v) if isinstance(v, tuple) else v for k, v in run.data_cfg.items()},
                 'metrics': {k: summary[k] for k in ('top1', 'top5')}}
        export_safetensors(model.state_dict(), os.path.join(cfg.output, 'model.safetensors'), cfg.model,
                           run.model_kwargs, extra)
        if ema is not None:
            export_safetensors(ema.module.state_dict(), os.path.join(cfg.output, 'model_ema.safetensors'),
                               cfg.model, run.model_kwargs, extra)
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


def main(argv: Optional[list] = None) -> int:
    """Console entry: ``train.py -c CONFIG [--key value ...]``. Config, data and weights errors are one line, exit 2;
    a run stopped by a non-finite loss or a failed write (a full disk) is one line, exit 1."""
    import sys
    from .flags import parse_train_args
    try:
        cfg = parse_train_args(sys.argv[1:] if argv is None else argv)
        train(cfg)
    except (ConfigError, DataError, WeightsError) as e:
        print(f'error: {one_line(e)}', file=sys.stderr)
        return 2
    except (NonFiniteLossError, WriteError) as e:
        print(f'error: {one_line(e)}', file=sys.stderr)
        return 1
    return 0
